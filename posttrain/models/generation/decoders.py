"""Decode steps for `NativeGenerationEngine`: the model's own forward, or a faster one for llama-like models
and Gemma 3.

The engine prefills with the model's forward into a `DynamicCache`, then hands that cache to a
decoder, which feeds one token per running row per step and returns the next-token logits:

- `ModelForwardDecoder`: the model's forward with a `DynamicCache` and a 2-D attention mask, for
  any Hugging Face causal LM.
- `LlamaLikeDecoder`: for the decoder families in `LLAMA_LIKE_LAYERS` (llama, mistral, qwen2,
  qwen3, qwen3_moe, mixtral). It runs the model's own modules and functions (embedding, norms,
  projections, rotary embedding and `apply_rotary_pos_emb`, MLP or mixture-of-experts block) and
  calls SDPA as transformers does, so its logits are the forward's bit for bit (SmolLM2-135M, 32
  rows), and differs from the forward in two places (measured on SmolLM2-135M, 2 CPU cores,
  benchmarks/README.md):
  - KV cache: one `[rows, kv_heads, prompt + new tokens, head_dim]` buffer per layer, written in
    place. `DynamicCache` concatenates each layer's whole cache every step (copying that grows
    with the sequence: 21 ms of a 164 ms step at 32 rows and 88 positions, 1 thread).
  - Attention mask: a `[rows, 1, 1, positions]` additive buffer (0 or -inf, what SDPA turns a
    boolean mask into on every call) built once and sliced, instead of a 4-D mask built from the
    2-D one every step and converted in each layer.
- `gemma3_decoder.Gemma3Decoder`: `LlamaLikeDecoder` for Gemma 3's text layers (`GEMMA3_LAYERS`):
  its four norms per layer and soft-capped logits through the hooks `_rotary`, `_attention_residual`,
  `_feed_forward_residual` and `_logits`, and per layer a sliding window (`windows`): a step's
  sliding layers attend to the window's last columns only, `extend` masks the columns before each
  query's window. Its logits are the forward's to float32 rounding once the window cuts (the
  forward attends over every column, masked: 3e-7 on the tiny preset, 4.6e-5 on logits of Gemma 3
  270M at 600 positions), bit for bit before. `gemma3_decoder.fast_decoder` picks the class.

Both also take several tokens per row at once for speculative sampling (`speculative.py`):
`extend(tokens [rows, m], positions)` feeds them after each row's cache with a causal mask among
them and returns the logits of all m; `rewind(counts)` takes back each row's last `counts` fed
tokens, so rows that keep different numbers of drafted tokens stay exact. `LlamaLikeDecoder`
keeps a fill per row and overwrites what was taken back; `ModelForwardDecoder` masks it out.

`unsupported_reason` says why a model cannot use the fast decoders (Gemma 3: `gemma3_unsupported_reason`,
e.g. attention logit soft-capping), and `LlamaLikeDecoder.self_check` compares a decode step and an
`extend` against the model's forward before first use (sliding windows shortened so that they cut),
so a transformers release that changes a layer's maths or its window's mask falls back to the
forward instead of generating from another model.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from posttrain.models.generation.output_head import head_logits

# Decoder layers computing x += o_proj(attention(input_layernorm(x))); x += mlp(post_attention_layernorm(x)),
# where attention is q/k/v projections (Qwen3: per-head q_norm/k_norm first), the rotary embedding and
# SDPA over grouped KV heads, with no sliding window.
LLAMA_LIKE_LAYERS = frozenset({
    "LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
    "Qwen3MoeDecoderLayer", "MixtralDecoderLayer",
})
# Gemma 3's text layers (`gemma3_decoder.Gemma3Decoder`): the same attention with QK-norm, and per layer
# type a sliding window and its own RoPE base; four norms per layer.
GEMMA3_LAYERS = frozenset({"Gemma3DecoderLayer"})
# Gemma 3's layer types: a window of `config.sliding_window` cache columns, or every column.
GEMMA3_LAYER_TYPES = frozenset({"sliding_attention", "full_attention"})


class ModelForwardDecoder:
    """Decode with the model's own forward, a `DynamicCache` and a 2-D attention mask (any causal LM)."""

    # `DynamicCache` copies the whole cache every step, so finished rows are dropped at once.
    keeps_finished_rows = False

    def __init__(self, model: torch.nn.Module, supports_logits_to_keep: bool):
        self.model = model
        self.extra_args = {"logits_to_keep": 1} if supports_logits_to_keep else {}
        self.cache: Optional[DynamicCache] = None
        self.attention_mask: Optional[torch.Tensor] = None

    def start(self, prefill_cache: DynamicCache, prompt_mask: torch.Tensor, row_map: torch.Tensor, capacity: int):
        """See `LlamaLikeDecoder.start` (`capacity` is unused: the cache grows)."""
        if not torch.equal(row_map, torch.arange(prompt_mask.shape[0], device=row_map.device)):
            prefill_cache.batch_select_indices(row_map)  # one cache row per running row
        self.cache, self.attention_mask = prefill_cache, prompt_mask.index_select(0, row_map)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """See `LlamaLikeDecoder.step`."""
        mask = self.attention_mask
        self.attention_mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        out = self.model(
            input_ids=tokens.unsqueeze(1), attention_mask=self.attention_mask, position_ids=positions.unsqueeze(1),
            past_key_values=self.cache, use_cache=True, **self.extra_args,
        )
        return out.logits[:, -1, :]

    def extend(self, tokens: torch.Tensor, positions: torch.Tensor, num_layers: Optional[int] = None) -> torch.Tensor:
        """See `LlamaLikeDecoder.extend` (`num_layers` is not supported: the model's forward runs every layer)."""
        if num_layers is not None:
            raise ValueError("ModelForwardDecoder runs the whole model: drafting with its first layers needs LlamaLikeDecoder")
        mask = self.attention_mask
        width = tokens.shape[1]
        self.attention_mask = torch.cat([mask, mask.new_ones(mask.shape[0], width)], dim=1)
        extra = {"logits_to_keep": width} if self.extra_args else {}
        # The cache grows by `width` columns; the causal mask is in cache columns and positions are
        # explicit, so columns taken back by `rewind` (mask 0) can sit between kept ones.
        out = self.model(
            input_ids=tokens, attention_mask=self.attention_mask, position_ids=positions,
            past_key_values=self.cache, use_cache=True, **extra,
        )
        return out.logits[:, -width:, :]

    def rewind(self, counts: torch.Tensor) -> None:
        """See `LlamaLikeDecoder.rewind`: the last `counts[r]` unmasked columns of row r are masked."""
        mask = self.attention_mask
        from_right = mask.flip(1).cumsum(1).flip(1)  # unmasked columns from here to the end
        mask.masked_fill_((from_right <= counts.unsqueeze(1)) & (mask == 1), 0)

    def keep_rows(self, keep: torch.Tensor) -> None:
        """See `LlamaLikeDecoder.keep_rows`."""
        self.cache.batch_select_indices(keep)
        self.attention_mask = self.attention_mask[keep]

    def release(self) -> None:
        """See `LlamaLikeDecoder.release`."""
        self.cache, self.attention_mask = None, None


def unsupported_reason(model: torch.nn.Module) -> Optional[str]:
    """None if `LlamaLikeDecoder` can decode for `model`, else why not (one line)."""
    config = getattr(model, "config", None)
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if config is None or layers is None or not all(hasattr(base, a) for a in ("norm", "rotary_emb")):
        return f"{type(model).__name__} is not a decoder with model.layers, model.norm and model.rotary_emb"
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attention implementation {config._attn_implementation!r} (this path reproduces 'sdpa')"
    names = {type(layer).__name__ for layer in layers}
    if names <= GEMMA3_LAYERS:
        return gemma3_unsupported_reason(model)
    if not names <= LLAMA_LIKE_LAYERS:
        return f"decoder layers {sorted(names - LLAMA_LIKE_LAYERS)} are not llama-like"
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))} (only full attention is reproduced)"
    if has_sliding_window(model):
        return f"sliding window {getattr(config, 'sliding_window', None)}"
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        return "the output embedding is not an nn.Linear"
    return None


def gemma3_unsupported_reason(model: torch.nn.Module) -> Optional[str]:
    """None if `gemma3_decoder.Gemma3Decoder` reproduces this Gemma 3 text model's forward, else why not."""
    config = model.config
    layer_types = list(getattr(config, "layer_types", None) or ())
    if len(layer_types) < len(model.model.layers) or not set(layer_types) <= GEMMA3_LAYER_TYPES:
        return f"layer types {sorted(set(layer_types))} (Gemma 3's are {sorted(GEMMA3_LAYER_TYPES)}, one per layer)"
    if "sliding_attention" in layer_types and not getattr(config, "sliding_window", None):
        return "sliding_attention layers without a sliding_window"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention (this path decodes causally)"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return f"attn_logit_softcapping {config.attn_logit_softcapping} (not reproduced)"
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        return "the output embedding is not an nn.Linear"
    return None


def has_sliding_window(model: torch.nn.Module) -> bool:
    """Whether some attention layer of `model` sees only a window of the last positions (Mistral's
    `sliding_window`, Gemma 3's local layers). transformers counts the window in cache columns, so
    such a model's cache must hold no masked columns between a row's tokens (`engine.py`)."""
    config = getattr(model, "config", None)
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return True
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return True
    return any(getattr(module, "sliding_window", None) is not None for module in model.modules()
               if module is not model and hasattr(module, "o_proj"))


def grouped_decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int, bias: Optional[torch.Tensor], scale: float,
    start: int = 0,
) -> torch.Tensor:
    """Attention of one query token per row over cache columns `start` to `length` (a sliding window starts
    later than 0), as two batched matmuls around a float32 softmax.

    Args:
        q: `[rows, heads, 1, d]`; keys, values: the whole cache buffers `[rows, kv_heads, capacity, d]`
            (heads a multiple of kv_heads). Columns from `length` on are ignored; those of `values`
            must be finite (they are multiplied by 0).
        bias: `[rows, 1, 1, >= length]` additive mask (0 or -inf), or None.
        start: the first column attended to (default 0).

    Returns `[rows, heads, 1, d]` in q's dtype. The heads sharing a KV head are that head's queries (as
    pack_gqa), so no KV head is copied; the matmuls run over the whole buffers because a slice of
    them is strided, which CPU 16-bit matmuls would copy to contiguous memory first (as slow as the
    attention itself). Scores and probabilities round once to q's dtype, as a fused kernel's do.
    """
    rows, heads, _, head_dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(rows, kv_heads, heads // kv_heads, head_dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2))[..., start:length].float() * scale  # [rows, kv, group, cols]
    if bias is not None:
        scores = scores + bias[..., start:length]
    probabilities = scores.new_zeros(*scores.shape[:3], keys.shape[2], dtype=q.dtype)
    probabilities[..., start:length] = scores.softmax(-1)
    return torch.matmul(probabilities, values).reshape(rows, heads, 1, head_dim)


class LlamaLikeDecoder:
    """One-token decode steps over a preallocated KV cache, for a model `unsupported_reason` accepts.

    Usage: `start(...)` once per generation with the prefill's cache, then `step(...)` per token, or
    `extend(...)` / `rewind(...)` (several tokens per row; not mixed with `step` in one generation);
    `keep_rows(...)` drops finished rows. Holds the model's modules, not copies of its weights, so
    refits (in-place weight copies) and device moves need no action.
    """

    # Dropping rows copies the whole cache, while a finished row left in the batch costs a little
    # matmul and attention work per step: the engine drops finished rows in batches.
    keeps_finished_rows = True
    # The decoder layers this class reproduces (a subclass reproduces another layer: `gemma3_decoder.py`).
    layer_classes = LLAMA_LIKE_LAYERS

    def __init__(self, model: torch.nn.Module):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"{type(self).__name__} cannot decode for this model: {reason}")
        names = {type(layer).__name__ for layer in model.model.layers}
        if not names <= self.layer_classes:
            raise ValueError(f"{type(self).__name__} does not reproduce decoder layers {sorted(names)}: "
                             "gemma3_decoder.fast_decoder picks the decoder of a model's layers")
        config = model.config
        self.model = model
        self.embed = model.get_input_embeddings()
        self.layers = list(model.model.layers)
        self.norm = model.model.norm
        self.rotary_emb = model.model.rotary_emb
        self.lm_head = model.get_output_embeddings()
        first_attention = self.layers[0].self_attn
        # The modeling module's own rotary function, so the model's variant is applied as it applies it.
        self.apply_rotary = sys.modules[type(first_attention).__module__].apply_rotary_pos_emb
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = first_attention.head_dim
        # Per layer, the cache columns a token attends to, ending at its own (transformers' sliding window:
        # key column > query column - window), or None: all (a subclass with sliding-window layers sets it).
        self.windows: list[Optional[int]] = [None] * len(self.layers)
        self.keys: list[torch.Tensor] = []  # per layer [rows, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.attention_bias: Optional[torch.Tensor] = None  # [rows, 1, 1, capacity]: 0 or -inf (padding)
        self.length = 0  # the column `step` writes next, the same for every row (admission right-aligns to it)
        self.fill: Optional[torch.Tensor] = None  # [rows] positions filled per row (`extend` / `rewind` only)
        self.rows = 0
        self.has_padding = False  # some running row has a masked (left-padding) position
        self.first_column: Optional[torch.Tensor] = None  # [rows] the row's first unmasked cache column
        # CPU SDPA is slow for one bfloat16/float16 query per head (2.4 ms a call at 32 rows and 150
        # positions on SmolLM2's heads, 12x two batched matmuls): `step` attends with the matmuls there.
        self.cpu_16bit = False  # set by `start` from the cache

    def start(
        self, prefill_cache: DynamicCache, prompt_mask: torch.Tensor, row_map: torch.Tensor, capacity: int
    ) -> None:
        """Build the cache of the running rows from a prefill over `U` distinct prompts.

        Args:
            prefill_cache: the prefill's cache, `[U, kv_heads, P, head_dim]` per layer.
            prompt_mask: `[U, P]` attention mask of the left-padded prompts.
            row_map: `[B]` the prompt (index into U) of each running row.
            capacity: positions to hold, at least P + the tokens that will be fed.
        """
        rows, width = row_map.numel(), prompt_mask.shape[1]
        prefilled = prefill_cache.layers[0].keys
        self.cpu_16bit = prefilled.device.type == "cpu" and prefilled.dtype in (torch.bfloat16, torch.float16)
        # Zeros, not empty memory: `grouped_decode_attention` multiplies unwritten value columns by 0, and a
        # row admitted later masks columns it never wrote: both must be finite. The running rows then are
        # the prompts admitted into the empty buffers.
        def zeros_like_layer(prefilled: torch.Tensor) -> torch.Tensor:
            return prefilled.new_zeros(rows, prefilled.shape[1], capacity, prefilled.shape[3])

        self.keys = [zeros_like_layer(layer.keys) for layer in prefill_cache.layers]
        self.values = [zeros_like_layer(layer.values) for layer in prefill_cache.layers]
        self.attention_bias = self.keys[0].new_zeros(rows, 1, 1, capacity)
        self.length, self.rows, self.has_padding = width, 0, False
        self.fill = torch.full((rows,), width, dtype=torch.long, device=row_map.device)
        self.first_column = torch.zeros(rows, dtype=torch.long, device=row_map.device)
        self._place(prefill_cache, prompt_mask, row_map)

    def admit(self, prefill_cache: DynamicCache, prompt_mask: torch.Tensor, row_map: torch.Tensor) -> None:
        """Add rows after the running ones (continuous batching): the prompts of a prefill, right-aligned so
        that their first fed token goes to the next column, as every running row's does.

        Args as `start`; the prompts' width must be at most `length`, and the buffers must have room for the
        rows (`keep_rows` freed it). The new rows' columns before their prompts are masked.
        """
        count, width = row_map.numel(), prompt_mask.shape[1]
        if self.length < width or self.rows + count > self.keys[0].shape[0]:
            raise ValueError(f"cannot admit {count} rows of {width} positions: the cache holds {self.rows} of "
                             f"{self.keys[0].shape[0]} rows and is filled to {self.length}")
        self._place(prefill_cache, prompt_mask, row_map)

    def _place(self, prefill_cache: DynamicCache, prompt_mask: torch.Tensor, row_map: torch.Tensor) -> None:
        """Write the prompts' cache into the slots after the running rows, ending at column `length`, and mask
        what is not theirs (`start`, `admit`)."""
        first, end = self.length - prompt_mask.shape[1], self.length
        short = [i for i, layer in enumerate(prefill_cache.layers) if layer.keys.shape[2] != end - first]
        if short:  # `DynamicCache(config=...)` keeps only a sliding layer's window
            raise ValueError(f"the prefill cache of layer {short[0]} holds {prefill_cache.layers[short[0]].keys.shape[2]} "
                             f"of the prompts' {end - first} positions: prefill into a DynamicCache() without a config")
        count, slots = row_map.numel(), slice(self.rows, self.rows + row_map.numel())
        for layer, keys, values in zip(prefill_cache.layers, self.keys, self.values):
            keys[slots, :, first:end] = layer.keys.index_select(0, row_map)
            values[slots, :, first:end] = layer.values.index_select(0, row_map)
        padding = prompt_mask.index_select(0, row_map) == 0
        bias = self.attention_bias[slots, 0, 0]
        bias[:, :first] = float("-inf")
        bias[:, first:] = 0
        bias[:, first:end].masked_fill_(padding, float("-inf"))
        self.fill[slots] = end
        self.first_column[slots] = first + padding.cumprod(1).sum(1)
        self.rows += count
        self.has_padding = self.has_padding or first > 0 or bool(padding.any())

    def keep_rows(self, keep: torch.Tensor, shift: int = 0) -> None:
        """Keep only the running rows `keep` (indices into the running rows), moved to the front, and with
        `shift` > 0 their columns moved `shift` to the left (the first `shift` columns must be masked in
        every kept row: `first_column`), so that the cache gains room (and SDPA, which attends up to
        `length`, spans fewer columns; the CPU 16-bit attention runs over the whole buffers)."""
        count, filled = keep.numel(), max(self.length, int(self.fill[: self.rows].max()))
        if shift and count and shift > int(self.first_column[keep].min()):
            raise ValueError(f"shift {shift} would drop cache columns a kept row attends to")
        for buffer in self.keys + self.values:
            buffer[:count, :, : filled - shift] = buffer[keep, :, shift:filled]
        self.attention_bias[:count, :, :, : filled - shift] = self.attention_bias[keep, :, :, shift:filled]
        self.attention_bias[:count, :, :, filled - shift : filled] = 0  # columns the rows will write next
        self.fill[:count] = self.fill[keep] - shift
        self.first_column[:count] = self.first_column[keep] - shift
        self.length -= shift
        self.rows = count
        self.has_padding = bool(self.attention_bias[:count, :, :, : filled - shift].isinf().any())

    def release(self) -> None:
        """Drop the cache at the end of a generation. The engine keeps its decoder from one
        generation to the next: without this, a generation's KV cache stayed allocated through the
        phases after it (a 32-row call of SmolLM2 at 528 positions: 0.73 GiB held through training)
        and through the next generation's prefill."""
        self.keys, self.values, self.attention_bias, self.fill, self.first_column = [], [], None, None, None
        self.length = self.rows = 0

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed one token per running row; returns the next-token logits `[rows, V]`.

        Args:
            tokens: `[rows]` token ids.
            positions: `[rows]` their position ids.
        """
        rows, column = tokens.numel(), self.length
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        if rows != self.rows:
            raise ValueError(f"step got {rows} rows, the cache holds {self.rows}")
        if column >= self.keys[0].shape[2]:
            raise RuntimeError(f"KV cache full ({column} positions)")
        x = self.embed(tokens)  # [rows, hidden]
        rotary = self._rotary(x, positions.unsqueeze(1))  # per layer (cos, sin) [rows, 1, head_dim]
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            cos, sin = rotary[index]
            q, k, v = self._qkv(attention, layer.input_layernorm(x).unsqueeze(1), cos, sin)  # q, k [rows, heads, 1, d]
            keys, values = self.keys[index], self.values[index]
            keys[:rows, :, column] = k[:, :, 0]
            values[:rows, :, column] = v[:, 0]
            # Every row's token sits at this column, so a sliding window is the same columns for all rows:
            # attention spans only them (the forward masks the columns before them).
            window = self.windows[index]
            first, end = (0 if window is None else max(0, column + 1 - window)), column + 1
            bias = self.attention_bias[:rows, :, :, first:end]
            # On CPU in 16 bits, two matmuls (`grouped_decode_attention`). Elsewhere the two SDPA calls
            # transformers makes for one query token (integrations/sdpa_attention.py), so both round alike:
            # without padding, no mask and the KV-head groups inside SDPA; with padding, or a window that
            # cuts (transformers then masks: masking_utils' `_ignore_causal_mask_sdpa`), the mask, and the
            # heads sharing a KV head packed as that head's queries (pack_gqa).
            if self.cpu_16bit:
                out = grouped_decode_attention(q, keys[:rows], values[:rows], end,
                                               self.attention_bias[:rows] if self.has_padding else None,
                                               attention.scaling, start=first)
            elif self.has_padding or (window is not None and end >= window):
                out = F.scaled_dot_product_attention(
                    q.reshape(rows, kv_heads, heads // kv_heads, head_dim), keys[:rows, :, first:end],
                    values[:rows, :, first:end], attn_mask=bias, scale=attention.scaling,
                )
            else:
                out = F.scaled_dot_product_attention(
                    q, keys[:rows, :, first:end], values[:rows, :, first:end], scale=attention.scaling,
                    enable_gqa=heads != kv_heads,
                )
            x = self._attention_residual(layer, x, attention.o_proj(out.reshape(rows, heads * head_dim)))
            # [rows, 1, hidden] as in the model: mixture-of-experts blocks expect a sequence dimension.
            x = self._feed_forward_residual(layer, x.unsqueeze(1)).squeeze(1)
        self.length = column + 1
        return self._logits(x)

    # The parts of a layer that differ between model families (`gemma3_decoder.Gemma3Decoder` overrides them).
    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's rotary `(cos, sin)` `[rows, m, head_dim]` for `positions [rows, m]`: one for all layers."""
        return [self.rotary_emb(x, positions)] * len(self.layers)

    def _attention_residual(self, layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream after the layer's attention output `attended` (after `o_proj`)."""
        return x + attended

    def _feed_forward_residual(self, layer, x: torch.Tensor) -> torch.Tensor:
        """The residual stream `[rows, m, hidden]` after the layer's MLP (or mixture-of-experts) block."""
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token logits from the last layer's residual stream (the head in slices where that pays off:
        `output_head.py`)."""
        return head_logits(self.lm_head, self.norm(x))

    def _qkv(self, attention, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The layer's queries and keys `[rows, (kv_)heads, m, d]` (rotated) and values `[rows, m, kv_heads, d]`
        for `h [rows, m, hidden]` (the input norm's output)."""
        rows, width = h.shape[:2]
        h = h.reshape(rows * width, h.shape[2])  # 2-D, as the one-token step always projected
        q = attention.q_proj(h).view(rows, width, self.num_heads, self.head_dim)
        k = attention.k_proj(h).view(rows, width, self.num_kv_heads, self.head_dim)
        v = attention.v_proj(h).view(rows, width, self.num_kv_heads, self.head_dim)
        if hasattr(attention, "q_norm"):  # Qwen3: RMSNorm per head
            q, k = attention.q_norm(q), attention.k_norm(k)
        q, k = self.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v

    def extend(self, tokens: torch.Tensor, positions: torch.Tensor, num_layers: Optional[int] = None) -> torch.Tensor:
        """Feed `m` tokens per running row after the row's cache; returns their next-token logits `[rows, m, V]`.

        Token i of row r goes to cache column `fill[r] + i` and attends to the row's valid columns up to
        itself (causal among the m); every row's fill then grows by m (`rewind` takes tokens back).

        Args:
            tokens: `[rows, m]` token ids.
            positions: `[rows, m]` their position ids.
            num_layers: run only the first `num_layers` layers, then the final norm and the output
                head (early-exit drafts; default None: all). Only those layers' cache is written;
                the full forward that follows at the same columns overwrites it.
        """
        rows, width = tokens.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        if rows != self.rows:
            raise ValueError(f"extend got {rows} rows, the cache holds {self.rows}")
        columns = self.fill[:rows].unsqueeze(1) + torch.arange(width, device=tokens.device)  # [rows, m]
        span = int(columns.max()) + 1
        if span > self.keys[0].shape[2]:
            raise RuntimeError(f"KV cache full ({span} positions)")
        cache_column = torch.arange(span, device=tokens.device)
        # [rows, 1, m, span]: not left padding, and not after the query (stale columns past a row's
        # fill, left by `rewind`, are after every query of the row).
        allowed = (self.attention_bias[:rows, :, :, :span] == 0) & (cache_column <= columns.unsqueeze(2)).unsqueeze(1)
        # Sliding-window layers: also not `window` or more columns before the query (rows' columns differ).
        masks = {window: allowed & (cache_column > columns.unsqueeze(2) - window).unsqueeze(1)
                 for window in set(self.windows) - {None}}
        masks[None] = allowed
        row_index = torch.arange(rows, device=tokens.device).unsqueeze(1).expand(rows, width)
        x = self.embed(tokens)  # [rows, m, hidden]
        rotary = self._rotary(x, positions)  # per layer (cos, sin) [rows, m, head_dim]
        for index, layer in enumerate(self.layers[:num_layers]):
            attention = layer.self_attn
            cos, sin = rotary[index]
            q, k, v = self._qkv(attention, layer.input_layernorm(x), cos, sin)
            keys, values = self.keys[index], self.values[index]
            keys[row_index, :, columns] = k.transpose(1, 2)  # [rows, m, kv_heads, d] into columns[r, i]
            values[row_index, :, columns] = v
            out = F.scaled_dot_product_attention(
                q, keys[:rows, :, :span], values[:rows, :, :span], attn_mask=masks[self.windows[index]],
                scale=attention.scaling, enable_gqa=heads != kv_heads,
            )
            x = self._attention_residual(layer, x, attention.o_proj(out.transpose(1, 2).reshape(rows, width, heads * head_dim)))
            x = self._feed_forward_residual(layer, x)
        self.fill[:rows] += width
        return self._logits(x)

    def rewind(self, counts: torch.Tensor) -> None:
        """Take back the last `counts [rows]` tokens fed to each row by `extend` (overwritten by the next)."""
        self.fill[: self.rows] -= counts

    def _windows_for_self_check(self) -> contextlib.AbstractContextManager:
        """Within it, the model's and this decoder's sliding windows cut the self-check's 5 + 2 positions
        (a subclass with windows shortens them; here: nothing to do)."""
        return contextlib.nullcontext()

    @torch.inference_mode()
    def self_check(self) -> Optional[str]:
        """Compare one decode step, and a two-token `extend`, against the model's forward on two rows
        (one left-padded; sliding windows shortened so that they cut: `_windows_for_self_check`); None if
        they agree to float rounding (1e-4 of the largest logit in float32, 5e-2 in 16-bit types), else
        the difference."""
        vocab, device = self.embed.num_embeddings, self.embed.weight.device
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, vocab, (2, 5), generator=generator).to(device)
        tokens = torch.randint(0, vocab, (2, 2), generator=generator).to(device)
        mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], device=device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        new_positions = positions[:, -1:] + 1 + torch.arange(2, device=device)
        tolerance = 1e-4 if self.embed.weight.dtype == torch.float32 else 5e-2
        for name, width in (("a decode step", 1), ("a two-token extend", 2)):
            cache = DynamicCache()
            with self._windows_for_self_check():
                self.model(input_ids=prompt, attention_mask=mask, position_ids=positions, past_key_values=cache,
                           use_cache=True)
                self.start(cache, mask, torch.arange(2, device=device), capacity=7)
                if width == 1:
                    ours = self.step(tokens[:, 0], new_positions[:, 0]).float().unsqueeze(1)
                else:
                    ours = self.extend(tokens, new_positions).float()
                reference = self.model(
                    input_ids=tokens[:, :width], attention_mask=torch.cat([mask, mask.new_ones(2, width)], 1),
                    position_ids=new_positions[:, :width], past_key_values=cache, use_cache=True,
                ).logits.float()
                self.release()
            error = ((ours - reference).abs().max() / reference.abs().max().clamp(min=1e-6)).item()
            if error > tolerance:
                return f"{name} differs from the model's forward by {error:.2e} of the largest logit"
        return None
