"""Gemma 3's text layers in the native engine's fast decode path, and the choice of a model's fast decoder.

`Gemma3Decoder` is `decoders.LlamaLikeDecoder` (preallocated per-layer KV buffers written in place,
the cached padding mask, `extend` / `rewind` for speculative sampling, `admit` / `keep_rows` for
continuous batching, the self-check) with Gemma 3's layer (`Gemma3ForCausalLM`, transformers'
`models/gemma3/modeling_gemma3.py`), each part run through the model's own modules:

- embeddings scaled by sqrt(hidden) (the model's `Gemma3TextScaledWordEmbedding`), the head tied to them;
- four Gemma RMSNorms per layer: x += post_attention_norm(attention(input_norm(x))), then
  x += post_feedforward_norm(mlp(pre_feedforward_norm(x)));
- QK-norm (per-head `q_norm` / `k_norm` before the rotary embedding) and attention scaled by
  `query_pre_attn_scalar ** -0.5` (the attention module's `scaling`), as the base decoder does;
- per layer type (`config.layer_types`): `sliding_attention` layers attend to the last
  `config.sliding_window` cache columns (transformers' mask: key column > query column - window) and
  take the rotary embedding of their own base (10k in Gemma 3), `full_attention` layers every column
  and the global base (1M);
- final logit soft-capping when `final_logit_softcapping` is set (Gemma 3's is not); attention
  logit soft-capping and bidirectional attention are refused (`decoders.gemma3_unsupported_reason`).

A row's cache columns are its positions with nothing between them (left padding before them only:
the engine never prefills a shared prefix for a sliding-window model; `rewind` takes back the last
columns), so a window of columns is a window of positions, as in training's forward. In `step` every
row's token sits at the same column, so a sliding layer attends to the window's columns only: its
cost stays that of `sliding_window` positions however long the sequence grows.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from posttrain.models.generation.decoders import GEMMA3_LAYERS, LlamaLikeDecoder

# The window the self-check shortens sliding layers to, so that it cuts its 5 + 2 positions.
SELF_CHECK_WINDOW = 3


class Gemma3Decoder(LlamaLikeDecoder):
    """`LlamaLikeDecoder` for Gemma 3's text layers (see the module docstring)."""

    layer_classes = GEMMA3_LAYERS

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        config = model.config
        self.layer_types = list(config.layer_types[: len(self.layers)])
        self.windows = [config.sliding_window if kind == "sliding_attention" else None for kind in self.layer_types]
        self.final_logit_softcapping = config.final_logit_softcapping

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        by_type = {kind: self.rotary_emb(x, positions, kind) for kind in sorted(set(self.layer_types))}
        return [by_type[kind] for kind in self.layer_types]

    def _attention_residual(self, layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        return x + layer.post_attention_layernorm(attended)

    def _feed_forward_residual(self, layer, x: torch.Tensor) -> torch.Tensor:
        return x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = super()._logits(x)
        cap = self.final_logit_softcapping
        if cap is not None:  # as Gemma3ForCausalLM.forward
            logits = torch.tanh(logits / cap) * cap
        return logits

    @contextlib.contextmanager
    def _windows_for_self_check(self) -> Iterator[None]:
        """The model's window (`config.sliding_window`, which its masks read, and its attention modules')
        and this decoder's set to `SELF_CHECK_WINDOW`, restored on exit, so the self-check compares the
        window's cut with the release's own masks."""
        config, windows = self.model.config, self.windows
        sliding = [layer.self_attn for layer, window in zip(self.layers, windows) if window is not None]
        if not sliding:
            yield
            return
        saved = config.sliding_window, [attention.sliding_window for attention in sliding]
        try:
            config.sliding_window = SELF_CHECK_WINDOW
            for attention in sliding:
                attention.sliding_window = SELF_CHECK_WINDOW
            self.windows = [None if window is None else SELF_CHECK_WINDOW for window in windows]
            yield
        finally:
            config.sliding_window = saved[0]
            for attention, window in zip(sliding, saved[1]):
                attention.sliding_window = window
            self.windows = windows


def fast_decoder(model: torch.nn.Module) -> LlamaLikeDecoder:
    """The fast decoder of a model `decoders.unsupported_reason` accepts: `Gemma3Decoder` for Gemma 3's
    layers, else `LlamaLikeDecoder`."""
    if {type(layer).__name__ for layer in model.model.layers} <= GEMMA3_LAYERS:
        return Gemma3Decoder(model)
    return LlamaLikeDecoder(model)
