"""Tensor parallelism (`policy.tensor_parallel_size`) on CPU over gloo, with real Ray workers:
a TP group gives the values, gradients and updated weights of one worker; dp x tp those of dp.
The one-worker references run in the test process (`run_one_worker`, the local backend).

Tolerances: float32 throughout; TP changes only the order of the sums inside the row-wise
projections (an all-reduce of two partial sums), so logprobs, losses and gradient norms agree to
about 1e-6 relative; the tests allow 1e-5, and 1e-6 absolute on weights after two clipped SGD
steps. (SGD, not Adam, for the comparisons: Adam divides by sqrt(v), so where a gradient is near
its eps the 1e-6 noise becomes up to 1% of a step: 1e-5 measured after two steps at lr 1e-3. The
resume test uses AdamW, bit for bit.)
"""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithms.loss import ClippedPGLoss
from posttrain.config.schema import LossConfig, PolicyConfig
from posttrain.distributed.actors import LocalCluster
from posttrain.distributed.batch import Batch
from posttrain.distributed.cluster import VirtualCluster
from posttrain.models.generation.native import NativeGeneration
from posttrain.models.generation.spec import GenerationSpec
from posttrain.models.policy.policy import Policy
from posttrain.models.refit import build_refit_metadata, refit_policy_generation

# The timeout is a hang guard, not a speed test: beside two CPU hogs this module ran 4-6x its quiet time.
pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]

LENGTHS = [14, 5, 9, 7, 16, 3, 11, 12]
RTOL = 1e-5
WEIGHTS_ATOL = 1e-6


def make_batch(seed: int = 0) -> Batch:
    """8 right-padded rows: prompt = first 3 tokens, the rest trained on; row 6 masked out; noisy
    old logprobs so that some PPO ratios are clipped."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(LENGTHS)
    seq_len = 16
    ids = torch.randint(7, 100, (len(LENGTHS), seq_len), generator=g)
    valid = torch.arange(seq_len)[None] < lengths[:, None]
    ids[~valid] = 0
    token_mask = valid.float()
    token_mask[:, :3] = 0
    sample_mask = torch.ones(len(LENGTHS))
    sample_mask[6] = 0
    advantages = torch.randn(len(LENGTHS), 1, generator=g).expand(-1, seq_len).contiguous()
    old = (-4.0 + 0.3 * torch.randn(len(LENGTHS), seq_len, generator=g)) * valid
    return Batch(input_ids=ids, input_lengths=lengths, token_mask=token_mask, sample_mask=sample_mask,
                 advantages=advantages, prev_logprobs=old, generation_logprobs=old)


def policy_cfg(**overrides) -> PolicyConfig:
    base = dict(
        model_name="tiny",
        optimizer=dict(name="sgd", lr=0.1, weight_decay=0.0),
        max_grad_norm=0.5,  # the norm is above it: clipping is exercised too
        train_global_batch_size=4,  # two optimizer steps per train call
        train_micro_batch_size=1,
        logprob_batch_size=3,
    )
    base.update(overrides)
    return PolicyConfig.model_validate(base)


def run(cluster, cfg: PolicyConfig, name: str, tmp_path=None, generation: NativeGeneration = None) -> dict:
    """Logprobs before, metrics of two train calls, logprobs, reference logprobs and weights after;
    and a checkpoint after the first call when `tmp_path` is given. With `generation`, the trained
    weights are refitted into it at the end (checksums verified, in buckets of 64 KiB: several
    buckets) and `engine_weights_before` / `engine_weights` hold what each of its workers has
    before and after."""
    batch, loss_fn = make_batch(), ClippedPGLoss(LossConfig())
    policy = Policy(cluster, cfg, init_reference_model=True, name=name)
    try:
        out = {"logprobs": policy.get_logprobs(batch)["logprobs"]}
        out["metrics"] = [policy.train(batch, loss_fn)]
        if tmp_path is not None:
            out["checkpoint"] = policy.save_checkpoint(str(tmp_path / f"{name}_step_1"))
        out["metrics"].append(policy.train(batch, loss_fn))
        out["logprobs_after"] = policy.get_logprobs(batch)["logprobs"]
        out["reference"] = policy.get_reference_logprobs(batch)["logprobs"]
        out["weights"] = policy.state_dict_for_export()
        out["pids"] = policy.worker_group.run_all("pid")
        if generation is not None:
            metadata = build_refit_metadata(policy.refit_info(), 1 << 16, dtypes=generation.weight_dtypes())
            generation.prepare_refit_info(metadata)
            out["engine_weights_before"] = generation.worker_group.run_all("get_state_dict")
            refit_policy_generation(policy, generation, metadata, version=1, verify=True)
            out["engine_weights"] = generation.worker_group.run_all("get_state_dict")
    finally:
        policy.shutdown()
    return out


def run_one_worker(cfg: PolicyConfig, name: str) -> dict:
    """`run` of one worker in this process (the local backend): the reference the multi-worker
    runs are compared with. A one-worker policy takes the same path on Ray (no FSDP, no
    collectives at world size 1), so the values agree to float rounding; a Ray actor would only
    add a process start (3-4 s of CPU: torch, transformers, the model) to each reference."""
    return run(LocalCluster(), cfg, name)


def max_differences(actual: dict, expected: dict) -> dict[str, float]:
    """Largest relative differences of the metrics and absolute ones of logprobs and weights (printed)."""
    out = {key: (actual[key] - expected[key]).abs().max().item() for key in ("logprobs", "logprobs_after", "reference")}
    for name in ("loss", "grad_norm"):
        out[name] = max(abs(g[name] - w[name]) / abs(w[name]) for g, w in zip(actual["metrics"], expected["metrics"]))
    out["weights"] = max((actual["weights"][k] - v).abs().max().item() for k, v in expected["weights"].items())
    return out


def assert_same_run(actual: dict, expected: dict) -> None:
    print("max differences:", max_differences(actual, expected))
    for key in ("logprobs", "logprobs_after", "reference"):
        torch.testing.assert_close(actual[key], expected[key], rtol=RTOL, atol=1e-6, msg=lambda m: f"{key}: {m}")
    for got, want in zip(actual["metrics"], expected["metrics"]):
        assert set(got) == set(want)
        for name in ("loss", "grad_norm", "global_valid_toks", "global_valid_seqs", "lr"):
            assert got[name] == pytest.approx(want[name], rel=RTOL), name
    assert set(actual["weights"]) == set(expected["weights"])
    for name, value in expected["weights"].items():
        torch.testing.assert_close(actual["weights"][name], value, rtol=RTOL, atol=WEIGHTS_ATOL,
                                   msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    # Reused worker processes: the module's many short-lived policies and engines skip the
    # interpreter's start and imports after the first (`worker_host.py`).
    cluster = VirtualCluster([4], max_colocated_worker_groups=2, reuse_worker_processes=True)
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def one_worker():
    return run_one_worker(policy_cfg(), "tp1")


@pytest.fixture(scope="module")
def tp2(cluster):
    """Two workers in one TP group, refitted at the end into a one-worker native engine."""
    spec = GenerationSpec("tiny", {"max_new_tokens": 4}, precision="float32")
    generation = NativeGeneration(cluster, spec, bundle_indices=[2], name="tp2_engine")
    try:
        return run(cluster, policy_cfg(num_workers=2, tensor_parallel_size=2), "tp2", generation=generation)
    finally:
        generation.shutdown()


def test_tp2_equals_one_worker(one_worker, tp2):
    """Two workers in one TP group: logprobs, loss, grad norm (clipped SGD steps), weights and the
    reference logprobs of one worker; the counts are not doubled although both ranks see all rows."""
    assert_same_run(tp2, one_worker)
    mask = make_batch()["token_mask"][:, 1:] * make_batch()["sample_mask"][:, None]
    assert tp2["metrics"][0]["global_valid_toks"] == mask.sum().item()
    assert tp2["metrics"][0]["grad_norm"] > 0.5  # clipped


def test_refit_from_tp2_gives_the_engine_the_full_weights_of_one_worker(one_worker, tp2):
    """Refit gathers every tensor from its TP shards (q/k/v/gate/up split by rows, o/down by
    columns) into full tensors: the engine holds exactly the TP policy's weights (checksums, in
    `run`) and so, to the TP tolerance, those one worker has after the same two train calls."""
    [engine] = tp2["engine_weights"]
    assert set(engine) == set(one_worker["weights"])
    assert engine["model.layers.0.self_attn.q_proj.weight"].shape == (128, 128)  # all 4 heads, not 2
    assert engine["model.layers.0.mlp.down_proj.weight"].shape == one_worker["weights"]["model.layers.0.mlp.down_proj.weight"].shape
    for name, value in one_worker["weights"].items():
        assert torch.equal(engine[name], tp2["weights"][name]), name
        torch.testing.assert_close(engine[name], value, rtol=RTOL, atol=WEIGHTS_ATOL, msg=lambda m: f"{name}: {m}")
    [before] = tp2["engine_weights_before"]  # the initial model: every weight must have been replaced
    stale = [name for name, value in engine.items() if name.endswith("proj.weight") and torch.equal(value, before[name])]
    assert not stale, f"the refit left the initial value of {stale}"


def test_tp2_resumes_bit_exactly_and_exports_full_tensors(cluster, tmp_path):
    """AdamW with warm-up under TP: the sharded checkpoint (DTensor weights and Adam moments)
    brings back the next call's metrics and weights bit for bit; `export_hf` of the TP policy then
    writes full (not per-rank) tensors that transformers loads and that equal the trainer's."""
    from transformers import AutoModelForCausalLM

    cfg = policy_cfg(num_workers=2, tensor_parallel_size=2, optimizer=dict(name="adamw", lr=1e-3),
                     scheduler=dict(name="linear", warmup_steps=1, total_steps=4))
    tp2 = run(cluster, cfg, "tp2_adamw", tmp_path)
    resumed = Policy(cluster, cfg, init_reference_model=False, weights_path=tp2["checkpoint"], name="tp2_resumed")
    try:
        assert resumed.train(make_batch(), ClippedPGLoss(LossConfig())) == tp2["metrics"][1]
        weights = resumed.state_dict_for_export()
        assert all(torch.equal(weights[k], v) for k, v in tp2["weights"].items())
        out = resumed.export_hf(tmp_path / "hf")
    finally:
        resumed.shutdown()
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert exported["model.layers.0.self_attn.q_proj.weight"].shape == (128, 128)  # all 4 heads
    for name, value in weights.items():
        assert torch.equal(exported[name], value), name


@pytest.mark.parametrize("batching", ["packed", "dynamic"])
def test_tp2_without_sequence_parallel_packs_and_batches_dynamically_like_one_worker(cluster, one_worker, batching):
    """Token-budgeted micro-batches under TP alone: packed bins of <= 20 tokens (several rows in one
    `[1, T]` row, attention kept inside each sequence), or dynamic batching (rows sorted by length,
    grouped under 24 padded tokens with lengths rounded up to 4: the training steps' rows [14, 5, 9,
    7] become [14], [9, 7], [5]). Both ranks of the TP group must cut the same micro-batches and the
    loss must still divide by the global counts, so the run equals one worker's fixed-size one."""
    budget = dict(enabled=True, train_mb_tokens=20 if batching == "packed" else 24,
                  logprob_mb_tokens=20 if batching == "packed" else 24)
    if batching == "dynamic":
        budget["sequence_length_round"] = 4
    key = "sequence_packing" if batching == "packed" else "dynamic_batching"
    cfg = policy_cfg(num_workers=2, tensor_parallel_size=2, **{key: budget})
    assert_same_run(run(cluster, cfg, f"tp2_{batching}"), one_worker)


@pytest.mark.parametrize("packed", [False, True], ids=["micro_batches", "packed"])
def test_sequence_parallel_tp2_equals_one_worker(cluster, one_worker, packed):
    """SP: norms and residual stream split by sequence; rows of odd lengths (and packed bins of odd
    totals) are padded to a multiple of 2 tokens, which must not change any value. The packed case
    (bins of <= 20 tokens) also checkpoints activations (packing without SP: the test above)."""
    packing = dict(enabled=True, train_mb_tokens=20, logprob_mb_tokens=20) if packed else dict(enabled=False)
    cfg = policy_cfg(num_workers=2, tensor_parallel_size=2, sequence_parallel=True, sequence_packing=packing,
                     activation_checkpointing=packed)
    assert_same_run(run(cluster, cfg, f"sp2_{'packed' if packed else 'rows'}"), one_worker)


def test_dp2_tp2_equals_dp2_in_processes_that_hosted_another_mesh(cluster, one_worker):
    """Four workers as 2 data-parallel ranks x 2 tensor-parallel ranks against 2 data-parallel ones,
    in the four processes a (dp 1, cp 2, tp 2) group used first. DTensor caches its plans per mesh,
    and the two meshes' tp dimensions are equal as meshes but were built on other process groups:
    a process that kept those plans failed ("Could not resolve the process group registered under
    the name 8") or, on other layouts, corrupted its heap (`collective.forget_destroyed_groups`)."""
    dp2 = run(cluster, policy_cfg(num_workers=2), "dp2")
    batch = make_batch()
    cp2_tp2 = Policy(cluster, policy_cfg(num_workers=4, context_parallel_size=2, tensor_parallel_size=2),
                     init_reference_model=False, name="cp2_tp2")
    try:
        torch.testing.assert_close(cp2_tp2.get_logprobs(batch)["logprobs"], one_worker["logprobs"], rtol=RTOL, atol=1e-6)
        hosts = set(cp2_tp2.worker_group.run_all("pid"))
    finally:
        cp2_tp2.shutdown()
    dp2_tp2 = run(cluster, policy_cfg(num_workers=4, tensor_parallel_size=2), "dp2_tp2")
    assert_same_run(dp2_tp2, dp2)
    assert hosts <= set(dp2_tp2["pids"]), "the dp2 x tp2 group did not reuse the cp2 x tp2 group's processes"


def two_grpo_steps(tmp_path, *overrides: str) -> dict[int, dict]:
    """The logged metrics by step of two steps of the small GRPO job on Ray workers, with `overrides`."""
    from posttrain.algorithms import grpo
    from test_grpo import read_metrics, small_cfg

    ctx = grpo.setup(small_cfg(tmp_path, *overrides, "cluster.backend=ray", "grpo.max_num_steps=2"))
    try:
        grpo.grpo_train(ctx)
    finally:
        ctx.shutdown()
    return read_metrics(tmp_path / "logs")


def test_grpo_with_tp2_refits_the_native_engine_exactly(ray_cluster, tmp_path):
    """GRPO with 2 workers in one TP group: the native engine gets the full weights at every
    refit (checksum verified), so its logprobs are the trainer's (token_mult_prob_error ~ 1)."""
    metrics = two_grpo_steps(tmp_path, "policy.num_workers=2", "policy.tensor_parallel_size=2")
    for step in (1, 2):
        assert 1.0 <= metrics[step]["train/token_mult_prob_error"] < 1.001, metrics[step]
        assert metrics[step]["train/num_samples"] == 16


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_bfloat16_mixed_precision_trains_on_cpu(cluster, one_worker, tp):
    """`policy.precision=bfloat16` with FSDP2 (bf16 parameters all-gathered, fp32 gradient
    reduction, fp32 masters) runs on CPU (and `fsdp_cpu_offload` is ignored there with a note) and follows the float32 run to
    bf16 accuracy (logprobs within 0.1, loss within 2%); the masters stay float32."""
    cfg = policy_cfg(num_workers=2, tensor_parallel_size=tp, precision="bfloat16", fsdp_cpu_offload=tp == 1)
    bf16 = run(cluster, cfg, f"bf16_tp{tp}")
    torch.testing.assert_close(bf16["logprobs"], one_worker["logprobs"], atol=0.1, rtol=0)
    for got, want in zip(bf16["metrics"], one_worker["metrics"]):
        assert got["loss"] == pytest.approx(want["loss"], rel=0.02)
    assert all(value.dtype == torch.float32 for value in bf16["weights"].values())


@pytest.fixture(scope="module")
def gemma3_one_worker():
    return run_one_worker(policy_cfg(model_name="tiny-gemma3"), "gemma3_tp1")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "sp2"])
def test_gemma3_tp2_equals_one_worker(cluster, gemma3_one_worker, sequence_parallel):
    """Gemma 3 (`tiny-gemma3`: a sliding-window layer of 8 positions, which rows of up to 16 tokens
    run past, and a global one; QK-norm applied to `[batch, heads, seq, head_dim]`, four norms per
    layer, scaled and tied embeddings) split over a TP group by its config's own plan: logprobs,
    two clipped SGD steps and the weights after them equal one worker's; with `sequence_parallel`
    the four norms of each layer run on half the sequence."""
    cfg = policy_cfg(model_name="tiny-gemma3", num_workers=2, tensor_parallel_size=2,
                     sequence_parallel=sequence_parallel)
    tp2 = run(cluster, cfg, f"gemma3_{'sp2' if sequence_parallel else 'tp2'}")
    assert_same_run(tp2, gemma3_one_worker)
    assert tp2["metrics"][0]["grad_norm"] > 0.5  # clipped
    norm = "model.layers.0.self_attn.q_norm.weight"  # replicated over the TP group, its gradient summed
    assert not torch.equal(tp2["weights"][norm], torch.zeros_like(tp2["weights"][norm]))
