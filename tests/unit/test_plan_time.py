"""The time plan (`posttrain/plan/timing.py`, docs/plan-time.md): each phase against the same
arithmetic done by hand, the GPU table, the lengths it reads, and --search."""

from __future__ import annotations

import json
import math

import pytest

from posttrain import cli
from posttrain.errors import UserError
from posttrain.plan.gpus import GPU_SPECS
from posttrain.plan.lengths import lengths_from_metrics, plan_lengths
from posttrain.plan.shape import ModelShape
from posttrain.plan.timing import (
    COLLECTIVE_LATENCY_S, EFFICIENCY, OPTIMIZER_BYTES_PER_PARAM, Layout, Lengths, collective_s, experts_touched,
    generation_s, link_bandwidth, policy_pass_s,
)

H100 = GPU_SPECS["H100"]
# Llama-3.1-8B (examples/plans/models/llama-3.1-8b/config.json; 8,030,261,248 parameters counted on
# the meta device): untied embeddings and head, 128,256 x 4,096 each.
LLAMA_8B = ModelShape(num_params=8_030_261_248, hidden_size=4096, num_layers=32, vocab_size=128_256, num_heads=32,
                      num_kv_heads=8, head_dim=128, intermediate_size=14_336, embedding_params=2 * 128_256 * 4096)
MATMUL_PARAMS = 8_030_261_248 - 128_256 * 4096  # all but the input embeddings: 7,504,928,768


def one_gpu(gpus: int = 1, gpus_per_node: int = 8, **dims) -> Layout:
    d = {"dp": gpus, "tp": 1, "pp": 1, "cp": 1, "ep": 1, **dims}
    return Layout(train_devices=gpus, gen_devices=gpus, gen_tp=1, colocated=True, gpus_per_node=gpus_per_node,
                  num_nodes=max(1, gpus // gpus_per_node), **d)


def test_one_row_decoding_llama_8b_on_an_h100_is_its_weights_read_once_a_step(monkeypatch):
    # One row of 100 prompt + 1000 new tokens, max_new_tokens 1000: 1000 decode steps (the tail is
    # capped by max_new_tokens), each reading the 15.0 GB of bfloat16 weights it multiplies by and
    # the row's KV cache at its mean context (100 + 500 tokens x 32 layers x 2 x 8 x 128 x 2 bytes),
    # at 0.7 of 3.35 TB/s, plus vLLM's host work a step; the prefill is 100 tokens' FLOPs at 0.5 of
    # 989 TFLOP/s. Without the host work (0 here) the step is the bandwidth bound.
    seconds, bound, detail = generation_s(LLAMA_8B, H100, one_gpu(), rows=1, prompts=1, lengths=Lengths(100, 1000),
                                          dtype_bytes=2, max_new_tokens=1000, max_running_rows=None,
                                          kv_budget_bytes=None, vllm=True)
    step_bytes = MATMUL_PARAMS * 2 + 600 * 32 * 2 * 8 * 128 * 2
    decode = 1000 * (step_bytes / (3.35e12 * 0.7) + 0.015)
    assert EFFICIENCY["vllm_step_s"] == 0.015
    assert seconds - decode == pytest.approx(100 * (2 * MATMUL_PARAMS + 4 * 32 * 32 * 128 * 50) / (989e12 * 0.5))
    monkeypatch.setitem(EFFICIENCY, "vllm_step_s", 0.0)
    seconds, bound, detail = generation_s(LLAMA_8B, H100, one_gpu(), rows=1, prompts=1, lengths=Lengths(100, 1000),
                                          dtype_bytes=2, max_new_tokens=1000, max_running_rows=None,
                                          kv_budget_bytes=None, vllm=True)
    decode = 1000 * step_bytes / (3.35e12 * 0.7)
    prefill = 100 * (2 * MATMUL_PARAMS + 4 * 32 * 32 * 128 * 50) / (989e12 * 0.5)
    assert EFFICIENCY["decode_bandwidth"] == 0.7 and EFFICIENCY["prefill_mfu"] == 0.5
    assert detail["decode_steps"] == 1000 and bound.startswith("decode memory-bound")
    assert seconds == pytest.approx(prefill + decode, rel=1e-9)
    assert decode == pytest.approx(6.434, abs=1e-3)  # 15.09 GB / 2.345 TB/s = 6.43 ms a step


def test_decoding_ends_with_the_tail_and_large_batches_turn_compute_bound():
    lengths = Lengths(100, 1000)
    _, _, few = generation_s(LLAMA_8B, H100, one_gpu(), 1, 1, lengths, 2, 4096, None, None, vllm=True)
    assert few["decode_steps"] == EFFICIENCY["decode_tail"] * 1000  # the longest rows: 2.5 x the mean
    _, bound, many = generation_s(LLAMA_8B, H100, one_gpu(), 4096, 4096, Lengths(100, 100), 2, 4096, None, None,
                                  vllm=True)
    assert "compute-bound" in bound and many["decode_rows"] > 1000


def test_a_mixture_of_experts_reads_the_experts_its_rows_route_to():
    moe = ModelShape(num_params=30_532_122_624, hidden_size=2048, num_layers=48, vocab_size=151_936, num_heads=32,
                     num_kv_heads=4, head_dim=128, intermediate_size=768, num_experts=128, experts_per_token=8,
                     embedding_params=2 * 151_936 * 2048, expert_params=28_991_029_248)
    assert experts_touched(moe, 1) == pytest.approx(8)
    assert experts_touched(moe, 256) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 256))
    assert experts_touched(moe, 256) > 127.9


def test_training_on_one_gpu_is_three_forwards_at_the_training_mfu_plus_the_optimizer_step():
    rows, lengths = 64, Lengths(200, 800)
    seconds, bound, parts = policy_pass_s(LLAMA_8B, H100, one_gpu(), rows, lengths, 2, micro_batches=8,
                                          backward=True, checkpointing=False, trained_params=LLAMA_8B.num_params)
    tokens = 64 * 1000
    flops = 3 * tokens * (2 * MATMUL_PARAMS + 4 * 32 * 32 * 128 * 500)
    compute = flops / (989e12 * 0.4)
    optimizer = LLAMA_8B.num_params * OPTIMIZER_BYTES_PER_PARAM / 3.35e12
    assert bound == "compute-bound" and parts["FSDP"] == 0
    assert seconds == pytest.approx(compute + optimizer, rel=1e-9)


def test_collectives_use_nvlink_inside_a_node_and_the_network_beyond():
    assert link_bandwidth(H100, 8, one_gpu(16)) == 450e9
    assert link_bandwidth(H100, 16, one_gpu(16)) == 50e9
    assert link_bandwidth(GPU_SPECS["GB200"], 16, one_gpu(16, gpus_per_node=4)) == 900e9  # one NVL72 domain
    # Ring all-reduce of 1 GB over 8 H100s: 2 x 7/8 of it at 0.7 of 450 GB/s, plus one call's latency.
    assert collective_s(1e9, 8, H100, 8, one_gpu(8), "all_reduce") == pytest.approx(
        COLLECTIVE_LATENCY_S + 2 * 7 / 8 * 1e9 / (450e9 * 0.7))
    assert collective_s(1e9, 1, H100, 1, one_gpu(), "all_reduce") == 0


def test_fsdp_over_two_nodes_overlaps_compute_and_tensor_parallel_adds_its_all_reduces():
    lengths = Lengths(100, 900)
    alone, _, _ = policy_pass_s(LLAMA_8B, H100, one_gpu(16), 512, lengths, 2, 4, False, False, 0)
    _, _, parts = policy_pass_s(LLAMA_8B, H100, one_gpu(16), 512, lengths, 2, 4, False, False, 0)
    assert alone == pytest.approx(max(parts["compute"], parts["FSDP"]))
    tp, _, tp_parts = policy_pass_s(LLAMA_8B, H100, one_gpu(16, dp=8, tp=2), 512, lengths, 2, 4, False, False, 0)
    assert tp_parts["TP"] > 0 and tp > max(tp_parts["compute"], tp_parts["FSDP"])


def test_the_gpu_table_holds_the_datasheets_dense_peaks():
    assert GPU_SPECS["H100"].bf16_flops == 989e12 and GPU_SPECS["H200"].memory_bw == 4.8e12
    assert GPU_SPECS["GB200"].nvlink_domain == 72 and GPU_SPECS["L40S"].nvlink_bw == 0
    assert set(GPU_SPECS) == {"H100", "H200", "B200", "GB200", "A100", "L40S"}
    assert GPU_SPECS["A100"].flops(4) == 19.5e12 and GPU_SPECS["A100"].flops(2) == 312e12


def test_lengths_come_from_a_runs_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in (
        {"step": 1, "train/mean_gen_tokens_per_sample": 10.0, "train/mean_prompt_length": 40.0},
        {"step": 2, "train/mean_gen_tokens_per_sample": 20.0, "train/mean_prompt_length": 60.0},
        {"step": 2, "validation/accuracy": 0.5})) + "\n")
    assert lengths_from_metrics(tmp_path) == (50.0, 15.0)
    with pytest.raises(UserError, match="no such file"):
        lengths_from_metrics(tmp_path / "nothing.jsonl")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(UserError, match="line 1 is not JSON"):
        lengths_from_metrics(tmp_path / "bad.jsonl")


def test_the_cli_prints_the_time_plan_and_refuses_bad_lengths_in_one_line(capsys):
    assert cli.main(["plan", "sft_warmup=null", "--response-length", "8", "--prompt-length", "9"]) == 0
    out = capsys.readouterr().out
    assert "Time plan per step on 1 x CPU (measured) (given: mean prompt 9, mean response 8 tokens):" in out
    assert "tokens/s per process:" in out and "refit" in out
    assert cli.main(["plan", "sft_warmup=null", "--response-length", "-3"]) == cli.EXIT_CONFIG_ERROR
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == "posttrain plan: --response-length=-3: give a positive number of tokens"
    assert cli.main(["plan", "sft_warmup=null", "--search"]) == cli.EXIT_CONFIG_ERROR
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("posttrain plan: --search plans GPU clusters")


def test_search_proposes_the_cheapest_shape_within_the_target_and_says_why_not_the_others(monkeypatch):
    from posttrain.config import load_config
    from posttrain.plan import time_plan

    monkeypatch.setattr(time_plan, "SEARCH_GPUS", (1, 8, 16))
    cfg = load_config("grpo", "examples/plans/nemo_rl_v0.4_llama3.1_8b_h100x16.yaml")
    best, lines = time_plan.search_shapes(cfg, LLAMA_8B, Lengths(132, 1060), target_s=150)
    assert best is not None and best.step.step_s <= 150 and best.gpus in (8, 16)
    assert any(line.startswith("1 GPU colocated: no layout fits (needs ") for line in lines)
    others = [c for c in (8, 16) if c != best.gpus]
    assert any(line.startswith(f"{others[0]} GPUs colocated: ") for line in lines)
    none, _ = time_plan.search_shapes(cfg, LLAMA_8B, Lengths(132, 1060), target_s=1)
    assert none is None


def test_plan_lengths_default_to_the_configs_bounds():
    from posttrain.config import load_config

    cfg = load_config("grpo", overrides=["sft_warmup=null"])
    lengths = plan_lengths(cfg, longest_prompt=9)
    assert (lengths.prompt, lengths.response) == (9, cfg.policy.generation.max_new_tokens)
    assert "upper bound" in lengths.source
    assert math.isclose(plan_lengths(cfg, 5, 7).response, 7)


def test_pipeline_stages_pay_a_bubble_per_optimizer_step_and_their_sends():
    lengths = Lengths(100, 900)
    layout = one_gpu(8, dp=2, pp=4)
    once, _, parts = policy_pass_s(LLAMA_8B, H100, layout, 64, lengths, 2, 16, True, False, 0, flushes=1)
    twice, _, parts2 = policy_pass_s(LLAMA_8B, H100, layout, 64, lengths, 2, 16, True, False, 0, flushes=2)
    assert parts["pipeline bubble"] == pytest.approx(parts["compute"] * 3 / 16)
    assert twice - once == pytest.approx(parts["pipeline bubble"])
    # 16 micro-batches of 32 rows x 1000 tokens / 16 hidden states, forward and backward, one send each.
    sends = 16 * 2 * (COLLECTIVE_LATENCY_S + 2000 * 4096 * 2 / (450e9 * 0.7))
    assert parts["PP"] == pytest.approx(sends)


def test_async_grpo_hides_generation_behind_training_or_the_reverse():
    from posttrain.plan.timing import StepTime

    sync = StepTime({"generation": 10.0, "refit": 1.0, "training": 4.0}, {})
    overlapped = StepTime({"generation": 10.0, "refit": 1.0, "training": 4.0}, {}, overlapped=True)
    assert (sync.step_s, overlapped.step_s) == (15.0, 10.0)
    assert StepTime({"generation": 2.0, "refit": 1.0, "training": 4.0}, {}, overlapped=True).step_s == 5.0


def test_a_gpu_config_names_the_gpu_type_it_planned_and_a_target_needs_search(capsys):
    assert cli.main(["plan", "sft_warmup=null", "cluster.gpus_per_node=1", "--response-length", "8"]) == 0
    out = capsys.readouterr().out
    assert "Time plan per step on 1 x H100 " in out  # no GPU here: auto plans the default
    assert "GPU type: cluster.gpu_type=auto planned H100" in out
    assert cli.main(["plan", "sft_warmup=null", "--target-step-s", "10"]) == cli.EXIT_CONFIG_ERROR
    assert capsys.readouterr().err.strip() == \
        "posttrain plan: --target-step-s is the step time --search aims for: add --search"


def test_cpu_workers_of_one_node_share_its_measured_cores():
    from posttrain.plan.gpus import DeviceSpec

    cpu = DeviceSpec("CPU", 300e9, 150e9, 24, 12e9, 12e9, 3e9, nvlink_domain=1 << 30)
    one = Layout(1, 1, 1, 1, 1, 1, 1, 1, True, gpus_per_node=0, num_nodes=1)
    two = Layout(2, 2, 1, 1, 1, 1, 2, 1, True, gpus_per_node=0, num_nodes=1)
    lengths = Lengths(10, 10)
    _, _, alone = policy_pass_s(LLAMA_8B, cpu, one, 4, lengths, 4, 1, True, False, 0)
    _, _, shared = policy_pass_s(LLAMA_8B, cpu, two, 4, lengths, 4, 1, True, False, 0)
    assert shared["compute"] == pytest.approx(alone["compute"])  # twice the workers, the same cores
    assert two.share(2) == 0.5 and one_gpu(8).share(8) == 1.0


def test_a_cpu_without_bfloat16_matmuls_is_planned_at_float32s_rate_in_bfloat16(monkeypatch):
    # posttrain multiplies bfloat16 layers in float32 there; the scalar bfloat16 GEMM is never run.
    from posttrain.plan import gpus

    monkeypatch.setattr(gpus, "cpu_bfloat16_is_fast", lambda: False)
    gpus.cpu_spec.cache_clear()
    try:
        spec = gpus.cpu_spec()
    finally:
        gpus.cpu_spec.cache_clear()
    assert spec.bf16_flops == spec.fp32_flops > 0


def test_the_native_engine_on_a_gpu_pays_its_kernel_launches_every_layer_and_step():
    from posttrain.plan.timing import NATIVE_GPU_LAYER_S

    lengths = Lengths(100, 1000)
    vllm_s, _, _ = generation_s(LLAMA_8B, H100, one_gpu(), 1, 1, lengths, 2, 1000, None, None, vllm=True)
    native_s, bound, _ = generation_s(LLAMA_8B, H100, one_gpu(), 1, 1, lengths, 2, 1000, None, None, vllm=False)
    # 1000 steps x 32 layers x 0.75 ms against vLLM's 15 ms of host work a step.
    assert native_s - vllm_s == pytest.approx(1000 * (32 * NATIVE_GPU_LAYER_S - EFFICIENCY["vllm_step_s"]))
    assert "kernel-launch-bound" in bound
    cpu = Layout(1, 1, 1, 1, 1, 1, 1, 1, True, gpus_per_node=0, num_nodes=1)
    _, cpu_bound, _ = generation_s(LLAMA_8B, H100, cpu, 1, 1, lengths, 2, 1000, None, None)
    assert "kernel-launch" not in cpu_bound


def test_search_leaves_out_what_posttrain_refuses_to_run():
    from posttrain.config import load_config
    from posttrain.plan import time_plan

    cfg = load_config("grpo", "examples/plans/nemo_rl_v0.4_qwen3_30b_a3b_h100x32.yaml")
    moe = ModelShape(num_params=30_532_122_624, hidden_size=2048, num_layers=48, vocab_size=151_936, num_heads=32,
                     num_kv_heads=4, head_dim=128, intermediate_size=768, num_experts=128, experts_per_token=8,
                     embedding_params=2 * 151_936 * 2048, expert_params=28_991_029_248)
    both = time_plan.Candidate(32, True, {"cluster.num_nodes": 4, "policy.num_workers": 32,
                                          "policy.tensor_parallel_size": 2, "policy.expert_parallel_size": 8})
    weighed = time_plan.weigh(cfg, moe, H100, Lengths(98, 3154), both, None)
    assert weighed.step is None
    assert weighed.problem.startswith("posttrain cannot run it: ") and "expert_parallel_size=8" in weighed.problem


def test_each_published_run_config_loads_and_names_its_source_and_what_it_could_not_express():
    from pathlib import Path

    from posttrain.config import load_config

    plans = sorted(p for p in Path("examples/plans").glob("nemo_rl_v*.yaml"))
    assert len(plans) >= 7
    for path in plans:
        text = path.read_text()
        assert "https://docs.nvidia.com/nemo/rl/" in text, path
        assert "Not expressed" in text or "not expressible" in text.lower() or "as the v0.4 row" in text \
            or "not published" in text, path
        cfg = load_config("grpo", str(path))
        assert cfg.cluster.gpu_type in ("H100", "GB200") and cfg.policy.generation.backend == "vllm"


def test_every_published_and_measured_run_is_planned_within_a_factor_1_5(monkeypatch):
    """benchmarks/plan_vs_published.py's rows: the GPU runs others published and this project's own
    CPU runs on both CPU kinds, each on the device it ran on, one set of constants."""
    import importlib.util
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("plan_vs_published", repo / "benchmarks" / "plan_vs_published.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "plan_vs_published", module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    monkeypatch.chdir(repo)  # the plan configs name their models relative to the repository
    ratios = {run.label: module.plan_run(run)[0].step_s / run.step_s for run in module.GPU_RUNS + module.CPU_RUNS}
    assert len(module.GPU_RUNS) >= 6 and {run.cpu_kind for run in module.CPU_RUNS} == {"avx512", "avx2"}
    assert not {label: ratio for label, ratio in ratios.items() if not 1 / 1.5 <= ratio <= 1.5}
