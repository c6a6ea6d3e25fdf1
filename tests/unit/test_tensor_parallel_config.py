"""Tensor parallelism and FSDP2 options: the config refuses what cannot split (one line naming
the keys and numbers), the plan applied to each model, and the FSDP2 policies chosen from
`policy.precision` / `policy.fsdp_cpu_offload`. The training itself is proven with real workers
in `tests/functional/test_tensor_parallel.py`."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from posttrain.config import ConfigError, load_config
from posttrain.config.schema import PolicyConfig
from posttrain.errors import UserError
from posttrain.models.policy import parallel
from posttrain.models.tiny import make_tiny_model
from posttrain.preflight import check_tensor_parallel

from test_new_user_errors import one_line_error, posttrain


def test_num_workers_must_be_a_multiple_of_tensor_parallel_size():
    with pytest.raises(ConfigError, match=r"policy.num_workers=3 must be a multiple of policy.tensor_parallel_size=2"):
        load_config("grpo", overrides=["policy.num_workers=3", "policy.tensor_parallel_size=2"])
    cfg = PolicyConfig(num_workers=4, tensor_parallel_size=2, train_global_batch_size=2)
    assert cfg.dp_size == 2  # the global batch needs to divide by the dp ranks only, not by all workers


def test_global_batch_divides_by_data_parallel_ranks_only():
    with pytest.raises(ValueError, match=r"train_global_batch_size=3 must be a multiple of the 2 data-parallel ranks"):
        PolicyConfig(num_workers=4, tensor_parallel_size=2, train_global_batch_size=3)


def test_fp16_and_lonely_options_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"policy.precision=float16 is refused: .* gradient scaler"):
        PolicyConfig(precision="float16")
    with pytest.raises(ValueError, match=r"policy.sequence_parallel needs policy.tensor_parallel_size > 1"):
        PolicyConfig(sequence_parallel=True)
    with pytest.raises(ValueError, match=r"policy.fsdp_cpu_offload needs policy.num_workers > 1"):
        PolicyConfig(fsdp_cpu_offload=True)
    with pytest.raises(ValueError, match=r"policy.lora.enabled with policy.tensor_parallel_size > 1 is not supported"):
        PolicyConfig(num_workers=2, tensor_parallel_size=2, lora=dict(enabled=True))


def test_preset_whose_heads_tp_cannot_split_is_refused_naming_the_numbers():
    # tiny: 4 heads, 2 key/value heads, MLP width 512.
    check_tensor_parallel(PolicyConfig(num_workers=2, tensor_parallel_size=2, train_global_batch_size=8), "policy.model_name")
    with pytest.raises(UserError) as info:
        check_tensor_parallel(PolicyConfig(num_workers=4, tensor_parallel_size=4), "policy.model_name")
    assert str(info.value) == (
        "policy.tensor_parallel_size=4 does not divide the model's num_key_value_heads=2 (policy.model_name='tiny'); "
        "pick a tensor_parallel_size that divides them"
    )


def test_local_model_directory_is_checked_from_its_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": 6, "intermediate_size": 1536}
    ))
    with pytest.raises(UserError, match=r"does not divide the model's num_attention_heads=6, num_key_value_heads=6"):
        check_tensor_parallel(PolicyConfig(model_name=str(tmp_path), num_workers=4, tensor_parallel_size=4),
                              "policy.model_name")


def test_converted_pretrained_preset_is_checked_from_its_cached_config(tmp_path, monkeypatch):
    """A pretrained preset (Gemma 3 270M: 4 query heads, 1 key/value head) is read from its
    conversion in the cache, which preflight makes first: refused before any worker starts."""
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    entry = tmp_path / "models" / "gemma3-270m"
    entry.mkdir(parents=True)
    (entry / "config.json").write_text(json.dumps(
        {"model_type": "gemma3_text", "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 2048}))
    with pytest.raises(UserError) as info:
        check_tensor_parallel(PolicyConfig(model_name="gemma3-270m", num_workers=2, tensor_parallel_size=2),
                              "policy.model_name")
    assert str(info.value) == (
        "policy.tensor_parallel_size=2 does not divide the model's num_key_value_heads=1 "
        "(policy.model_name='gemma3-270m'); pick a tensor_parallel_size that divides them")


def test_cli_refuses_a_tensor_parallel_size_the_model_cannot_split(tmp_path):
    result = posttrain("sft", "policy.num_workers=4", "policy.tensor_parallel_size=4", cwd=tmp_path)
    one_line_error(result, "policy.tensor_parallel_size=4 does not divide the model's num_key_value_heads=2")


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "mixtral", "gemma3"])
def test_plan_from_the_models_tp_plan_keeps_experts_replicated(arch):
    model, _ = make_tiny_model("tiny", arch)
    plan = parallel.tp_plan(model)
    assert {k: type(v) for k, v in plan.items() if "self_attn" in k and "norm" not in k} == {
        "model.layers.*.self_attn.q_proj": ColwiseParallel, "model.layers.*.self_attn.k_proj": ColwiseParallel,
        "model.layers.*.self_attn.v_proj": ColwiseParallel, "model.layers.*.self_attn.o_proj": RowwiseParallel,
    }
    assert not [k for k in plan if "experts" in k or "embed" in k or "lm_head" in k]
    if arch == "llama":
        assert type(plan["model.layers.*.mlp.down_proj"]) is RowwiseParallel
    if arch in ("qwen3_moe", "gemma3"):  # per-head q/k norms: replicated weight, gradient summed over the TP group
        assert type(plan["model.layers.*.self_attn.q_norm"]) is SequenceParallel
        assert type(plan["model.layers.*.self_attn.k_norm"]) is SequenceParallel


def test_a_vision_language_models_plan_splits_its_language_model_only():
    """tiny-vl: the text preset's plan under `model.language_model`; the CLIP tower (whose attention
    has q/k/v_proj of the same names) and the projector stay out of it (replicated); preflight checks
    the language model's sizes."""
    from posttrain.models.vision import make_tiny_vlm

    model, _ = make_tiny_vlm()
    text_plan = parallel.tp_plan(make_tiny_model("tiny", "llama")[0])
    plan = parallel.tp_plan(model)
    assert {k: type(v) for k, v in plan.items()} == {
        k.replace("model.", "model.language_model.", 1): type(v) for k, v in text_plan.items()}
    assert parallel.tensor_parallel_size_problem(model.config, 2) is None
    vl = dict(model_name="tiny-vl", train_global_batch_size=8)
    check_tensor_parallel(PolicyConfig(num_workers=2, tensor_parallel_size=2, **vl), "policy.model_name")
    with pytest.raises(UserError, match=r"tensor_parallel_size=4 does not divide the model's num_key_value_heads=2 "
                                        r"\(policy.model_name='tiny-vl'\)"):
        check_tensor_parallel(PolicyConfig(num_workers=4, tensor_parallel_size=4, **vl), "policy.model_name")


def test_model_without_a_plan_falls_back_to_posttrains_or_is_refused(monkeypatch):
    model, _ = make_tiny_model("tiny", "llama")
    monkeypatch.setattr(type(model.config), "base_model_tp_plan", None)  # a config class with no plan of its own
    monkeypatch.setattr(model.config, "base_model_tp_plan", None, raising=False)
    assert set(parallel.tp_plan(model)) == {f"model.{k}" for k in parallel.LLAMA_LIKE_PLAN}
    model.config.model_type = "gpt_bigcode"
    with pytest.raises(ValueError, match=r"model_type 'gpt_bigcode' has no base_model_tp_plan"):
        parallel.tp_plan(model)


def test_bfloat16_gathers_bf16_parameters_and_reduces_in_fp32():
    policy = parallel.mixed_precision_policy(torch.bfloat16)
    assert policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert parallel.mixed_precision_policy(torch.float32) is None


def test_sequence_parallel_plan_splits_norms_and_gathers_before_the_head():
    model, _ = make_tiny_model("tiny", "llama")
    plan = parallel.tp_plan(model, sequence_parallel=True)
    assert type(plan["model.layers.*.input_layernorm"]) is SequenceParallel
    assert type(plan["model.layers.*.post_attention_layernorm"]) is SequenceParallel
    assert {"model.layers.0", "model.norm"} <= set(plan)  # slice the sequence in, gather it out
    moe_model, _ = make_tiny_model("tiny", "mixtral")
    with pytest.raises(ValueError, match=r"policy.sequence_parallel: mixture-of-experts models are not supported"):
        parallel.tp_plan(moe_model, sequence_parallel=True)


def test_padding_for_sequence_parallel_keeps_every_value_in_place():
    from posttrain.distributed.batch import Batch
    from posttrain.models.policy.forward import MicroBatch

    rows = Batch(input_ids=torch.arange(1, 8)[None], input_lengths=torch.tensor([7]), token_mask=torch.ones(1, 7))
    packed = dict(input_ids=torch.arange(1, 8)[None], position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]]),
                  cu_seqlens=torch.tensor([0, 3, 7]))
    padded = parallel.pad_for_sequence_parallel(MicroBatch(rows, torch.tensor([0]), packed), 4)
    assert padded.rows["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]]
    assert padded.rows["token_mask"].tolist() == [[1.0] * 7 + [0.0]]
    assert padded.rows["input_lengths"].tolist() == [7]
    assert padded.packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]  # the pad starts its own sequence
    assert padded.packed["cu_seqlens"].tolist() == [0, 3, 7]
