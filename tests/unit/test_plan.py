"""The memory plan (`posttrain/plan/`, `posttrain plan`): formula values, the plan's rows for
each placement, the refusal naming keys, the CLI, preflight, and vLLM's placement-dependent share."""

from __future__ import annotations

import pytest

from posttrain import cli
from posttrain.config import load_config
from posttrain.errors import UserError
from posttrain import plan as mp

GiB, MiB = mp.GiB, mp.MiB

# A made-up llama-like shape, small enough to check by hand.
SHAPE = mp.ModelShape(num_params=1_000_000, hidden_size=64, num_layers=4, vocab_size=100, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=256, largest_tensor=100_000)


def grpo(*overrides):
    return load_config("grpo", None, list(overrides))


def test_optimizer_state_is_two_fp32_moments_for_adam_and_none_for_sgd():
    assert mp.optimizer_state_bytes(1000, "adamw", 1) == 8000
    assert mp.optimizer_state_bytes(1000, "adam", 4) == 2000
    assert mp.optimizer_state_bytes(1000, "sgd", 1) == 0


def test_activation_and_kv_formulas_by_hand():
    # attention 2*64 + 7*64 + 2*32 = 640, MLP 2*64 + 4*256 = 1152 elements per token and layer.
    assert mp.activation_bytes_per_token_layer(SHAPE, 4) == 4 * 1792
    assert mp.activation_bytes_per_token_layer(SHAPE, 2) == 2 * 1792 + 8 * 64  # fp32 norm upcast
    full = mp.training_activation_bytes(SHAPE, 1000, 4, checkpointing=False, fused_logprobs=False)
    assert full == 1000 * 5 * 4 * 1792 + 3 * 4 * 1000 * 100
    ckpt = mp.training_activation_bytes(SHAPE, 1000, 4, checkpointing=True, fused_logprobs=False)
    assert ckpt == 1000 * (4 * 4 * 64 + 2 * 4 * 1792) + 3 * 4 * 1000 * 100
    fused = mp.training_activation_bytes(SHAPE, 1000, 4, checkpointing=False, fused_logprobs=True)
    assert fused == 1000 * 5 * 4 * 1792 + 16 * MiB + 1000 * 4 * 64
    assert mp.kv_cache_bytes(SHAPE, sequences=8, seq_len=100, dtype_bytes=2) == 2 * 4 * 2 * 16 * 2 * 8 * 100


def test_micro_batch_tokens_follow_the_batching_mode():
    assert mp.micro_batch_tokens(grpo().policy, training=True) == 128 * 64
    assert mp.micro_batch_tokens(grpo().policy, training=False) == 128 * 64
    dyn = grpo("policy.dynamic_batching.enabled=true", "policy.dynamic_batching.train_mb_tokens=777").policy
    assert mp.micro_batch_tokens(dyn, training=True) == 777 and mp.micro_batch_tokens(dyn, training=False) == 8192
    packed = grpo("policy.sequence_packing.enabled=true", "policy.sequence_packing.logprob_mb_tokens=999").policy
    assert mp.micro_batch_tokens(packed, training=False) == 999


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_moe", "deepseek_v3"])
def test_model_shape_counts_the_real_parameters_without_weights(arch):
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.models.tiny import tiny_config

    shape = mp.model_shape(grpo(f"policy.tiny_arch={arch}").policy)
    model = AutoModelForCausalLM.from_config(tiny_config("tiny", arch))
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert shape.largest_tensor == max(p.numel() for p in model.parameters())
    assert (shape.hidden_size, shape.num_layers, shape.vocab_size) == (128, 2, 103)
    assert (shape.num_experts > 0) == (arch in ("qwen3_moe", "deepseek_v3"))
    if arch == "deepseek_v3":  # MLA: 32-wide query/key heads, a cache of the rank-32 latent + the 16-wide rotary key
        assert (shape.num_experts, shape.experts_per_token, shape.head_dim, shape.kv_cache_width) == (8, 3, 32, 48)
        assert mp.kv_cache_bytes(shape, 1, 10, 2) == 2 * 48 * 2 * 10
    heads = {id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())}
    assert shape.embedding_params == sum(heads.values())  # once when tied: whole on every TP rank
    lora = mp.model_shape(grpo("policy.lora.enabled=true").policy)
    # q, k, v, o of 2 layers, rank 8: q/o are 128x128, k/v 128x64 (2 kv heads of 32).
    assert lora.lora_params == 2 * 8 * ((128 + 128) * 2 + (128 + 64) * 2)
    assert not any(p.is_meta for p in model.parameters()) and torch.is_tensor(next(model.parameters()))


def test_plan_rows_for_sharding_reference_and_colocated_vllm_on_gpu():
    cfg = grpo("cluster.gpus_per_node=8", "policy.num_workers=8", "policy.precision=bfloat16",
               "policy.generation.backend=vllm", "loss_fn.reference_policy_kl_penalty=0.01")
    plan = mp.memory_plan(cfg, SHAPE, device_bytes=80 * GiB)
    (gpu,) = plan.devices
    rows = gpu.rows
    assert rows["policy parameters (fp32)"]["training"] == 4 * 1_000_000 // 8
    assert rows["gradients (fp32)"] == {"training": 4 * 1_000_000 // 8}
    # policy.offload_during_generation (auto: on when colocated on GPUs): the training state is in
    # host memory while vLLM generates.
    assert rows["optimizer state (adamw)"] == {p: 8 * 1_000_000 // 8 for p in ("refit", "logprobs", "training")}
    assert "generation" not in rows["policy parameters (fp32)"]
    assert rows["vLLM weights + KV cache (0.5 of the GPU)"] == {p: 40 * GiB for p in ("generation", "refit", "validation")}
    # On GPUs the reference copy is host memory (policy worker keeps it on the CPU).
    assert not any(item.startswith("reference") for item in rows)
    assert rows["refit bucket (send)"]["refit"] == 2 * 1_000_000 + 2 * 100_000  # whole model < 512 MiB bucket
    assert "runtime (python, torch)" not in rows
    assert plan.node_peak() == gpu.peak()[1] and gpu.peak()[0] == "refit"  # vLLM awake and the buckets


def test_without_offloading_the_training_state_stays_through_generation():
    cfg = grpo("cluster.gpus_per_node=8", "policy.num_workers=8", "policy.generation.backend=vllm",
               "policy.offload_during_generation=false")
    rows = mp.memory_plan(cfg, SHAPE, device_bytes=80 * GiB).devices[0].rows
    assert rows["optimizer state (adamw)"]["generation"] == 8 * 1_000_000 // 8
    assert rows["policy parameters (fp32)"]["generation"] == 4 * 1_000_000 // 8


def test_weights_lent_to_the_engine_stay_on_the_gpu_when_the_rest_is_offloaded():
    cfg = grpo("cluster.gpus_per_node=1", "cluster.backend=local")
    rows = mp.memory_plan(cfg, SHAPE, device_bytes=80 * GiB).devices[0].rows
    assert rows["policy parameters (fp32)"]["generation"] == 4 * 1_000_000
    assert "generation" not in rows["optimizer state (adamw)"]


def test_split_placement_gives_generation_gpus_their_own_plan():
    cfg = grpo("cluster.gpus_per_node=8", "policy.num_workers=4", "policy.generation.backend=vllm",
               "policy.generation.colocated.enabled=false", "policy.generation.colocated.num_workers=4")
    trainer, engine = mp.memory_plan(cfg, SHAPE, device_bytes=80 * GiB).devices
    assert engine.name == "generation worker" and trainer.name == "policy worker"
    assert engine.rows["vLLM weights + KV cache (0.9 of the GPU)"]["training"] == int(0.9 * 80 * GiB)
    assert not any(item.startswith("vLLM") for item in trainer.rows)


def test_cpu_reference_model_is_counted_in_the_worker_process():
    plan = mp.memory_plan(grpo("loss_fn.reference_policy_kl_penalty=0.01"), SHAPE, device_bytes=16 * GiB)
    assert plan.devices[0].rows["reference model (fp32, host)"]["logprobs"] == 4 * 1_000_000
    # The local backend's native engine reads the policy's weights in place: no copy, no refit bucket.
    assert "generation weights" not in plan.devices[0].rows and "refit bucket (send)" not in plan.devices[0].rows


def test_the_engine_is_planned_in_its_own_precision():
    """policy.generation.precision: a bfloat16 engine holds its own 2-byte copy (nothing to lend a
    float32 trainer) and a 2-byte KV cache; an int8 engine borrows the float32 weights and adds its
    one-byte copy of the linear layers outside the embeddings and head."""
    same = mp.memory_plan(grpo(), SHAPE, device_bytes=16 * GiB).devices[0].rows
    bf16 = mp.memory_plan(grpo("policy.generation.precision=bfloat16"), SHAPE, device_bytes=16 * GiB).devices[0].rows
    int8 = mp.memory_plan(grpo("policy.generation.precision=int8"), SHAPE, device_bytes=16 * GiB).devices[0].rows
    assert "generation weights" not in same and "generation weights" not in int8
    assert bf16["generation weights"]["generation"] == 2 * SHAPE.num_params
    assert bf16["KV cache"]["generation"] * 2 == same["KV cache"]["generation"]
    assert int8["int8 copy of the linear layers"]["generation"] == SHAPE.num_params - SHAPE.embedding_params
    assert int8["KV cache"] == same["KV cache"]


def test_a_plan_that_cannot_fit_names_the_keys_that_would():
    cfg = grpo("cluster.gpus_per_node=8", "policy.num_workers=8", "policy.generation.backend=vllm",
               "policy.precision=float32", "policy.train_micro_batch_size=4", "policy.logprob_batch_size=4",
               "policy.max_total_sequence_length=4096")
    big = mp.ModelShape(num_params=7_000_000_000, hidden_size=4096, num_layers=32, vocab_size=32000,
                        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
                        largest_tensor=131_072_000)
    plan = mp.memory_plan(cfg, big, device_bytes=80 * GiB)
    problem = mp.fit_problem(cfg, big, plan)
    assert problem.startswith("memory plan: training needs")
    assert "policy.activation_checkpointing=true" in problem
    assert "policy.train_micro_batch_size=1" in problem  # 2 rows of 4096 tokens do not fit
    assert "policy.num_workers" not in problem  # sharding does not shrink activations
    assert "policy.generation.vllm_cfg.gpu_memory_utilization" not in problem  # vLLM sleeps in training
    assert mp.fit_problem(cfg, SHAPE, mp.memory_plan(cfg, SHAPE, device_bytes=80 * GiB)) is None


def test_tensor_and_sequence_parallel_split_what_they_split_by_hand():
    # Heads' and MLP width's activations divide by tp, the norms' (2h twice) only with SP:
    # attention 2*64 + (7*64 + 2*32)/2 = 384, MLP 2*64 + 4*256/2 = 640 elements per token and layer.
    assert mp.activation_bytes_per_token_layer(SHAPE, 4, tp=2) == 4 * 1024
    assert mp.activation_bytes_per_token_layer(SHAPE, 4, tp=2, sp=True) == 4 * (64 + 256 + 64 + 512)
    # A checkpointed layer's input splits by sequence only under SP; the head stays whole.
    assert mp.training_activation_bytes(SHAPE, 1000, 4, checkpointing=True, fused_logprobs=False, tp=2, sp=True) == \
        1000 * (4 * 4 * 64 / 2 + 2 * 4 * 896) + 3 * 4 * 1000 * 100
    # Parameters: the layers over all 8 ranks, the embeddings and head (tied or not) over the 4 dp ranks.
    shape = mp.ModelShape(**{**SHAPE.__dict__, "embedding_params": 2 * 100 * 64})
    assert mp.per_rank_params(shape, 8, 1) == 1_000_000 / 8
    assert mp.per_rank_params(shape, 8, 2) == (1_000_000 - 12_800) / 8 + 12_800 / 4
    cfg = grpo("cluster.gpus_per_node=8", "policy.num_workers=8", "policy.tensor_parallel_size=2")
    rows = mp.memory_plan(cfg, shape, device_bytes=80 * GiB).devices[0].rows
    assert rows["policy parameters (fp32)"]["training"] == 4 * ((1_000_000 - 12_800) / 8 + 12_800 / 4)
    assert rows["optimizer state (adamw)"]["training"] == 8 * ((1_000_000 - 12_800) / 8 + 12_800 / 4)
    assert rows["FSDP all-gathered layers"]["training"] == 2 * 4 * (1_000_000 - 12_800) / 4 / 2


def test_context_parallel_divides_the_sequence_proportional_activations_by_hand():
    # cp=2 ranks hold half of every row's tokens: activations and the head are those of half the
    # tokens; parameters shard over all 8 ranks (FSDP over dp x cp); the ring's float32 blocks are
    # 3 copies of rows x heads x (seq / cp)^2 = 2 rows x 4 heads x 1024^2.
    common = ["cluster.gpus_per_node=8", "policy.num_workers=8", "policy.train_micro_batch_size=2",
              "policy.max_total_sequence_length=2048", "policy.train_global_batch_size=64"]  # 2 optimizer steps: logprobs
    cp1 = mp.memory_plan(grpo(*common), SHAPE, device_bytes=80 * GiB).devices[0].rows
    cp2 = mp.memory_plan(grpo(*common, "policy.context_parallel_size=2"), SHAPE, device_bytes=80 * GiB).devices[0].rows
    fused_tokens = 2 * 2048 // 2
    assert cp2["activations"]["training"] == mp.training_activation_bytes(SHAPE, fused_tokens, 4, False, True)
    assert cp2["logprob forward"]["logprobs"] < cp1["logprob forward"]["logprobs"]
    assert cp2["policy parameters (fp32)"] == cp1["policy parameters (fp32)"]
    assert cp2["ring attention blocks (fp32)"]["training"] == 3 * 4 * 2 * 4 * 1024 ** 2
    assert "ring attention blocks (fp32)" not in cp1
    assert mp.ring_attention_block_bytes(SHAPE, 4096, 2048, 1) == 0
    # A fused kernel per block (bf16 on GPUs, any dtype on CPU) tiles the scores: no such row.
    for extra in (["policy.precision=bfloat16"], ["cluster.gpus_per_node=0"]):
        fused = mp.memory_plan(grpo(*common, "policy.context_parallel_size=2", *extra), SHAPE,
                               device_bytes=80 * GiB).devices[0].rows
        assert "ring attention blocks (fp32)" not in fused, extra


def test_a_sequence_too_long_for_one_gpu_is_told_the_tensor_parallel_size_that_fits():
    big = mp.ModelShape(num_params=7_000_000_000, hidden_size=4096, num_layers=32, vocab_size=32000,
                        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
                        largest_tensor=131_072_000, embedding_params=2 * 32000 * 4096)
    long = ["cluster.gpus_per_node=8", "policy.num_workers=8", "policy.precision=bfloat16",
            "policy.generation.backend=vllm", "policy.generation.colocated.enabled=false",
            "policy.generation.colocated.num_workers=8", "policy.generation.vllm_cfg.gpu_memory_utilization=0.8",
            "policy.train_micro_batch_size=1", "policy.logprob_batch_size=1", "policy.activation_checkpointing=true",
            "policy.max_total_sequence_length=131072", "policy.generation.max_new_tokens=128"]
    cfg = grpo(*long)
    problem = mp.fit_problem(cfg, big, mp.memory_plan(cfg, big, device_bytes=80 * GiB))
    # One 131072-token row needs 107 GiB: only splitting every layer 8 ways fits (checkpointing is on).
    # 0.73 GiB of it is the fused head's float32 weight gradient and its bfloat16 cast (6 x 32000 x 4096 bytes).
    assert problem.startswith("memory plan: training needs 107.42 GiB per GPU")
    assert problem.endswith("it would fit with any one of: policy.tensor_parallel_size=8")
    tp2 = grpo(*long, "policy.tensor_parallel_size=2")
    problem = mp.fit_problem(tp2, big, mp.memory_plan(tp2, big, device_bytes=80 * GiB))
    assert "policy.sequence_parallel=true" in problem  # then the norms' activations split too


def test_unknown_gpu_memory_is_printed_not_checked():
    cfg = grpo("cluster.gpus_per_node=8", "policy.num_workers=8")
    plan = mp.memory_plan(cfg, SHAPE, device_bytes=None)
    assert mp.fits(plan) and "unknown (set cluster.gpu_memory_gb)" in mp.format_plan(plan)


def test_vllm_gpu_share_defaults_by_placement():
    assert grpo().policy.generation.vllm_cfg.gpu_memory_utilization == 0.5
    split = grpo("policy.generation.colocated.enabled=false")
    assert split.policy.generation.vllm_cfg.gpu_memory_utilization == 0.9
    chosen = grpo("policy.generation.colocated.enabled=false", "policy.generation.vllm_cfg.gpu_memory_utilization=0.7")
    assert chosen.policy.generation.vllm_cfg.gpu_memory_utilization == 0.7


def test_cli_prints_the_plan_per_phase(capsys):
    assert cli.main(["plan", "sft_warmup=null"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Memory plan of posttrain grpo (tiny, 1 policy worker(s)):"
    # 16 prompts x 8 answers are one optimizer step of 128 rows and there is no KL penalty: the
    # loss takes the training forward's own logprobs, so the step has no logprobs phase.
    assert out[2].split() == ["generation", "refit", "training", "validation"]
    items = [line[:38].strip() for line in out[3:]]
    assert {"policy parameters (fp32)", "gradients (fp32)", "optimizer state (adamw)", "activations",
            "KV cache", "prefill KV cache (distinct prompts)", "total"} <= set(items)
    assert "logprob forward" not in items
    (peak,) = [line for line in out if line.startswith("peak on the node (all processes): ")]
    assert peak.endswith("fits (keeping 10% free)")
    assert "GiB (training);" in peak  # the phase that sets the peak
    assert out[out.index(peak) + 1].startswith("Time plan per step on 1 x CPU (measured)")  # docs/plan-time.md


def test_cli_refuses_a_plan_that_cannot_fit_naming_keys(capsys):
    assert cli.main(["plan", "cluster.host_memory_gb=0.5"]) == cli.EXIT_CONFIG_ERROR
    captured = capsys.readouterr()
    assert "does not fit" in captured.out
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("posttrain plan: memory plan: training needs ")
    assert "0.45 GiB is usable (90% of 0.50 GiB)" in line and "policy.train_micro_batch_size=64" in line


def test_cli_reads_the_algorithm_from_the_config(tmp_path, capsys):
    config = tmp_path / "sft.yaml"
    config.write_text("sft:\n  max_num_steps: 3\npolicy:\n  model_name: tiny\n")
    assert cli.main(["plan", "--config", str(config)]) == 0
    assert capsys.readouterr().out.startswith("Memory plan of posttrain sft (tiny")


def test_preflight_refuses_a_job_that_cannot_fit():
    from posttrain.preflight import check_memory_plan

    with pytest.raises(UserError, match=r"training needs .* policy\.train_micro_batch_size=64"):
        check_memory_plan(grpo("cluster.host_memory_gb=0.5"))
    check_memory_plan(grpo())  # the default fits


def test_config_algorithm_reads_the_section_names():
    assert cli.config_algorithm("examples/configs/distill_tiny.yaml") == "distill"
    assert cli.config_algorithm("examples/configs/dpo_tiny.yaml") == "dpo"
    assert cli.config_algorithm(None) == "grpo"


def test_rl_rows_are_planned_as_long_as_the_longest_prompt_plus_max_new_tokens():
    """A single-turn RL row is a prompt and one response: the default job's longest prompt (9
    tokens, chat template included) plus 16 new tokens, not `max_total_sequence_length` (64)."""
    cfg = grpo()
    assert mp.longest_prompt_tokens(cfg) == 9
    assert mp.longest_row_tokens(cfg, 9) == 25
    assert mp.longest_row_tokens(cfg, None) == 64  # data unreadable: the limit
    assert mp.longest_row_tokens(grpo("policy.generation.max_new_tokens=60"), 9) == 64  # the limit is shorter
    assert mp.longest_row_tokens(grpo("grpo.max_rollout_turns=3"), 9) == 64  # turns add up to the limit
    shape = mp.model_shape(cfg.policy)
    assert mp.micro_batch_tokens(cfg.policy, True, 25) == 128 * 25
    bounded, unbounded = mp.memory_plan(cfg, shape, longest_prompt=9), mp.memory_plan(cfg, shape)
    assert bounded.row_tokens == 25 and unbounded.row_tokens == 64
    for planned, tokens in ((bounded, 128 * 25), (unbounded, 128 * 64)):
        expected = mp.training_activation_bytes(shape, tokens, 4, checkpointing=False, fused_logprobs=True)
        assert planned.devices[0].rows["activations"]["training"] == int(expected)


def test_preflight_reads_the_training_data_once(monkeypatch):
    """The plan's longest prompt comes from the records preflight has read (the recipe's 10,000
    generated rows took 1.4 s to build, twice before)."""
    from posttrain import preflight
    from posttrain.data import datasets

    reads, load = [], datasets.load_records

    def counting(data_cfg, split, *args, **kwargs):
        reads.append(split)
        return load(data_cfg, split, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_records", counting)
    cfg = grpo("sft_warmup=null")
    preflight.preflight(cfg)
    assert reads == ["train", "validation"]
    assert mp.longest_prompt_tokens(cfg, datasets.load_records(cfg.data, "train")) == 9


def test_validation_decodes_val_batch_size_rows_and_can_set_the_peak():
    """Validation decodes `grpo.val_batch_size` prompts per call (at most
    `policy.generation.batch_size` rows at once), each its own prompt, where a step decodes its
    num_prompts_per_step x num_generations_per_prompt rows sharing a prompt per group: a larger
    validation batch is a larger KV cache and prefill, planned as a phase of its own, which here
    sets the peak (the nemotron_mini recipe validates 140 prompts against steps of 32 rows)."""
    common = ["sft_warmup=null", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4",
              "policy.train_global_batch_size=8", "policy.train_micro_batch_size=1", "policy.logprob_batch_size=1",
              "policy.max_total_sequence_length=512", "policy.generation.max_new_tokens=256"]
    cfg = grpo(*common, "grpo.val_batch_size=64")
    plan = mp.memory_plan(cfg, SHAPE, device_bytes=16 * GiB, longest_prompt=100)
    (device,) = plan.devices
    rows = device.rows
    assert plan.phases == ("generation", "refit", "training", "validation")
    assert plan.row_tokens == 356  # the longest prompt + max_new_tokens
    assert rows["KV cache"] == {"generation": int(mp.kv_cache_bytes(SHAPE, 8, 356, 4)),
                                "validation": int(mp.kv_cache_bytes(SHAPE, 64, 356, 4))}
    # Prefill: 2 distinct prompts of a step's 8 rows, 64 of validation's, of 100 tokens each.
    assert rows["prefill KV cache (distinct prompts)"] == {
        "generation": int(mp.kv_cache_bytes(SHAPE, 2, 100, 4)), "validation": int(mp.kv_cache_bytes(SHAPE, 64, 100, 4))}
    # Validation holds what generation holds of the training state (nothing offloaded on CPU).
    for item in ("runtime (python, torch)", "policy parameters (fp32)", "optimizer state (adamw)"):
        assert rows[item]["validation"] == rows[item]["generation"]
    assert device.phase_total("validation") > device.phase_total("generation")
    assert device.peak()[0] == plan.peak_phase() == "validation"
    assert plan.run_peak() == ("grpo", "validation", device.phase_total("validation"))
    assert "GiB (validation);" in mp.format_plan(plan).splitlines()[-1]
    # A validation batch larger than generation.batch_size decodes that many rows at once, the others
    # admitted as rows finish (continuous batching), in a cache max_new_tokens columns longer per row.
    continuous = mp.memory_plan(grpo(*common, "grpo.val_batch_size=500", "policy.generation.batch_size=64"), SHAPE,
                                device_bytes=16 * GiB, longest_prompt=100)
    assert continuous.devices[0].rows["KV cache"]["validation"] == int(mp.kv_cache_bytes(SHAPE, 64, 356 + 256, 4))
    # Without validation in the schedule there is no such phase.
    never = grpo(*common, "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false")
    assert mp.memory_plan(never, SHAPE, longest_prompt=100).phases == ("generation", "refit", "training")
    # Two optimizer steps per batch need the previous logprobs: a logprobs phase.
    two = grpo(*common, "policy.train_global_batch_size=4")
    assert mp.memory_plan(two, SHAPE, longest_prompt=100).phases == (
        "generation", "refit", "logprobs", "training", "validation")


def test_a_validation_too_large_for_the_device_is_told_a_smaller_val_batch_size():
    cfg = grpo("sft_warmup=null", "policy.train_micro_batch_size=1", "policy.logprob_batch_size=1",
               "policy.max_total_sequence_length=4096", "policy.generation.max_new_tokens=2048",
               "grpo.num_prompts_per_step=1", "grpo.num_generations_per_prompt=2", "policy.train_global_batch_size=2",
               "grpo.val_batch_size=128", "cluster.host_memory_gb=1.0")
    shape = mp.ModelShape(**{**SHAPE.__dict__, "num_layers": 16})
    plan = mp.memory_plan(cfg, shape, device_bytes=GiB, longest_prompt=2048)
    problem = mp.fit_problem(cfg, shape, plan)
    assert problem.startswith("memory plan: validation needs ")
    assert "grpo.val_batch_size=" in problem and "policy.generation.batch_size=" in problem


def test_offline_jobs_validate_with_a_forward_and_eval_decodes_without_a_policy():
    sft = load_config("sft", None, [])
    plan = mp.memory_plan(sft, SHAPE, device_bytes=16 * GiB)
    assert plan.job == "sft" and plan.phases == ("training", "validation")
    rows = plan.devices[0].rows
    assert rows["logprob forward"] == {"validation": rows["logprob forward"]["validation"]} and "KV cache" not in rows
    assert rows["optimizer state (adamw)"]["validation"] == 8 * SHAPE.num_params  # the state stays resident
    dpo = mp.memory_plan(load_config("dpo", "examples/configs/dpo_tiny.yaml", []), SHAPE, device_bytes=16 * GiB)
    assert dpo.phases == ("logprobs", "training", "validation")
    assert dpo.devices[0].rows["reference model (fp32, host)"]["logprobs"] == 4 * SHAPE.num_params

    ev = load_config("eval", None, ["eval.batch_size=32", "policy.generation.batch_size=16"])
    plan = mp.memory_plan(ev, SHAPE, device_bytes=16 * GiB, longest_prompt=9)
    (engine,) = plan.devices
    assert plan.job == "eval" and plan.phases == ("evaluation",) and engine.name == "generation worker"
    assert set(engine.rows) == {"runtime (python, torch)", "generation weights", "KV cache",
                                "prefill KV cache (distinct prompts)", "prefill forward"}
    assert engine.rows["generation weights"]["evaluation"] == 4 * SHAPE.num_params  # no optimizer, no gradients
    assert engine.rows["KV cache"]["evaluation"] == int(  # 32 prompts, 16 at once: continuous batching's longer rows
        mp.kv_cache_bytes(SHAPE, 16, plan.row_tokens + ev.policy.generation.max_new_tokens, 4))


def test_an_sft_warm_start_is_a_job_of_its_own_unless_its_export_is_cached(tmp_path, monkeypatch):
    from posttrain.run_config import warm_start_export_dir

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    cfg = grpo()
    plan = mp.run_plan(cfg, SHAPE, device_bytes=16 * GiB, longest_prompt=9, warm_shapes={"sft_warmup": SHAPE})
    (warm,) = plan.warm_starts
    assert warm.key == "sft_warmup" and warm.plan.job == "sft_warmup" and warm.plan.phases == ("training", "validation")
    assert [job for job, _, _ in plan.phase_peaks()] == ["sft_warmup"] * 2 + ["grpo"] * 4
    assert plan.run_peak()[2] == max(plan.node_peak(), warm.plan.node_peak())
    text = mp.format_plan(plan)
    assert text.startswith("sft_warmup (SFT warm start, runs first as a job of its own):") and "\ngrpo:\n" in text
    # A warm start that cannot fit is named, with its keys, while the GRPO job itself fits.
    big = grpo("sft_warmup.policy.train_micro_batch_size=256", "sft_warmup.policy.max_total_sequence_length=1024")
    small = mp.run_plan(big, SHAPE, device_bytes=GiB, longest_prompt=9, warm_shapes={"sft_warmup": SHAPE})
    assert small.node_peak() < 0.9 * GiB < small.warm_starts[0].plan.node_peak()
    assert mp.fit_problem(big, SHAPE, small) == (
        "memory plan: sft_warmup (SFT warm start), training needs 9.18 GiB on this node but 0.90 GiB is usable "
        "(90% of 1.00 GiB); it would fit with any one of: sft_warmup.policy.train_micro_batch_size=8")
    export = warm_start_export_dir(cfg.sft_warmup)
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    cached = mp.run_plan(cfg, SHAPE, device_bytes=16 * GiB, longest_prompt=9)
    assert cached.warm_starts[0].plan is None and cached.run_peak()[0] == "grpo"
    assert mp.format_plan(cached).startswith(f"sft_warmup (SFT warm start): cached in {export}, will not run")


def test_validations_phases_are_logged_as_one_peak_of_their_own():
    """What the plan's validation phase is measured against (`benchmarks/memory_plan.py`): the
    highest of validation's phases (its generation, a refit before it) per stat, apart from a step's."""
    from posttrain.utils.phase_memory import as_one_phase

    peaks = {"memory/generation/peak_rss_gb": 2.0, "memory/refit/peak_rss_gb": 2.5, "memory/offload/moved_gb": 0.3,
             "memory/generation/allocated_gb": 1.0, "memory/refit/allocated_gb": 0.5}
    assert as_one_phase(peaks, "validation") == {"memory/validation/peak_rss_gb": 2.5,
                                                 "memory/validation/allocated_gb": 1.0}
    assert as_one_phase({}, "validation") == {}


def test_lora_on_a_vision_language_model_counts_its_language_models_adapters_and_the_projector(tmp_path, monkeypatch):
    """tiny-vl with LoRA (models/lora.py): the adapters on the language model's q/k/v/o only (CLIP's
    q/k/v_proj get none) and the projector, trained in full; the tower too with freeze_vision_tower=false.
    The plan reads the preset's config from its sizes: nothing is built (an empty cache stays empty)."""
    from posttrain.config.schema import PolicyConfig

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    shape = mp.model_shape(PolicyConfig(model_name="tiny-vl", lora=dict(enabled=True)))
    assert not (tmp_path / "cache").exists()
    projector = (64 * 128 + 128) + (128 * 128 + 128)  # CLIP width 64 -> 128 -> 128, with biases
    assert shape.lora_params == 2 * 8 * ((128 + 128) * 2 + (128 + 64) * 2) + projector
    tower = mp.model_shape(PolicyConfig(model_name="tiny-vl", lora=dict(enabled=True), freeze_vision_tower=False))
    assert tower.lora_params - shape.lora_params == 116736  # the CLIP tower's parameters


def test_lora_targets_that_match_no_module_are_one_line_at_preflight():
    """The preflight's memory plan resolves `policy.lora.target_modules` on the meta model, as the
    workers will: a list that matches nothing stops the run there, before any worker starts."""
    from posttrain.config.loader import load_config
    from posttrain.preflight import check_memory_plan

    cfg = load_config("grpo", overrides=["sft_warmup=null", "policy.lora.enabled=true", "policy.lora.target_modules=[foo]"])
    with pytest.raises(UserError, match=r"^policy.lora.target_modules=\['foo'\] match no module of LlamaForCausalLM$"):
        check_memory_plan(cfg, records=[])
