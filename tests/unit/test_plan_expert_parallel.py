"""`posttrain plan` under expert parallelism: the routed experts' elements are counted, split over
the EP ranks (whole experts, outside FSDP) and left out of FSDP's all-gathered layers; the fixes of a
mixture of experts that does not fit name EP sizes, a dense model's never."""

from __future__ import annotations

from test_plan import SHAPE, grpo

from posttrain import plan as mp

GiB = mp.GiB
MOE = mp.ModelShape(**{**SHAPE.__dict__, "num_experts": 8, "experts_per_token": 2, "expert_params": 600_000})


def test_model_shape_counts_the_routed_experts():
    # tiny-qwen3_moe: 2 MoE layers x 4 experts x (gate_up 2 x 128 x 128 + down 128 x 128).
    assert mp.model_shape(grpo("policy.tiny_arch=qwen3_moe").policy).expert_params == 2 * 4 * 3 * 128 * 128
    # tiny-deepseek_v3: the second layer only (the first is dense) x 8 experts x 3 x 128 x 64; the shared expert is not routed.
    assert mp.model_shape(grpo("policy.tiny_arch=deepseek_v3").policy).expert_params == 8 * 3 * 128 * 64
    assert mp.model_shape(grpo().policy).expert_params == 0


def test_expert_parallel_splits_the_experts_by_hand():
    assert mp.per_rank_params(MOE, 8, 1, ep=4) == 400_000 / 8 + 600_000 / 4
    assert mp.per_rank_params(MOE, 8, 1) == 1_000_000 / 8
    cfg = grpo("cluster.gpus_per_node=8", "policy.num_workers=8", "policy.expert_parallel_size=8")
    rows = mp.memory_plan(cfg, MOE, device_bytes=80 * GiB).devices[0].rows
    assert rows["policy parameters (fp32)"]["training"] == 4 * (400_000 / 8 + 600_000 / 8)
    assert rows["FSDP all-gathered layers"]["training"] == 2 * 4 * 400_000 / 4  # the experts stay local


def test_fixes_name_expert_parallel_sizes_for_a_mixture_of_experts_only():
    cfg = grpo("cluster.gpus_per_node=8", "policy.num_workers=8")
    keys = [key for key, _ in mp.candidate_fixes(cfg, MOE)]
    assert {"policy.expert_parallel_size=2", "policy.expert_parallel_size=4", "policy.expert_parallel_size=8"} <= set(keys)
    assert not [key for key, _ in mp.candidate_fixes(cfg, SHAPE) if "expert_parallel" in key]
    with_tp = grpo("cluster.gpus_per_node=8", "policy.num_workers=8", "policy.tensor_parallel_size=2")
    assert not [key for key, _ in mp.candidate_fixes(with_tp, MOE) if "expert_parallel" in key]  # refused with TP
