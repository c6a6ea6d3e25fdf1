"""Next-token logprobs straight from the decoder's hidden states, without the `[N, V]` logits.

`linear_logprobs(hidden [N, H], weight [V, H], targets [N])` is
`log_softmax(hidden @ weight.T / temperature)[i, targets[i]]`, computed one tile of logits at a
time: a tile is `[token chunk, vocab block]` float32 logits in one reused buffer (`TILE_BYTES`),
reduced to a running logsumexp (and the target's logit) per token and dropped. Backward recomputes
each tile and turns it in place into `(onehot - softmax) * grad / temperature`, then feeds the two
matmuls for `grad_hidden` and `grad_weight`. The full-vocabulary log-softmax over the micro-batch,
its backward and the fills and copies around it (memory-bound passes over `N x V` floats) are gone;
the price is one more `N x H x V` matmul (the recompute).

Why vocabulary blocks (all of a micro-batch's tokens, a slice of the vocabulary) rather than token
chunks (a few tokens, the whole vocabulary): every token chunk re-reads all of `weight` and, in
backward, reads and writes the whole `[V, H]` weight-gradient accumulator once more; with vocabulary
blocks each block of `weight` is read once per pass and each block of `grad_weight` written once,
while `hidden` and `grad_hidden` (`N x H`, small) stay in cache. Measured on SmolLM2-135M's head
(H 576, V 49152, 2393 tokens, 1 thread, forward + backward): 3.8-3.9 s with 4-16 MiB vocabulary
blocks, 4.1 s with 64 MiB ones, 4.3-4.5 s with 32-128 MiB token chunks and 4.5 s for the full
logits (which skip the recompute); 140 GFLOP/s of `8 N H V` FLOPs, ~90% of the float32 matmul
rate. Tokens are chunked too, only beyond `TILE_BYTES / (4 MIN_VOCAB_BLOCK)` of them (GPU-sized
micro-batches).

`fused_logprobs_problem(model)` says whether a model's logits are provably `lm_head(hidden)` with a
plain linear head (then the worker takes this path), and `final_hidden_states(model)` collects the
decoder's last hidden states during an ordinary `model(...)` call, so FSDP, peft wrappers,
activation checkpointing and MoE router hooks all see the call they always see.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

from posttrain.models.vision_inputs import hf_model
from posttrain.cpu_precision import matmul_dtype

# One tile of float32 logits. Under 32 MiB, glibc's largest mmap threshold, so on CPU the buffer
# comes from the reused heap instead of fresh pages. `benchmarks/train_step_135m.py --kernel`
# reruns the measurement above.
TILE_BYTES = 16 * 2**20
MIN_VOCAB_BLOCK = 512  # narrower blocks make thin matmuls; beyond this many tokens, chunk the tokens

# Model types whose `XForCausalLM.forward` (transformers 5.23) is exactly
# `logits = self.lm_head(slice_logits_to_keep(decoder(...).last_hidden_state, logits_to_keep))`:
# no scaling, soft-capping or bias after the head (Gemma 3: when its final_logit_softcapping is None). Others (Gemma2 final_logit_softcapping,
# Cohere logit_scale, Granite logits_scaling, ...) keep the plain logits path.
PLAIN_HEAD_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "olmo2", "phi3", "gemma",
     "gemma3_text"}  # Gemma 3: soft-capping only when final_logit_softcapping is set (LOGIT_TRANSFORM_KEYS)
)  # not llava: its logprobs leave the image token out of the distribution (vision_inputs.suppress_image_token)
# Config attributes that change logits after the head; any of them set disables the fused path.
LOGIT_TRANSFORM_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def tile_shape(n_tokens: int, vocab_size: int, tile_bytes: int = TILE_BYTES) -> tuple[int, int]:
    """`(token chunk, vocab block)` of a tile of about `tile_bytes` (default `TILE_BYTES`) float32
    logits: all tokens in one chunk unless that would make blocks narrower than `MIN_VOCAB_BLOCK`."""
    elements = tile_bytes // 4
    chunk = max(1, min(n_tokens, elements // MIN_VOCAB_BLOCK))
    return chunk, min(vocab_size, max(MIN_VOCAB_BLOCK, elements // chunk))


class TiledLinearLogprobs(torch.autograd.Function):
    """`(hidden [N, H], weight [V, H], targets [N], temperature, chunk_tokens, vocab_block) -> logprobs [N]`
    (float32), one `[chunk_tokens, vocab_block]` tile of logits at a time.

    `hidden` and `weight` share a dtype (the compute dtype: the caller casts under autocast); each
    tile's logits are taken to float32 before the division by `temperature`, as in
    `next_token_logprobs`; gradients are accumulated in float32 and rounded once at the end.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_tokens: int, vocab_block: int):
        n_tokens = hidden.shape[0]
        logprobs = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
        logsumexp = torch.empty_like(logprobs)
        tiles = _Tiles(hidden, weight, targets, temperature, chunk_tokens, vocab_block)
        for chunk in tiles.token_chunks():
            n = chunk.stop - chunk.start
            running_max = hidden.new_full((n,), -torch.inf, dtype=torch.float32)
            running_sum = hidden.new_zeros((n,), dtype=torch.float32)
            target_logit = hidden.new_zeros((n,), dtype=torch.float32)
            for block in tiles.vocab_blocks():
                logits = tiles.logits(chunk, block)
                rows, columns = tiles.targets_in(chunk, block)
                target_logit[rows] = logits[rows, columns]
                # Online logsumexp (Milakov & Gimelshein 2018): rescale the sum to the new maximum.
                new_max = torch.maximum(running_max, logits.amax(dim=1))
                running_sum.mul_(torch.exp(running_max - new_max))
                running_sum.add_(logits.sub_(new_max[:, None]).exp_().sum(dim=1))
                running_max = new_max
            torch.add(running_sum.log_(), running_max, out=logsumexp[chunk])
            torch.sub(target_logit, logsumexp[chunk], out=logprobs[chunk])
        ctx.save_for_backward(hidden, weight, targets, logsumexp)
        ctx.options = (temperature, chunk_tokens, vocab_block)
        return logprobs

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs):
        hidden, weight, targets, logsumexp = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        temperature = ctx.options[0]
        n_tokens = hidden.shape[0]
        tiles = _Tiles(hidden, weight, targets, *ctx.options)
        float32 = dict(dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty(hidden.shape, **float32) if want_hidden else None
        # Every block is written by the first token chunk; with no tokens there is none.
        grad_weight = (torch.empty if n_tokens else torch.zeros)(weight.shape, **float32) if want_weight else None
        scale = grad_logprobs.float() / temperature  # d logprob_i / d logit_iv = (onehot - softmax) / T
        for chunk_index, chunk in enumerate(tiles.token_chunks()):
            for block_index, block in enumerate(tiles.vocab_blocks()):
                grad_logits = tiles.logits(chunk, block)
                grad_logits.sub_(logsumexp[chunk, None]).exp_().mul_(-scale[chunk, None])
                rows, columns = tiles.targets_in(chunk, block)
                grad_logits[rows, columns] += scale[chunk][rows]
                grad_logits = tiles.in_compute_dtype(grad_logits)
                if want_hidden:
                    _matmul_into(grad_hidden[chunk], grad_logits, weight[block], accumulate=block_index > 0)
                if want_weight:
                    _matmul_into(grad_weight[block], grad_logits.T, hidden[chunk], accumulate=chunk_index > 0)
        grad_hidden = grad_hidden.to(hidden.dtype) if want_hidden else None
        grad_weight = grad_weight.to(weight.dtype) if want_weight else None
        return grad_hidden, grad_weight, None, None, None, None


class _Tiles:
    """The tiling of one `TiledLinearLogprobs` call: its slices, and one float32 tile buffer reused by
    every tile (plus a compute-dtype one when the matmuls run in half precision)."""

    def __init__(self, hidden, weight, targets, temperature: float, chunk_tokens: int, vocab_block: int):
        self.hidden, self.weight, self.targets, self.temperature = hidden, weight, targets, temperature
        self.chunk_tokens, self.vocab_block = chunk_tokens, vocab_block
        rows, columns = min(chunk_tokens, hidden.shape[0]), min(vocab_block, weight.shape[0])
        self.buffer = torch.empty(rows, columns, dtype=torch.float32, device=weight.device)
        half = weight.dtype != torch.float32
        self.compute = torch.empty(rows, columns, dtype=weight.dtype, device=weight.device) if half else None

    def token_chunks(self) -> Iterator[slice]:
        n = self.hidden.shape[0]
        return (slice(start, min(start + self.chunk_tokens, n)) for start in range(0, n, self.chunk_tokens))

    def vocab_blocks(self) -> Iterator[slice]:
        v = self.weight.shape[0]
        return (slice(start, min(start + self.vocab_block, v)) for start in range(0, v, self.vocab_block))

    def logits(self, chunk: slice, block: slice) -> torch.Tensor:
        """`(hidden[chunk] @ weight[block].T).float() / temperature`, in the float32 buffer."""
        shape = (chunk.stop - chunk.start, block.stop - block.start)
        out = self.buffer[: shape[0], : shape[1]]
        if self.compute is None:
            torch.mm(self.hidden[chunk], self.weight[block].T, out=out)
        else:
            out.copy_(torch.mm(self.hidden[chunk], self.weight[block].T, out=self.compute[: shape[0], : shape[1]]))
        if self.temperature != 1.0:
            out.div_(self.temperature)
        return out

    def targets_in(self, chunk: slice, block: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """`(rows of the chunk whose target is in the block, the target's column in the block)`."""
        targets = self.targets[chunk]
        rows = ((targets >= block.start) & (targets < block.stop)).nonzero().squeeze(1)
        return rows, targets[rows] - block.start

    def in_compute_dtype(self, values: torch.Tensor) -> torch.Tensor:
        if self.compute is None:
            return values
        return self.compute[: values.shape[0], : values.shape[1]].copy_(values)


def _matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """`out = a @ b` or `out += a @ b`; `out` is float32, `a` and `b` maybe half precision."""
    if a.dtype == out.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif accumulate:
        out.add_(a @ b)
    else:
        out.copy_(a @ b)


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: Optional[int] = None,
    vocab_block: Optional[int] = None,
) -> torch.Tensor:
    """`log_softmax(hidden @ weight.T / temperature)[i, targets[i]]` for each of the N rows, float32.

    Args:
        hidden: `[N, H]` final hidden states (any float dtype; N may be 0).
        weight: `[V, H]` output-embedding weight (tied or not: its gradient goes to whatever
            parameter it is).
        targets: `[N]` token ids.
        temperature: the logits are divided by it after the cast to float32 (default 1.0).
        chunk_tokens, vocab_block: the tile (default `tile_shape(N, V)`, about `TILE_BYTES` of logits).

    Under autocast the matmuls run in the autocast dtype, as `lm_head` would; otherwise in
    `hidden`'s and `weight`'s common dtype.
    """
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_logprobs: hidden [N, H] and weight [V, H], got {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_logprobs: targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
    dtype = matmul_dtype(dtype, hidden.device)  # float32 where bfloat16 GEMMs are scalar code
    default_chunk, default_block = tile_shape(hidden.shape[0], weight.shape[0])
    # The casts stay outside the Function so autograd takes their gradients back to each dtype.
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    with torch.autocast(device_type, enabled=False):
        return TiledLinearLogprobs.apply(
            hidden.contiguous(), weight.contiguous(), targets.long().contiguous(), float(temperature),
            int(chunk_tokens or default_chunk), int(vocab_block or default_block),
        )


# -------------------------------------------------------------------------------- which models
def fused_logprobs_problem(model: torch.nn.Module) -> Optional[str]:
    """None when the model's logits are exactly `lm_head(decoder(...).last_hidden_state)` with a
    plain bias-free `nn.Linear` head (the fused path computes the same thing); otherwise why not."""
    inner = hf_model(model)
    config = getattr(inner, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in PLAIN_HEAD_MODEL_TYPES:
        return f"model_type {model_type!r} is not one whose head is known to be plain ({sorted(PLAIN_HEAD_MODEL_TYPES)})"
    for key in LOGIT_TRANSFORM_KEYS:
        if getattr(config, key, None) not in (None, 1, 1.0):
            return f"config.{key}={getattr(config, key)!r} transforms the logits after the head"
    head = inner.get_output_embeddings()
    if type(head) is not torch.nn.Linear:  # e.g. a peft LoRA layer or ModulesToSaveWrapper on the head
        return f"the output head is a {type(head).__name__}, not a plain nn.Linear"
    if head.bias is not None:
        return "the output head is an nn.Linear with bias"
    if "logits_to_keep" not in inspect.signature(type(inner).forward).parameters:
        return f"{type(inner).__name__}.forward takes no logits_to_keep"
    return None


def use_fused_logprobs(model: torch.nn.Module, enabled: bool, announce: bool) -> bool:
    """Whether to take the fused path for `model` when `policy.fused_logprobs` is `enabled`; when
    the model does not allow it, says why (on stdout, if `announce`)."""
    problem = fused_logprobs_problem(model) if enabled else None
    if problem and announce:
        print(f"[posttrain] policy.fused_logprobs: using the full logits instead ({problem})", flush=True)
    return enabled and problem is None


@contextmanager
def final_hidden_states(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block, each forward of `model` appends its decoder's `last_hidden_state` (what
    the head would get) to the yielded list. Call the model with `logits_to_keep=1` so that
    transformers computes the logits of one position only."""
    captured: list[torch.Tensor] = []
    decoder = hf_model(model).get_decoder()
    handle = decoder.register_forward_hook(lambda module, args, output: captured.append(output.last_hidden_state))
    try:
        yield captured
    finally:
        handle.remove()


def attention_implementation(model: torch.nn.Module) -> Optional[str]:
    """transformers' attention kernel of `model` ("sdpa", "eager", "flash_attention_2", ...)."""
    return getattr(hf_model(model).config, "_attn_implementation", None)


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """The head's weight `[V, H]` as the forward just used it (FSDP: the unsharded parameter the
    root unit gathered; it stays gathered until backward, so its gradient is reduced as usual)."""
    weight = hf_model(model).get_output_embeddings().weight
    if isinstance(weight, DTensor):
        raise RuntimeError("linear_logprobs: the output head's weight is still sharded after the forward")
    return weight
