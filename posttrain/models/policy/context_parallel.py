"""Context parallelism (CP, `policy.context_parallel_size`, default 1): a long sequence is split by
sequence over the ranks of a CP group, so each rank holds the activations of `1/cp` of the tokens.

Layout. The workers form the mesh `("dp", "cp")` (`build_mesh`): rank r is data-parallel rank
`r // cp` and CP rank `r % cp`; the `cp` ranks of one group see the same rows (the controller
hands them the same shard, as it does a TP group). Every row of a micro-batch is right-padded to
a multiple of `2 * cp` tokens and cut into `2 * cp` chunks; CP rank i keeps chunks i and
`2 * cp - 1 - i` (load balancing, as Megatron-LM and torch do: under a causal mask the early
chunks attend to little and the late ones to much, so each rank gets one of each). Its tokens keep
their global positions (`position_ids`), so rotary embeddings are those of the whole sequence.

Attention is ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"): each rank keeps its queries; the key/value chunks travel round the ring
(`collective.ring_shift`, cp - 1 steps), and each step's block of attention is merged into the
running output with its log-sum-exp (the online softmax). The causal mask compares global
positions, so any chunking is right; a block entirely in a query chunk's future is skipped. The
backward pass sends the key/value chunks round again with their gradients accumulating beside
them, and one last step brings each gradient home; the forward saves only q, the local k/v, the
output and the log-sum-exp, so no rank ever holds the whole sequence's keys (the blocks are
computed with plain matmuls in float32; on GPUs a flash kernel per block is the next step).
Grouped-query attention sends the key/value heads only. It is registered as a transformers
attention function (`RING_ATTENTION`) and selected with `enable_ring_attention`; it builds no
mask: right-padded rows need none under a causal mask (no valid token sees the padding after it).

Everything else is local to a rank's tokens: embeddings, norms, MLP, the LM head and each token's
logprob (the logprob of token p+1 comes from the hidden state at p, which rank holds p; its label
is read from the full `input_ids` every rank has). The `[n, L]` logprobs are then all-gathered
over the CP group (`gather_sequence`, a few bytes per token; its backward keeps the rank's own
positions' gradient), so the loss runs unchanged on every CP rank and counts (global valid tokens,
metrics) reduce over `dp` only. Each CP rank's backward yields the gradient through its own
tokens; the sum over the CP group is the whole sequence's gradient.

Sharding. FSDP2 shards over the flattened `dp x cp` mesh (torchtitan does the same): CP ranks
hold the same weights, so sharding over them too divides parameter, gradient and optimizer memory
by `dp * cp` instead of `dp`, and the gradient reduce-scatter that FSDP does anyway sums the CP
ranks' partial gradients (it averages over `dp * cp` ranks, so the loss is multiplied by
`dp * cp`). Replicating over `cp` with a separate all-reduce would cost the same traffic and more
memory.

Not supported, refused in one line: by the config, CP with tensor parallelism, with sequence
packing (packed rows restart positions per sequence; the ring's mask would need the boundaries)
and with LoRA; by the worker, reward models and full logits (distillation, `get_topk_logits`); by
the attention function, attention dropout in training and sliding windows.
Tested on CPU over gloo only (tests/unit/test_context_parallel.py,
tests/functional/test_context_parallel_workers.py): torch 2.13's `context_parallel` refuses CPU
("aten._scaled_dot_product_flash_attention_for_cpu does not have a sharding strategy"), hence
this implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from posttrain.distributed import collective

RING_ATTENTION = "posttrain_ring"


# ----------------------------------------------------------------------------------- chunking
def padded_length(seq_len: int, cp_size: int) -> int:
    """`seq_len` rounded up to a multiple of `2 * cp_size` (the load-balanced chunks)."""
    multiple = 2 * cp_size
    return -(-seq_len // multiple) * multiple


def load_balanced_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions `[seq_len / cp]` that CP rank `cp_rank` holds: chunks `cp_rank` and
    `2 * cp_size - 1 - cp_rank` of `2 * cp_size` (`seq_len` must be a multiple of `2 * cp_size`)."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 * context_parallel_size = {2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


@dataclass
class ContextParallelGroup:
    """A CP group and the positions its ranks hold in the current micro-batch.

    Attributes:
        group: the process group of the CP ranks (None: a group of one, for tests of the maths).
        positions: `[cp, local_len]` long, row j = the global positions CP rank j holds.
    """

    group: Any
    positions: torch.Tensor

    @property
    def size(self) -> int:
        return self.positions.shape[0]

    @property
    def rank(self) -> int:
        return 0 if self.group is None else torch.distributed.get_rank(self.group)


def build_mesh(device_type: str, world_size: int, cp_size: int) -> tuple[Any, Any, Any]:
    """`(fsdp mesh, dp group, cp group)` of the workers as the mesh `("dp", "cp")`: FSDP2 shards
    over the flattened `dp x cp` mesh (module doc), counts reduce over `dp`, the ring runs in `cp`."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world_size // cp_size, cp_size), mesh_dim_names=("dp", "cp"))
    return mesh._flatten("dp_cp"), mesh["dp"].get_group(), mesh["cp"].get_group()


# ----------------------------------------------------------------------------- ring attention
def _block_attention(q, k, v, q_pos, k_pos, scaling):
    """Causal attention of queries at `q_pos` to keys at `k_pos` (float32, heads already matched):
    `(out [b, h, sq, d], lse [b, h, sq])`; rows with no visible key get out 0 and lse -inf."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return torch.matmul(probs, v), lse


def _repeat_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Key/value heads `[b, hkv, s, d]` repeated for grouped-query attention -> `[b, hkv * n_rep, s, d]`."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _sum_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The reverse of `_repeat_heads` for gradients: sum each key/value head's query group."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // n_rep, n_rep, s, d).sum(dim=2)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """Whether any query sees any key (else the block is entirely in the queries' future)."""
    return bool(q_pos.max() >= k_pos.min())


class RingAttention(torch.autograd.Function):
    """Exact causal attention of the local queries to the whole sequence's keys/values, which
    travel round the CP ring (module doc). Inputs `[b, heads, s_local, d]` (k/v with the key/value
    heads); output like q."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallelGroup, scaling: float, n_rep: int):
        dtype = q.dtype
        q32, kv = q.float(), torch.stack([k, v]).float()
        q_pos = cp.positions[cp.rank].to(q.device)
        out, lse = None, None
        for step in range(cp.size):
            source = (cp.rank - step) % cp.size
            incoming = collective.ring_shift(kv, cp.group) if step < cp.size - 1 else None
            k_pos = cp.positions[source].to(q.device)
            if step == 0 or _visible(q_pos, k_pos):
                block_out, block_lse = _block_attention(
                    q32, _repeat_heads(kv[0], n_rep), _repeat_heads(kv[1], n_rep), q_pos, k_pos, scaling)
                if out is None:  # step 0, the diagonal block: every query sees itself, so lse is finite
                    out, lse = block_out, block_lse
                else:
                    merged = torch.logaddexp(lse, block_lse)
                    out = (out * torch.exp(lse - merged)[..., None]
                           + block_out * torch.exp(block_lse - merged)[..., None])
                    lse = merged
            if incoming is not None:
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.scaling, ctx.n_rep = cp, scaling, n_rep
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        cp, scaling, n_rep = ctx.cp, ctx.scaling, ctx.n_rep
        q32, grad_out = q.float(), grad_out.float()
        q_pos = cp.positions[cp.rank].to(q.device)
        delta = (grad_out * out).sum(dim=-1, keepdim=True)  # [b, h, sq, 1]: rowsum(dO * O)
        grad_q = torch.zeros_like(q32)
        kv = torch.stack([k, v]).float()
        grad_kv = torch.zeros_like(kv)  # travels with kv, gathering every rank's queries' share
        for step in range(cp.size):
            source = (cp.rank - step) % cp.size
            k_pos = cp.positions[source].to(q.device)
            if _visible(q_pos, k_pos):
                keys, values = _repeat_heads(kv[0], n_rep), _repeat_heads(kv[1], n_rep)
                scores = torch.matmul(q32, keys.transpose(-1, -2)) * scaling
                scores = scores.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))
                probs = torch.exp(scores - lse[..., None])  # the final softmax restricted to this block
                grad_scores = probs * (torch.matmul(grad_out, values.transpose(-1, -2)) - delta)
                grad_q += torch.matmul(grad_scores, keys) * scaling
                grad_kv[0] += _sum_heads(torch.matmul(grad_scores.transpose(-1, -2), q32) * scaling, n_rep)
                grad_kv[1] += _sum_heads(torch.matmul(probs.transpose(-1, -2), grad_out), n_rep)
            if step < cp.size - 1:
                kv, grad_kv = collective.ring_shift(torch.stack([kv, grad_kv]), cp.group).unbind(0)
        # After cp - 1 shifts this rank holds the gradient of rank (rank + 1)'s k/v: one more step home.
        grad_kv = collective.ring_shift(grad_kv, cp.group) if cp.size > 1 else grad_kv
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None


def ring_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    context_parallel: Optional[ContextParallelGroup] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (`AttentionInterface`): `query [b, h, s, d]`,
    `key`/`value [b, hkv, s, d]` -> `([b, s, h, d], None)`. The CP group arrives as the model
    call's `context_parallel=` keyword (transformers passes extra keywords down to attention, also
    when activation checkpointing recomputes a layer)."""
    if context_parallel is None:
        raise RuntimeError(f"attention {RING_ATTENTION!r} needs the forward's context_parallel= argument "
                           "(posttrain.models.policy.context_parallel.microbatch_logprobs passes it)")
    if dropout and module.training:
        raise ValueError("policy.context_parallel_size > 1 does not support attention dropout")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("policy.context_parallel_size > 1 does not support sliding-window attention")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    n_rep = query.shape[1] // key.shape[1]
    out = RingAttention.apply(query, key, value, context_parallel, scaling, n_rep)
    return out.transpose(1, 2).contiguous(), None


def enable_ring_attention(model: torch.nn.Module) -> None:
    """Register `ring_attention_forward` with transformers and make it `model`'s attention.
    transformers then builds no attention mask for it (no mask function is registered)."""
    from transformers import AttentionInterface

    AttentionInterface.register(RING_ATTENTION, ring_attention_forward)
    model.set_attn_implementation(RING_ATTENTION)


# ------------------------------------------------------------------------- gathered logprobs
class _GatherSequence(torch.autograd.Function):
    """`[n, local_len]` per CP rank -> `[n, L]` in global position order on every rank; the
    backward returns this rank's positions of the gradient (each rank's loss is the same function
    of the gathered tensor, so no reduction is needed)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, cp: ContextParallelGroup):
        pieces = collective.all_gather_tensor(local, cp.group)
        full = local.new_zeros(local.shape[0], cp.positions.numel())
        full[:, cp.positions.reshape(-1).to(local.device)] = torch.cat(pieces, dim=1)
        ctx.own = cp.positions[cp.rank].to(local.device)
        return full

    @staticmethod
    def backward(ctx, grad_full):
        return grad_full[:, ctx.own], None


def gather_sequence(local: torch.Tensor, cp: ContextParallelGroup) -> torch.Tensor:
    """Every CP rank's `[n, local_len]` values placed at their global positions: `[n, L]`."""
    return _GatherSequence.apply(local, cp)


# --------------------------------------------------------------------------------- the forward
def microbatch_logprobs(
    model: torch.nn.Module,
    rows: Any,
    device: torch.device,
    group: Any,
    cp_size: int,
    temperature: float = 1.0,
    *,
    fused: bool = False,
    wanted: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Logprobs `[n, L]` of right-padded rows (`input_ids`, `input_lengths`) under CP, equal on
    every rank of the CP group (0 at position 0 and in the padding), differentiable through this
    rank's tokens. The caller sets autocast.

    Args:
        group: the CP process group (`cp_size` ranks; None only with `cp_size == 1`).
        fused: through the last hidden states and `linear_logprobs` (default False: the logits).
        wanted: `[n, L]` bool, the positions whose logprob is needed (default: every valid one but
            the first); with `fused` the others hold 0 and cost nothing.
    """
    from posttrain.models.policy.linear_logprobs import final_hidden_states, linear_logprobs, output_weight

    input_ids = rows["input_ids"].to(device)
    lengths = rows["input_lengths"].to(device)
    n_rows, seq_len = input_ids.shape
    width = padded_length(seq_len, cp_size)
    cp = ContextParallelGroup(group, torch.stack([load_balanced_positions(width, cp_size, r) for r in range(cp_size)]))
    positions = cp.positions[cp.rank].to(device)
    # Position p predicts token p + 1: labels are input_ids shifted left (one extra 0 at the end).
    ids = F.pad(input_ids, (0, width + 1 - seq_len))
    local_ids, labels = ids[:, positions], ids[:, positions + 1]
    valid = torch.arange(seq_len, device=device)[None, :] < lengths[:, None]
    if wanted is None:
        wanted = valid & (torch.arange(seq_len, device=device)[None, :] > 0)
    wanted_next = F.pad(wanted.to(device), (0, width + 1 - seq_len))[:, positions + 1]  # wanted[p + 1] at p
    position_ids = positions[None, :].expand(n_rows, -1)
    if fused:
        with final_hidden_states(model) as captured:
            model(input_ids=local_ids, position_ids=position_ids, use_cache=False, logits_to_keep=1,
                  context_parallel=cp)
        hidden = captured[-1]
        row, col = wanted_next.nonzero(as_tuple=True)
        values = linear_logprobs(hidden[row, col], output_weight(model), labels[row, col], temperature)
        local = values.new_zeros(n_rows, positions.numel()).index_put((row, col), values)
    else:
        logits = model(input_ids=local_ids, position_ids=position_ids, use_cache=False,
                       context_parallel=cp).logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        local = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        local = local * wanted_next
    full_next = gather_sequence(local, cp)  # [n, width]: position p holds the logprob of token p + 1
    return F.pad(full_next[:, : seq_len - 1], (1, 0)) * wanted
