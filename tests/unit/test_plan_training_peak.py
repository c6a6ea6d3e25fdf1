"""The memory plan's training-phase terms beyond parameters, gradients, optimizer state and
activations, each measured on Gemma 3 270M's recipe (docs/recipes/gemma3-base.md): the fused
head's weight gradient, autocast's weight copies, a bfloat16 engine's own weights beside float32
masters, and an unfused optimizer step's temporaries; and `fused_optimizer_kwargs`, which makes
the one-worker AdamW step fused."""

from __future__ import annotations

import pytest
import torch

from posttrain import plan as mp
from posttrain.config import load_config
from posttrain.plan.formulas import (
    autocast_copy_bytes, fused_head_weight_bytes, fused_optimizer, optimizer_step_bytes,
)

GiB = mp.GiB
# 100 x 64 head (W = 6,400 elements), largest tensor 100,000 elements, tied embeddings of 6,400.
SHAPE = mp.ModelShape(num_params=1_000_000, hidden_size=64, num_layers=4, vocab_size=100, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=256, largest_tensor=100_000,
                      embedding_params=6_400)
# Gemma 3 270M as `posttrain plan` reads it (model_shape of the converted preset).
GEMMA = mp.ModelShape(num_params=268_098_176, hidden_size=640, num_layers=18, vocab_size=262_144, num_heads=4,
                      num_kv_heads=1, head_dim=256, intermediate_size=2048, largest_tensor=167_772_160,
                      embedding_params=167_772_160, tokenizer_file_bytes=33_371_397)


def grpo(*overrides, config=None):
    return load_config("grpo", config, list(overrides))


def test_fused_head_weight_gradient_by_hand():
    # bfloat16 on one worker: the weight's copy (2 W), the float32 accumulator (4 W) and its cast (2 W).
    assert fused_head_weight_bytes(SHAPE, 2) == 8 * 6_400
    assert fused_head_weight_bytes(SHAPE, 4) == 4 * 6_400  # float32: the accumulator only
    assert fused_head_weight_bytes(SHAPE, 2, gathered_in_compute_dtype=True) == 6 * 6_400  # FSDP2 gathered it in bf16
    assert fused_head_weight_bytes(SHAPE, 2, trains_head=False) == 2 * 6_400  # LoRA: a frozen head's copy only
    assert fused_head_weight_bytes(SHAPE, 4, trains_head=False) == 0
    assert fused_head_weight_bytes(GEMMA, 2) == 1.25 * GiB


def test_autocast_copies_and_unfused_optimizer_temporaries_by_hand():
    assert autocast_copy_bytes(SHAPE, 2, fused_head=True) == 2 * (1_000_000 - 6_400)
    assert autocast_copy_bytes(SHAPE, 2, fused_head=False) == 2 * 1_000_000  # the head's copy too
    # Two float32 copies of the largest tensor this rank holds.
    assert optimizer_step_bytes(SHAPE, "adamw", shards=1, tp=1, trainable_per_rank=1e6, lora=False) == 800_000
    assert optimizer_step_bytes(SHAPE, "adamw", shards=4, tp=1, trainable_per_rank=2.5e5, lora=False) == 200_000
    assert optimizer_step_bytes(SHAPE, "adam", shards=4, tp=2, trainable_per_rank=2.5e5, lora=False) == 400_000
    assert optimizer_step_bytes(SHAPE, "adamw", shards=2, tp=1, trainable_per_rank=1_000, lora=True) == 8_000
    assert optimizer_step_bytes(SHAPE, "sgd", shards=1, tp=1, trainable_per_rank=1e6, lora=False) == 0
    assert fused_optimizer(grpo("policy.num_workers=1")) and not fused_optimizer(grpo("policy.num_workers=2"))
    assert not fused_optimizer(grpo("policy.optimizer.name=sgd"))


def rows(*overrides, shape=SHAPE):
    return mp.memory_plan(grpo(*overrides), shape, device_bytes=16 * GiB).devices[0].rows


def test_one_cpu_worker_in_bfloat16_plans_the_head_the_copies_and_the_engines_own_weights():
    r = rows("policy.precision=bfloat16", "policy.fused_logprobs=true")
    assert r["LM head: fused logprobs' weight gradient"] == {"training": 8 * 6_400}
    assert r["autocast weight copies"] == {"training": 2 * (1_000_000 - 6_400)}
    # The bfloat16 engine cannot hold the float32 masters: its own copy, resident in every phase on
    # CPU, which refit fills in place (no bucket).
    assert r["generation weights"] == {p: 2 * 1_000_000 for p in ("generation", "refit", "training", "validation")}
    assert "refit bucket (send)" not in r and "optimizer step temporaries (unfused)" not in r


def test_float32_lends_its_weights_and_fsdp_plans_the_unfused_step():
    r = rows("policy.precision=float32", "policy.fused_logprobs=true")
    assert r["LM head: fused logprobs' weight gradient"] == {"training": 4 * 6_400}
    assert "autocast weight copies" not in r and "generation weights" not in r
    two = rows("policy.precision=bfloat16", "policy.fused_logprobs=true", "policy.num_workers=2",
               "cluster.gpus_per_node=0")
    assert two["optimizer step temporaries (unfused)"] == {"training": 8 * 100_000 / 2}
    assert two["LM head: fused logprobs' weight gradient"] == {"training": 6 * 6_400}
    assert "autocast weight copies" not in two


@pytest.mark.parametrize("precision, planned_gib, measured_gib", [
    # The highest `memory/training/peak_rss_gb` of short runs of the recipe with the fused AdamW
    # step (2026-11-29): bfloat16 6.42, 8.38, 9.30, 9.39 GiB at steps 1-4; float32 6.71, 7.92, 7.94 at steps 1-3.
    ("bfloat16", 7.890, 9.39),
    ("float32", 7.155, 7.94),
])
def test_the_gemma_recipe_plan_against_its_measured_peak(precision, planned_gib, measured_gib):
    """The recipe's training-phase plan (rows of 46 + 16 tokens), pinned: docs/recipes/gemma3-base.md
    and docs/scaling.md quote it beside the peak resident set measured (the issue asks for 25%)."""
    cfg = grpo(f"policy.precision={precision}", config="examples/recipes/gemma3_base.yaml")
    plan = mp.memory_plan(cfg, GEMMA, device_bytes=24 * GiB, longest_prompt=46)
    phase, peak = plan.devices[0].peak()
    assert phase == "training" and round(peak / GiB, 3) == planned_gib
    assert abs(planned_gib / measured_gib - 1) <= 0.25


def test_one_plain_worker_gets_the_fused_adamw_step():
    from posttrain.models.policy.worker import fused_optimizer_kwargs

    params = [torch.nn.Parameter(torch.ones(3))]
    assert fused_optimizer_kwargs("adamw", params) == {"fused": True}
    assert fused_optimizer_kwargs("adam", params) == {"fused": True}
    assert fused_optimizer_kwargs("sgd", params) == {}
    assert fused_optimizer_kwargs("adamw", []) == {}
    # The fused kernel takes the same step as torch's default single-tensor loop.
    steps = []
    for kwargs in ({}, fused_optimizer_kwargs("adamw", params)):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 64))
        opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.01, **kwargs)
        for _ in range(3):
            p.grad = torch.cos(p.detach() * 3)
            opt.step()
        steps.append(p.detach().clone())
    torch.testing.assert_close(steps[0], steps[1], rtol=1e-6, atol=1e-7)


def test_each_process_plans_its_loaded_tokenizers_on_cpu():
    from dataclasses import replace

    with_tokenizer = replace(SHAPE, tokenizer_file_bytes=1_000)
    assert mp.formulas.tokenizer_bytes(with_tokenizer) == 9_000
    # The local backend: controller, policy worker and engine in one process.
    local = rows("cluster.backend=local", shape=with_tokenizer)
    assert local["tokenizers (3 loaded)"]["training"] == 27_000
    ray = rows("cluster.backend=ray", shape=with_tokenizer)
    assert ray["tokenizers (2 loaded)"]["generation"] == 18_000  # policy worker + colocated engine
    assert not any(k.startswith("tokenizers") for k in rows("cluster.backend=local"))  # size unknown: none
    gpu = mp.memory_plan(grpo("cluster.gpus_per_node=1"), with_tokenizer, device_bytes=80 * GiB).devices[0].rows
    assert not any(k.startswith("tokenizers") for k in gpu)  # host memory is not planned on GPUs
