"""Context parallelism's ring attention and CP forward (`models/policy/context_parallel.py`) against
one process's whole-sequence result, with two real gloo processes on CPU.

Tolerances (float32): the ring merges blocks through their log-sum-exp, so only the order of the
sums changes: attention outputs and logprobs agree to ~1e-6 (asserted 1e-5), gradients summed
over the CP ranks to ~1e-6 relative (asserted rtol 1e-4, atol 1e-6).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from posttrain.models.policy import attention_blocks as blocks
from posttrain.models.policy import context_parallel as cpmod
from test_collectives import free_ports

LENGTHS = [13, 5, 9]  # right padding; 13 is not a multiple of 2 * cp (padded to 16 inside)


def test_load_balanced_positions_cover_the_sequence_once():
    held = [cpmod.load_balanced_positions(16, 2, r).tolist() for r in (0, 1)]
    assert held == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    assert sorted(held[0] + held[1]) == list(range(16))
    assert cpmod.padded_length(13, 2) == 16 and cpmod.padded_length(16, 2) == 16
    with pytest.raises(ValueError, match="multiple of 2 \\* context_parallel_size = 4"):
        cpmod.load_balanced_positions(10, 2, 0)


def assert_one_rank_ring_is_sdpa(length: int, window=None) -> None:
    """cp=1 (no process group): the ring's blockwise maths equals SDPA with the causal mask (cut to
    `window` past positions when given), forward and backward, with GQA (4 query heads, 2 k/v)."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, length, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, length, 8, requires_grad=True) for _ in range(2))
    out = cpmod.RingAttention.apply(q, k, v, cpmod.ContextParallelGroup(None, 1, length), 8 ** -0.5, 2, window)
    index = torch.arange(length)
    mask = index[None, :] <= index[:, None]
    if window is not None:
        mask &= index[:, None] - index[None, :] < window
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_ring_attention_of_one_rank_is_causal_attention():
    assert_one_rank_ring_is_sdpa(6)


@pytest.mark.parametrize("cp_size,boundaries", [(2, None), (2, (0, 5, 6, 13, 16)), (3, (0, 1, 9, 10, 24)),
                                                  (2, (0, 16))])
def test_ring_blocks_cover_each_causal_pair_of_a_sequence_once(cp_size, boundaries):
    """Over every step of every rank, the blocks (`_ring_blocks`) meet each (query, key) pair of
    global positions with key <= query in the same sequence exactly once, and no other pair."""
    width = 16 if cp_size == 2 else 24
    positions = torch.stack([cpmod.load_balanced_positions(width, cp_size, r) for r in range(cp_size)])
    segment = torch.zeros(width, dtype=torch.long)
    for lo in (boundaries or (0,))[1:-1]:
        segment[lo:] += 1
    expected = (segment[:, None] == segment[None, :]) & torch.ones(width, width, dtype=torch.bool).tril()
    seen = torch.zeros(width, width, dtype=torch.long)
    for rank in range(cp_size):
        group = SimpleNamespace(rank=rank, size=cp_size, boundaries=boundaries)  # what _ring_blocks reads
        for source in range(cp_size):
            for rows, keys, causal in cpmod._ring_blocks(group, source, width // cp_size):
                q, k = positions[rank][rows], positions[source][keys]
                block = torch.ones(len(q), len(k), dtype=torch.long)
                seen[q[:, None], k[None, :]] += block.tril() if causal else block
    assert torch.equal(seen, expected.long())


@pytest.mark.parametrize("cp_size,boundaries,window", [(2, None, 3), (2, None, 5), (2, (0, 5, 6, 13, 16), 3),
                                                         (3, (0, 1, 9, 10, 24), 4), (3, None, 30)])
def test_window_blocks_cover_each_pair_in_the_window_once(monkeypatch, cp_size, boundaries, window):
    """`_window_blocks` (tiles of `window` queries here) meets each (query, key) pair of one sequence
    with query - window < key <= query exactly once (a dense block's pairs all, a causal one's
    those on and below its diagonal, a masked one's the visible ones), and no other pair."""
    monkeypatch.setattr(cpmod, "WINDOW_TILE_MIN", 1)
    width = 16 if cp_size == 2 else 24
    positions = torch.stack([cpmod.load_balanced_positions(width, cp_size, r) for r in range(cp_size)])
    segment = torch.zeros(width, dtype=torch.long)
    for lo in (boundaries or (0,))[1:-1]:
        segment[lo:] += 1
    index = torch.arange(width)
    distance = index[:, None] - index[None, :]
    expected = (segment[:, None] == segment[None, :]) & (distance >= 0) & (distance < window)
    seen, masked = torch.zeros(width, width, dtype=torch.long), 0
    for rank in range(cp_size):
        group = SimpleNamespace(rank=rank, size=cp_size, boundaries=boundaries, positions=positions)
        for source in range(cp_size):
            for rows, keys, causal, visible in cpmod._window_blocks(group, source, width // cp_size, window):
                q, k = positions[rank][rows], positions[source][keys]
                block = torch.ones(len(q), len(k), dtype=torch.long) if visible is None else visible.long()
                if causal:
                    assert visible is None and torch.equal(q, k)
                    block = block.tril()
                masked += visible is not None
                seen[q[:, None], k[None, :]] += block
    assert torch.equal(seen, expected.long())
    assert masked > 0 or window >= width  # a window longer than the rows: the blocks without one


@pytest.mark.parametrize("window", [2, 5, 40])
def test_ring_attention_with_a_sliding_window_is_windowed_causal_attention(monkeypatch, window):
    """cp=1: a sliding-window layer's ring attention (tiles of 4 queries: dense and masked blocks)
    equals SDPA with the window's mask, forward and backward, with GQA."""
    monkeypatch.setattr(cpmod, "WINDOW_TILE_MIN", 4)
    assert_one_rank_ring_is_sdpa(12, window)


def make_rows(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (len(LENGTHS), max(LENGTHS)), generator=g)
    lengths = torch.tensor(LENGTHS)
    ids[torch.arange(ids.shape[1])[None] >= lengths[:, None]] = 0
    return {"input_ids": ids, "input_lengths": lengths}


def one_process_run(model_name, rows, weights):
    """The model's logprobs of whole rows in one process, and the gradients of their weighted sum."""
    from posttrain.distributed.batch import Batch
    from posttrain.models.hf import load_causal_lm
    from posttrain.models.policy.forward import MicroBatch, microbatch_logprobs

    reference = load_causal_lm(model_name)
    logprobs = microbatch_logprobs(reference, MicroBatch(Batch(rows), torch.arange(len(LENGTHS))),
                                   torch.device("cpu"), torch.float32)
    (logprobs * weights).sum().backward()
    return logprobs.detach(), {name: p.grad for name, p in reference.named_parameters()}


def ring_run(model_name, rows, weights, group, ref_grads, check_each=False, **options):
    """This CP rank's logprobs through the ring, and the largest difference of the gradients summed
    over the CP ranks (what FSDP's reduce-scatter does) from `ref_grads`; with `check_each` each
    gradient is also checked to 1e-4 relative (the unpacked llama rows: Gemma 3's embedding
    gradients, sums over the window's masked float32 tiles, differ by up to 3e-6 absolute there)."""
    from posttrain.models.hf import load_causal_lm

    model = load_causal_lm(model_name)
    cpmod.enable_ring_attention(model)
    logprobs = cpmod.microbatch_logprobs(model, rows, torch.device("cpu"), group, 2, **options)
    (logprobs * weights).sum().backward()
    worst = 0.0
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        worst = max(worst, (grad - ref_grads[name]).abs().max().item())
        if check_each:
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{model_name} {name}: {m}")
    return logprobs.detach(), worst


def rank_main(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from posttrain.data import packing  # noqa: F401 - imported by forward
    from posttrain.distributed.batch import Batch
    from posttrain.models.hf import load_causal_lm
    from posttrain.models.policy.forward import MicroBatch, microbatch_logprobs

    group = dist.group.WORLD
    out = {}
    # Ring attention alone, GQA, 8 tokens in load-balanced chunks of 2, with each block kernel
    # (the fused CPU one is what the device picks; matmul is the fallback) and in bfloat16.
    cp = cpmod.ContextParallelGroup(group, 2, 8)
    mine = cp.positions[rank]
    for kernel, dtype in ((blocks.CPU_FLASH, torch.float32), (blocks.MATMUL, torch.float32),
                          (blocks.CPU_FLASH, torch.bfloat16)):
        torch.manual_seed(0)
        q, k, v = torch.randn(2, 4, 8, 8), torch.randn(2, 2, 8, 8), torch.randn(2, 2, 8, 8)
        q, k, v = (t.to(dtype).float() for t in (q, k, v))  # values a bf16 run holds exactly
        weights = torch.randn(2, 4, 8, 8)
        blocks._chosen[("cpu", dtype)] = kernel
        local = [t[:, :, mine].to(dtype).requires_grad_() for t in (q, k, v)]
        ring = cpmod.RingAttention.apply(*local, cp, 8 ** -0.5, 2)
        (ring.float() * weights[:, :, mine]).sum().backward()
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(full[0], full[1].repeat_interleave(2, 1),
                                             full[2].repeat_interleave(2, 1), is_causal=True)
        (ref * weights).sum().backward()
        tag = f"{kernel.name},{dtype}"
        out[f"attention[{tag}]"] = (ring.float() - ref[:, :, mine]).abs().max().item()
        out[f"attention_grads[{tag}]"] = max((t.grad.float() - f.grad[:, :, mine]).abs().max().item()
                                             for t, f in zip(local, full))
    blocks._chosen.clear()

    # The tiny model's logprobs and gradients, plain and fused, against one process's whole rows.
    rows = make_rows(100)
    weights = torch.randn(len(LENGTHS), max(LENGTHS), generator=torch.Generator().manual_seed(2))
    out["reference"], ref_grads = one_process_run("tiny", rows, weights)
    for fused in (False, True):
        out[f"logprobs_fused={fused}"], out[f"grads_fused={fused}"] = ring_run(
            "tiny", rows, weights, group, ref_grads, check_each=True, fused=fused)
    # The same rows packed into one row of three sequences (13 + 5 + 9 = 27 tokens, padded to 28):
    # attention must stay within each sequence and rotary positions restart with it.
    from posttrain.data.packing import pack_sequences

    packed = pack_sequences(rows["input_ids"], rows["input_lengths"], [[0, 1, 2]])[0]
    for fused in (False, True):
        out[f"packed_logprobs_fused={fused}"], out[f"packed_grads_fused={fused}"] = ring_run(
            "tiny", rows, weights, group, ref_grads, fused=fused, packed=packed)
    # Gemma 3 (a sliding-window layer of 8 positions, which the 13-token row runs past, and a
    # global one): the ring cut to the window, on rows and packed.
    out["gemma3_reference"], ref_grads = one_process_run("tiny-gemma3", rows, weights)
    for kind, packing in (("rows", None), ("packed", packed)):
        out[f"gemma3_{kind}_logprobs"], out[f"gemma3_{kind}_grads"] = ring_run(
            "tiny-gemma3", rows, weights, group, ref_grads, packed=packing)
    dist.destroy_process_group()
    results[rank] = out


@pytest.mark.timeout(600)
def test_cp2_equals_one_process_on_the_tiny_model():
    """Two CP ranks (gloo): ring attention equals SDPA on the whole sequence (forward and the
    gradients of q and each rank's k/v); the tiny model's logprobs (plain and fused head) equal
    one process's on right-padded rows, on both ranks, and the gradients summed over the ranks
    equal the whole-sequence gradients; so do those of the same rows packed into one row, and
    tiny Gemma 3's (its sliding-window layer through the windowed ring)."""
    results = mp.Manager().dict()
    mp.spawn(rank_main, args=(free_ports(1)[0], results), nprocs=2, join=True)
    for rank in (0, 1):
        out = results[rank]
        print(rank, {k: v for k, v in out.items() if isinstance(v, float)})
        for kernel in ("cpu_flash", "matmul"):
            assert out[f"attention[{kernel},torch.float32]"] < 1e-5
            assert out[f"attention_grads[{kernel},torch.float32]"] < 1e-5
        # bfloat16 blocks (inputs exact in bf16; the output and gradients rounded to bf16's 8 bits):
        assert out["attention[cpu_flash,torch.bfloat16]"] < 3e-2
        assert out["attention_grads[cpu_flash,torch.bfloat16]"] < 1e-1
        for fused in (False, True):
            for kind in ("", "packed_"):
                torch.testing.assert_close(out[f"{kind}logprobs_fused={fused}"], out["reference"], rtol=1e-5, atol=1e-5)
                assert out[f"{kind}grads_fused={fused}"] < 1e-5
        for kind in ("rows", "packed"):
            torch.testing.assert_close(out[f"gemma3_{kind}_logprobs"], out["gemma3_reference"], rtol=1e-5, atol=1e-5)
            assert out[f"gemma3_{kind}_grads"] < 1e-5


def test_config_refuses_what_context_parallelism_cannot_do_in_one_line():
    from posttrain.config import ConfigError, load_config
    from posttrain.config.schema import PolicyConfig

    with pytest.raises(ConfigError, match=r"policy.num_workers=3 must be a multiple of policy.context_parallel_size=2"):
        load_config("grpo", overrides=["policy.num_workers=3", "policy.context_parallel_size=2"])
    cases = {
        "with policy.lora.enabled is not supported": dict(num_workers=2, lora=dict(enabled=True)),
    }
    for message, options in cases.items():
        with pytest.raises(ValueError, match=f"policy.context_parallel_size > 1 {message}"):
            PolicyConfig(context_parallel_size=2, **options)
    assert PolicyConfig(num_workers=2, context_parallel_size=2, sequence_packing=dict(enabled=True)).sequence_packing.enabled
    cfg = PolicyConfig(num_workers=4, context_parallel_size=2, train_global_batch_size=2)
    assert cfg.dp_size == 2  # the CP ranks of a group share rows, like a TP group's
    with pytest.raises(ValueError, match=r"train_global_batch_size=3 must be a multiple of the 2 data-parallel ranks"):
        PolicyConfig(num_workers=4, context_parallel_size=2, train_global_batch_size=3)
    # With tensor parallelism: the mesh dp x cp x tp.
    with pytest.raises(ValueError, match=r"policy.num_workers=6 must be a multiple of policy.context_parallel_size \* "
                                         r"policy.tensor_parallel_size = 2 \* 2"):
        PolicyConfig(num_workers=6, context_parallel_size=2, tensor_parallel_size=2)
    assert PolicyConfig(num_workers=8, context_parallel_size=2, tensor_parallel_size=2, train_global_batch_size=2,
                        sequence_parallel=True).dp_size == 2
    with pytest.raises(ValueError, match=r"train_global_batch_size=3 must be a multiple of the 2 data-parallel ranks "
                                         r"\(policy.num_workers / \(policy.context_parallel_size \* policy.tensor_parallel_size\)\)"):
        PolicyConfig(num_workers=8, context_parallel_size=2, tensor_parallel_size=2, train_global_batch_size=3)
