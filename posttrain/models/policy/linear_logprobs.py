"""Next-token logprobs straight from the decoder's hidden states, without the `[N, V]` logits.

`linear_logprobs(hidden [N, H], weight [V, H], targets [N])` is
`log_softmax(hidden @ weight.T / temperature)[i, targets[i]]`, computed chunk by chunk over the
tokens: a chunk's `[n, V]` logits live in one reused buffer (tens of MB, see `CHUNK_BYTES`), are
reduced to `logit[target] - logsumexp` and dropped. Backward recomputes each chunk's logits and
turns them in place into `(onehot - softmax) * grad / temperature`, then feeds the two matmuls
for `grad_hidden` and `grad_weight`. The full-vocabulary log-softmax over the whole micro-batch,
its backward and the fills and copies around it (memory-bound passes over `N x V` floats) are gone;
the price is one more `N x H x V` matmul (the recompute).

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

# One chunk's float32 logits: [n, V] * 4 bytes, in a buffer reused by every chunk. Measured on
# SmolLM2-135M's head (H 576, V 49152, 2400 tokens, forward + backward): 32 to 128 MiB chunks
# (n = 170 to 682) take the same time, 16 MiB is 15-20% slower and 2 MiB 4x slower, because the
# weight gradient is accumulated by one matmul per chunk whose inner size is n: the [V, H] float32
# accumulator is read and written per chunk, ~n / 4 FLOPs per byte. Hence also a floor on n for
# large vocabularies. (`benchmarks/train_step_135m.py --kernel` reruns the sweep.)
CHUNK_BYTES = 64 * 2**20
MIN_CHUNK_TOKENS = 128

# Model types whose `XForCausalLM.forward` (transformers 5.23) is exactly
# `logits = self.lm_head(slice_logits_to_keep(decoder(...).last_hidden_state, logits_to_keep))`:
# no scaling, soft-capping or bias after the head. Others (Gemma2/3 final_logit_softcapping,
# Cohere logit_scale, Granite logits_scaling, ...) keep the plain logits path.
PLAIN_HEAD_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "olmo2", "phi3", "gemma"}
)
# Config attributes that change logits after the head; any of them set disables the fused path.
LOGIT_TRANSFORM_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def chunk_tokens_for(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: a chunk's float32 logits take about `chunk_bytes` (default `CHUNK_BYTES`),
    and at least `MIN_CHUNK_TOKENS` tokens."""
    return max(MIN_CHUNK_TOKENS, chunk_bytes // (4 * vocab_size))


class ChunkedLinearLogprobs(torch.autograd.Function):
    """`(hidden [N, H], weight [V, H], targets [N], temperature, chunk_tokens) -> logprobs [N]` (float32).

    `hidden` and `weight` share a dtype (the compute dtype: the caller casts under autocast); the
    logits are taken to float32 before the division by `temperature`, as in `next_token_logprobs`.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_tokens: int):
        n_tokens = hidden.shape[0]
        logprobs = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
        logsumexp = torch.empty_like(logprobs)
        buffers = _LogitBuffers(min(chunk_tokens, n_tokens), weight)
        for start in range(0, n_tokens, chunk_tokens):
            end = min(start + chunk_tokens, n_tokens)
            logits = buffers.logits(hidden[start:end], weight, temperature)
            target_logits = logits.gather(1, targets[start:end, None]).squeeze(1)
            # logsumexp in place: the chunk is not needed afterwards (backward recomputes it).
            peak = logits.amax(dim=1)
            logits.sub_(peak[:, None]).exp_()
            torch.add(logits.sum(dim=1).log_(), peak, out=logsumexp[start:end])
            torch.sub(target_logits, logsumexp[start:end], out=logprobs[start:end])
        ctx.save_for_backward(hidden, weight, targets, logsumexp)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return logprobs

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs):
        hidden, weight, targets, logsumexp = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n_tokens, chunk_tokens = hidden.shape[0], ctx.chunk_tokens
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # float32 accumulator over chunks; for a half-precision weight it is rounded once at the end.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        # d logprob_i / d logit_iv = (onehot_iv - softmax_iv) / temperature
        scale = grad_logprobs.float() / ctx.temperature
        buffers = _LogitBuffers(min(chunk_tokens, n_tokens), weight)
        for start in range(0, n_tokens, chunk_tokens):
            end = min(start + chunk_tokens, n_tokens)
            chunk = slice(start, end)
            grad_logits = buffers.logits(hidden[chunk], weight, ctx.temperature)
            grad_logits.sub_(logsumexp[chunk, None]).exp_().mul_(-scale[chunk, None])
            grad_logits.scatter_add_(1, targets[chunk, None], scale[chunk, None])
            grad_logits = buffers.in_compute_dtype(grad_logits)
            if want_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[chunk])
            if want_weight:
                if grad_logits.dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.T, hidden[chunk])
                else:
                    grad_weight += grad_logits.T @ hidden[chunk]
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


class _LogitBuffers:
    """One float32 `[n, V]` buffer reused by every chunk (fresh large tensors cost page faults on
    CPU), plus a compute-dtype one when the matmuls run in half precision."""

    def __init__(self, rows: int, weight: torch.Tensor):
        vocab, dtype = weight.shape[0], weight.dtype
        self.fp32 = torch.empty(rows, vocab, dtype=torch.float32, device=weight.device)
        self.compute = None if dtype == torch.float32 else torch.empty(rows, vocab, dtype=dtype, device=weight.device)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
        """`(hidden @ weight.T).float() / temperature` of one chunk, in the float32 buffer."""
        rows = hidden.shape[0]
        out = self.fp32[:rows]
        if self.compute is None:
            torch.mm(hidden, weight.T, out=out)
        else:
            out.copy_(torch.mm(hidden, weight.T, out=self.compute[:rows]))
        if temperature != 1.0:
            out.div_(temperature)
        return out

    def in_compute_dtype(self, values: torch.Tensor) -> torch.Tensor:
        if self.compute is None:
            return values
        return self.compute[: values.shape[0]].copy_(values)


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: Optional[int] = None,
) -> torch.Tensor:
    """`log_softmax(hidden @ weight.T / temperature)[i, targets[i]]` for each of the N rows, float32.

    Args:
        hidden: `[N, H]` final hidden states (any float dtype; N may be 0).
        weight: `[V, H]` output-embedding weight (tied or not: its gradient goes to whatever
            parameter it is).
        targets: `[N]` token ids.
        temperature: the logits are divided by it after the cast to float32 (default 1.0).
        chunk_tokens: tokens per chunk (default `chunk_tokens_for(V)`, about `CHUNK_BYTES` of logits).

    Under autocast the matmuls run in the autocast dtype, as `lm_head` would; otherwise in
    `hidden`'s and `weight`'s common dtype.
    """
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_logprobs: hidden [N, H] and weight [V, H], got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_logprobs: targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
    chunk_tokens = chunk_tokens or chunk_tokens_for(weight.shape[0])
    # The casts stay outside the Function so autograd takes their gradients back to each dtype.
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    with torch.autocast(device_type, enabled=False):
        return ChunkedLinearLogprobs.apply(
            hidden.contiguous(), weight.contiguous(), targets.long().contiguous(), float(temperature), int(chunk_tokens)
        )


# -------------------------------------------------------------------------------- which models
def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (the model itself otherwise)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def fused_logprobs_problem(model: torch.nn.Module) -> Optional[str]:
    """None when the model's logits are exactly `lm_head(decoder(...).last_hidden_state)` with a
    plain bias-free `nn.Linear` head (the fused path computes the same thing); otherwise why not."""
    inner = _unwrapped(model)
    config = getattr(inner, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in PLAIN_HEAD_MODEL_TYPES:
        return f"model_type {model_type!r} is not one whose head is known to be plain ({sorted(PLAIN_HEAD_MODEL_TYPES)})"
    for key in LOGIT_TRANSFORM_KEYS:
        if getattr(config, key, None) not in (None, 1, 1.0):
            return f"config.{key}={getattr(config, key)!r} transforms the logits after the head"
    head = inner.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:  # peft-wrapped or biased heads
        return f"the output head is a {type(head).__name__}{' with bias' if getattr(head, 'bias', None) is not None else ''}, not a plain nn.Linear"
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
    decoder = _unwrapped(model).get_decoder()
    handle = decoder.register_forward_hook(lambda module, args, output: captured.append(output.last_hidden_state))
    try:
        yield captured
    finally:
        handle.remove()


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """The head's weight `[V, H]` as the forward just used it (FSDP: the unsharded parameter the
    root unit gathered; it stays gathered until backward, so its gradient is reduced as usual)."""
    weight = _unwrapped(model).get_output_embeddings().weight
    if isinstance(weight, DTensor):
        raise RuntimeError("linear_logprobs: the output head's weight is still sharded after the forward")
    return weight
