"""`policy.rope_scaling` (YaRN and the other transformers RoPE types): merged into the model config
wherever a model is built (policy workers, sharded loading, reward models, generation engines)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from posttrain.config import load_config
from posttrain.config.schema import PolicyConfig
from posttrain.models.generation.spec import GenerationSpec
from posttrain.models.hf import apply_rope_scaling, load_causal_lm, resolve_model_path, rope_config_overrides
from posttrain.models.policy.model_loading import ModelLoading
from posttrain.models.policy.sharded_load import empty_causal_lm

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_a_model_loaded_with_yarn_has_it_in_its_config_and_its_rotary_embedding():
    plain = load_causal_lm("tiny")
    yarn = load_causal_lm("tiny", rope_scaling=YARN)
    theta = plain.config.rope_parameters["rope_theta"]
    assert yarn.config.rope_parameters == {**YARN, "rope_theta": theta}  # the model's own theta kept
    rotary, plain_rotary = yarn.model.rotary_emb, plain.model.rotary_emb
    assert rotary.rope_type == "yarn" and plain_rotary.rope_type == "default"
    # YaRN interpolates the low frequencies (divided by the factor), keeps the high ones.
    assert torch.allclose(rotary.inv_freq[0], plain_rotary.inv_freq[0])
    assert torch.allclose(rotary.inv_freq[-1], plain_rotary.inv_freq[-1] / 4.0, rtol=1e-3)
    assert rotary.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
    # Same weights, other positions: other logprobs.
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), yarn.parameters()))
    ids = torch.randint(3, 60, (1, 40), generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(logprobs(plain, ids), logprobs(yarn, ids), atol=1e-4)

    # Sharded loading builds the same skeleton on the other ranks, and a saved config carries it.
    assert empty_causal_lm("tiny", rope_scaling=YARN).config.rope_parameters == yarn.config.rope_parameters


def test_policy_workers_and_generation_engines_get_it_from_the_config(tmp_path):
    cfg = load_config("grpo", overrides=["sft_warmup=null", 'policy.rope_scaling={"rope_type": "yarn", "factor": 4.0, '
                                         '"original_max_position_embeddings": 64}'])
    assert cfg.policy.rope_scaling == YARN
    path = resolve_model_path("tiny")
    worker = SimpleNamespace(model_type="lm", loads_sharded=False, rank=0, ep_size=1, is_vision=False, cfg=cfg.policy)
    assert ModelLoading._load_model(worker, path).config.rope_parameters["rope_type"] == "yarn"
    reward = SimpleNamespace(model_type="reward", loads_sharded=False, rank=1, cfg=cfg.policy,
                             tokenizer=SimpleNamespace(pad_token_id=0))
    assert ModelLoading._load_model(reward, path).config.rope_parameters["rope_type"] == "yarn"
    spec = GenerationSpec.from_config(cfg)
    assert spec.rope_scaling == YARN  # the native engine loads with it; vLLM gets it as hf_overrides:
    assert rope_config_overrides(path, YARN) == {"rope_parameters": {**YARN, "rope_theta": 10000.0}}
    assert GenerationSpec.from_config(load_config("grpo", overrides=["sft_warmup=null"])).rope_scaling is None


def test_bad_rope_scaling_is_one_line_naming_the_key():
    with pytest.raises(ValueError, match="policy.rope_scaling needs a rope_type"):
        PolicyConfig(rope_scaling={"factor": 4.0})
    assert PolicyConfig(rope_scaling={"type": "linear", "factor": 2.0}).rope_scaling == {"rope_type": "linear",
                                                                                          "factor": 2.0}
    config = load_causal_lm("tiny").config
    with pytest.raises(ValueError, match=r"^policy.rope_scaling=\{'rope_type': 'yarn'\}: Missing required keys .*factor"):
        apply_rope_scaling(config, {"rope_type": "yarn"})
    assert apply_rope_scaling(config, None) is config


def test_preflight_refuses_it_before_any_worker_starts():
    from posttrain.errors import UserError
    from posttrain.preflight import check_rope_scaling

    check_rope_scaling(PolicyConfig(rope_scaling=YARN), "policy")  # fine
    with pytest.raises(UserError, match=r"^teacher.rope_scaling=\{'rope_type': 'yarn'\}: Missing required keys"):
        check_rope_scaling(PolicyConfig(model_name="small", rope_scaling={"rope_type": "yarn"}), "teacher")
