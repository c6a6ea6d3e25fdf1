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
running output with its log-sum-exp (the online softmax). With the load-balanced chunks every
step is one dense block, causal or fully visible (`_ring_block`), so no mask is built and no work
is spent on a query chunk's future. Each block runs in the device's fused attention kernel
(`attention_blocks.py`: torch's flash kernels on CPU and, for bf16/fp16, on CUDA), which never
holds a block's `[sq, sk]` scores; float32 matmuls are the checked fallback. The backward pass
sends the key/value chunks round again with their gradients accumulating beside them, and one
last step brings each gradient home; the forward saves only q, the local k/v, the output and the
log-sum-exp, so no rank ever holds the whole sequence's keys. Grouped-query attention sends the
key/value heads only. It is registered as a transformers
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

With tensor parallelism the workers form the mesh `("dp", "cp", "tp")`: each CP rank's tokens
go through a TP group as they would without CP (the attention function gets that TP rank's heads,
and the ring runs per head shard among the CP ranks with the same TP rank); with
`policy.sequence_parallel` each TP rank also keeps `1/tp` of its CP rank's tokens between blocks.

Sequence packing: the CP ranks split the packed row (one `[1, T]` row of several sequences)
like any row; its rotary positions restart with each sequence and the ring cuts each step's
block by sequence (`_ring_blocks`), so no query meets another sequence's keys and no mask is built.

Sliding-window layers (Gemma 3's local layers; transformers passes the layer's `sliding_window`):
a query at position p sees keys p - window < k <= p, so the ring's blocks are cut to the window
(`_window_blocks`): tiles of at least `window` queries meet only the keys of their windows, a tile
inside the window stays a dense block of the fused kernel, one at its edge is a masked float32
block (`attention_blocks.masked_forward`), and a key chunk wholly out of a tile's window is
skipped, so far chunks cost no attention (they still travel round the ring).

Not supported, refused in one line: by the config, CP with LoRA; by the worker, reward models and full logits (distillation, `get_topk_logits`); by
the attention function, attention dropout in training and attention logit soft-capping.
Tested on CPU over gloo only (tests/unit/test_context_parallel.py,
tests/functional/test_context_parallel_workers.py): torch 2.13's `context_parallel` refuses CPU
("aten._scaled_dot_product_flash_attention_for_cpu does not have a sharding strategy"), hence
this implementation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from posttrain.distributed import collective
from posttrain.models.policy.attention_blocks import block_kernel, masked_backward, masked_forward

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
    """A CP group and the tokens its ranks hold in the current micro-batch: the load-balanced
    chunks of rows `width` tokens long (`load_balanced_positions`; ring attention's blocks rely on
    that layout).

    Attributes:
        group: the process group of the CP ranks (None: a group of one, for tests of the maths).
        size: the number of CP ranks.
        width: the (padded) row length, a multiple of `2 * size`.
        boundaries: for a packed row, where each of its sequences starts, then its end
            (`(0, s1, ..., width)`: attention stays within a sequence); None (default): each row
            is one sequence.
    """

    group: Any
    size: int
    width: int
    boundaries: Optional[tuple[int, ...]] = None

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """`[size, width / size]` long, row j = the global positions CP rank j holds."""
        return torch.stack([load_balanced_positions(self.width, self.size, r) for r in range(self.size)])

    @property
    def rank(self) -> int:
        return 0 if self.group is None else torch.distributed.get_rank(self.group)


def build_mesh(device_type: str, world_size: int, cp_size: int, tp_size: int = 1) -> tuple[Any, Any, Any, Any]:
    """`(fsdp mesh, dp group, cp group, tp mesh or None)` of the workers as the mesh
    `("dp", "cp")`, or `("dp", "cp", "tp")` with tensor parallelism (rank r: TP rank r % tp, CP rank
    (r // tp) % cp, as the controller hands one shard to each group of cp * tp consecutive ranks).
    FSDP2 shards over the flattened `dp x cp` mesh (module doc), counts reduce over `dp`, the ring
    runs in `cp`, and each TP group splits the layers as without CP (its attention sees its heads)."""
    from torch.distributed.device_mesh import init_device_mesh

    if tp_size == 1:
        mesh = init_device_mesh(device_type, (world_size // cp_size, cp_size), mesh_dim_names=("dp", "cp"))
        return mesh._flatten("dp_cp"), mesh["dp"].get_group(), mesh["cp"].get_group(), None
    mesh = init_device_mesh(device_type, (world_size // (cp_size * tp_size), cp_size, tp_size),
                            mesh_dim_names=("dp", "cp", "tp"))
    return mesh["dp", "cp"]._flatten("dp_cp"), mesh["dp"].get_group(), mesh["cp"].get_group(), mesh["tp"]


# ----------------------------------------------------------------------------- ring attention
def _repeat_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Key/value heads `[b, hkv, s, d]` repeated for grouped-query attention -> `[b, hkv * n_rep, s, d]`."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _sum_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The reverse of `_repeat_heads` for gradients: sum each key/value head's query group."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // n_rep, n_rep, s, d).sum(dim=2)


def _ring_block(rank: int, source: int, local_len: int) -> tuple[slice, slice, bool]:
    """Which of this rank's queries meet which of `source`'s keys, and whether causally:
    `(query rows, key rows, causal)` in local order. With the load-balanced chunks (rank r holds
    chunks r and 2cp-1-r, in order) a step is one of three dense blocks and never needs a mask:
    its own keys, causally; an earlier rank's (source < rank): every query sees that rank's first
    chunk and none its second; a later rank's: only the second query chunk sees them, all of them."""
    whole, first, second = slice(0, local_len), slice(0, local_len // 2), slice(local_len // 2, local_len)
    if source == rank:
        return whole, whole, True
    return (whole, first, False) if source < rank else (second, whole, False)


def _ring_blocks(cp: ContextParallelGroup, source: int, local_len: int) -> list[tuple[slice, slice, bool]]:
    """`_ring_block` for rows of one sequence; for a packed row (`cp.boundaries`), the same cut
    by sequence: each pair of a query chunk and a key chunk that is not in its future gives, for
    every sequence present in both, one dense block of that sequence's queries and keys, causal
    when the two chunks are the same one. Queries never meet another sequence's keys."""
    if cp.boundaries is None:
        return [_ring_block(cp.rank, source, local_len)]
    chunk, last = local_len // 2, 2 * cp.size - 1
    blocks = []
    for q_index, q_start in enumerate((cp.rank * chunk, (last - cp.rank) * chunk)):
        for k_index, k_start in enumerate((source * chunk, (last - source) * chunk)):
            if k_start > q_start:  # the whole key chunk is in the query chunk's future
                continue
            for lo, hi in zip(cp.boundaries[:-1], cp.boundaries[1:]):
                q_lo, q_hi = max(lo, q_start), min(hi, q_start + chunk)
                k_lo, k_hi = max(lo, k_start), min(hi, k_start + chunk)
                if q_lo < q_hi and k_lo < k_hi:
                    blocks.append((slice(q_index * chunk + q_lo - q_start, q_index * chunk + q_hi - q_start),
                                   slice(k_index * chunk + k_lo - k_start, k_index * chunk + k_hi - k_start),
                                   k_start == q_start))
    return blocks


# Query rows per tile at a sliding window's edge (at least the window): each tile is one masked
# `[tile, <= tile + window]` block, so no block's scores grow with the sequence.
WINDOW_TILE_MIN = 128


def _window_blocks(cp: ContextParallelGroup, source: int, local_len: int,
                   window: Optional[int]) -> list[tuple[slice, slice, bool, Optional[torch.Tensor]]]:
    """`_ring_blocks` as `(query rows, key rows, causal, visible)`, for a sliding-window layer
    (`window`: a query at position p sees keys at p - window < k <= p, transformers' rule) cut to
    the window. A block wholly inside the window is kept as it is (short rows: the blocks without a
    window). Otherwise its queries go in tiles (within one load-balanced chunk, so a tile's
    positions are contiguous) against the keys of their windows only (a contiguous run of local
    key rows, since positions ascend): a tile whose every pair is visible is a dense block of the
    fused kernel (`visible` None), a causal block's diagonal tile of at most `window` queries its
    causal block in the fused kernel, the rest at the window's edge a block with its `[rows, keys]`
    mask; a tile that sees none of the source's keys is dropped. `window` None: the blocks unchanged."""
    blocks = _ring_blocks(cp, source, local_len)
    if window is None:
        return [(rows, keys, causal, None) for rows, keys, causal in blocks]
    q_all, k_all = cp.positions[cp.rank], cp.positions[source]
    tile, half = max(window, WINDOW_TILE_MIN), local_len // 2
    out = []
    for rows, keys, causal in blocks:
        k_pos = k_all[keys]
        if int(q_all[rows].max()) - int(k_pos.min()) < window:
            out.append((rows, keys, causal, None))
            continue
        for lo_row, hi_row in ((rows.start, min(rows.stop, half)), (max(rows.start, half), rows.stop)):
            for start in range(lo_row, hi_row, tile):
                tile_rows = slice(start, min(start + tile, hi_row))
                q_pos = q_all[tile_rows]
                first = int(torch.searchsorted(k_pos, q_pos[0] - window + 1))
                last = int(torch.searchsorted(k_pos, q_pos[-1], right=True))
                if causal and len(q_pos) <= window:
                    # A causal block's queries and keys are the same positions: the tile's own keys
                    # are its causal diagonal block, all inside the window; the earlier ones a band.
                    own = int(torch.searchsorted(k_pos, q_pos[0]))
                    out.append((tile_rows, slice(keys.start + own, keys.start + last), True, None))
                    last = own
                if first >= last:
                    continue
                distance = q_pos[:, None] - k_pos[first:last][None, :]
                visible = (distance >= 0) & (distance < window)
                tile_keys = slice(keys.start + first, keys.start + last)
                out.append((tile_rows, tile_keys, False, None if bool(visible.all()) else visible))
    return out


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Online softmax: merge a block into the rows' running output through the log-sum-exps (a
    row that has seen no key yet, or none in this block, has lse -inf: its weight is 0, not NaN)."""
    merged = torch.logaddexp(lse[:, :, rows], block_lse)
    out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - merged).nan_to_num(0.0)[..., None]
                       + block_out.float() * torch.exp(block_lse - merged).nan_to_num(0.0)[..., None])
    lse[:, :, rows] = merged


class RingAttention(torch.autograd.Function):
    """Exact causal attention of the local queries to the whole sequence's keys/values, which
    travel round the CP ring (module doc). Inputs `[b, heads, s_local, d]` (k/v with the key/value
    heads) holding the load-balanced chunks; output like q. Each step's block is computed by the
    fused attention kernel of the device where it has one (`attention_blocks.block_kernel`)."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallelGroup, scaling: float, n_rep: int, window: Optional[int] = None):
        kernel = block_kernel(q.device, q.dtype)
        kv, local_len = torch.stack([k, v]), q.shape[-2]
        out = q.new_zeros(q.shape, dtype=torch.float32)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
        for step in range(cp.size):
            incoming = collective.ring_shift(kv, cp.group) if step < cp.size - 1 else None
            for rows, keys, causal, visible in _window_blocks(cp, (cp.rank - step) % cp.size, local_len, window):
                block_k, block_v = _repeat_heads(kv[0, :, :, keys], n_rep), _repeat_heads(kv[1, :, :, keys], n_rep)
                if visible is None:
                    block_out, block_lse = kernel.forward(q[:, :, rows], block_k, block_v, causal, scaling)
                else:
                    block_out, block_lse = masked_forward(q[:, :, rows], block_k, block_v, visible, scaling)
                _merge(out, lse, rows, block_out, block_lse)
            if incoming is not None:
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.scaling, ctx.n_rep, ctx.kernel, ctx.window = cp, scaling, n_rep, kernel, window
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        cp, scaling, n_rep, kernel = ctx.cp, ctx.scaling, ctx.n_rep, ctx.kernel
        local_len = q.shape[-2]
        grad_q = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v])
        grad_kv = torch.zeros_like(kv, dtype=torch.float32)  # travels with kv, gathering every rank's queries' share
        for step in range(cp.size):
            for rows, keys, causal, visible in _window_blocks(cp, (cp.rank - step) % cp.size, local_len, ctx.window):
                # The final out and lse make the block's softmax the whole row's, restricted to the block.
                block_k, block_v = _repeat_heads(kv[0, :, :, keys], n_rep), _repeat_heads(kv[1, :, :, keys], n_rep)
                if visible is None:
                    dq, dk, dv = kernel.backward(grad_out[:, :, rows], q[:, :, rows], block_k, block_v,
                                                 out[:, :, rows], lse[:, :, rows], causal, scaling)
                else:
                    dq, dk, dv = masked_backward(grad_out[:, :, rows], q[:, :, rows], block_k, block_v,
                                                 out[:, :, rows], lse[:, :, rows], visible, scaling)
                grad_q[:, :, rows] += dq
                grad_kv[0, :, :, keys] += _sum_heads(dk, n_rep)
                grad_kv[1, :, :, keys] += _sum_heads(dv, n_rep)
            if step < cp.size - 1:
                kv, grad_kv = collective.ring_shift(kv, cp.group), collective.ring_shift(grad_kv, cp.group)
        # After cp - 1 shifts this rank holds the gradient of rank (rank + 1)'s k/v: one more step home.
        grad_kv = collective.ring_shift(grad_kv, cp.group) if cp.size > 1 else grad_kv
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None, None


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
    if kwargs.get("softcap") is not None:
        raise ValueError("policy.context_parallel_size > 1 does not support attention logit soft-capping")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    n_rep = query.shape[1] // key.shape[1]
    window = kwargs.get("sliding_window")  # a sliding-window layer's (Gemma 3's local layers), else None
    out = RingAttention.apply(query, key, value, context_parallel, scaling, n_rep, window)
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
    sequence_parallel_size: int = 1,
    packed: Optional[dict[str, Any]] = None,
) -> torch.Tensor:
    """Logprobs `[n, L]` of right-padded rows (`input_ids`, `input_lengths`) under CP, equal on
    every rank of the CP group (0 at position 0 and in the padding), differentiable through this
    rank's tokens. The caller sets autocast.

    Args:
        group: the CP process group (`cp_size` ranks; None only with `cp_size == 1`).
        fused: through the last hidden states and `linear_logprobs` (default False: the logits).
        wanted: `[n, L]` bool, the positions whose logprob is needed (default: every valid one but
            the first); with `fused` the others hold 0 and cost nothing.
        sequence_parallel_size: the TP size under `policy.sequence_parallel` (default 1): each rank's
            tokens must split evenly over its TP group, so rows pad to a multiple of `2 * cp * tp`.
        packed: the rows packed into one `[1, T]` row (`packing.pack_sequences`: `input_ids`,
            `position_ids`, `cu_seqlens`), which is then what the CP ranks split; attention stays
            within each sequence and rotary positions restart with it (default None: the rows as they are).
    """
    input_ids = rows["input_ids"].to(device)
    lengths = rows["input_lengths"].to(device)
    n_rows, seq_len = input_ids.shape
    if wanted is None:
        positions = torch.arange(seq_len, device=device)[None, :]
        wanted = (positions < lengths[:, None]) & (positions > 0)
    wanted = wanted.to(device)
    options = dict(temperature=temperature, fused=fused, sequence_parallel_size=sequence_parallel_size)
    if packed is None:
        return _ring_logprobs(model, input_ids, wanted, device, group, cp_size, **options)
    # Row r's position i is the packed row's position cu_seqlens[r] + i.
    starts = packed["cu_seqlens"].to(device).long()
    row, col = wanted.nonzero(as_tuple=True)
    packed_index = starts[row] + col
    packed_ids = packed["input_ids"].to(device)
    packed_wanted = torch.zeros_like(packed_ids, dtype=torch.bool)
    packed_wanted[0, packed_index] = True
    values = _ring_logprobs(model, packed_ids, packed_wanted, device, group, cp_size,
                            rotary_positions=packed["position_ids"].to(device), boundaries=starts.tolist(), **options)
    return values.new_zeros(n_rows, seq_len).index_put((row, col), values[0, packed_index])


def _ring_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    wanted: torch.Tensor,
    device: torch.device,
    group: Any,
    cp_size: int,
    *,
    temperature: float,
    fused: bool,
    sequence_parallel_size: int,
    rotary_positions: Optional[torch.Tensor] = None,
    boundaries: Optional[list[int]] = None,
) -> torch.Tensor:
    """`[n, S]` logprob of each token of `input_ids` where `wanted` (0 elsewhere), every row split
    over the CP ranks. `rotary_positions` (default: the global positions) and `boundaries` (the
    sequences of a packed row, default: one per row) describe packed rows."""
    from posttrain.models.policy.linear_logprobs import final_hidden_states, linear_logprobs, output_weight

    n_rows, seq_len = input_ids.shape
    width = padded_length(seq_len, cp_size * sequence_parallel_size)
    if boundaries is not None and width > boundaries[-1]:
        boundaries = [*boundaries, width]  # the padding is a sequence of its own
    cp = ContextParallelGroup(group, cp_size, width, None if boundaries is None else tuple(boundaries))
    positions = cp.positions[cp.rank].to(device)
    # Position p predicts token p + 1: labels are input_ids shifted left (one extra 0 at the end).
    ids = F.pad(input_ids, (0, width + 1 - seq_len))
    local_ids, labels = ids[:, positions], ids[:, positions + 1]
    wanted_next = F.pad(wanted, (0, width + 1 - seq_len))[:, positions + 1]  # wanted[p + 1] at p
    if rotary_positions is None:
        position_ids = positions[None, :].expand(n_rows, -1)
    else:
        position_ids = F.pad(rotary_positions, (0, width - seq_len))[:, positions]
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
