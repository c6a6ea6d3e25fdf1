"""LoRA policy training on real Ray workers: adapters train, base weights stay, and everything that
leaves the trainer (refit, HF export, convert) is the merged model."""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithms.loss import NLLLoss
from posttrain.config.schema import PolicyConfig
from posttrain.distributed.batch import Batch
from posttrain.distributed.cluster import VirtualCluster
from posttrain.models.generation.native import NativeGeneration
from posttrain.models.generation.spec import GenerationSpec
from posttrain.models.hf import load_causal_lm
from posttrain.models.policy.checkpoint import convert_to_hf
from posttrain.models.policy.policy import Policy
from posttrain.models.refit import build_refit_metadata, refit_policy_generation

# The timeout is a hang guard, not a speed test: beside two CPU hogs this module ran 4-6x its quiet time.
pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]

TARGETS = ("q_proj", "v_proj")


def lora_cfg(**overrides) -> PolicyConfig:
    base = dict(
        model_name="tiny", optimizer=dict(name="adamw", lr=1e-2, weight_decay=0.0), max_grad_norm=None,
        train_global_batch_size=8, train_micro_batch_size=2, logprob_batch_size=4,
        lora=dict(enabled=True, dim=4, alpha=8, target_modules=list(TARGETS)),
    )
    base.update(overrides)
    return PolicyConfig.model_validate(base)


def make_batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([12, 5, 9, 7, 12, 3, 11, 10])
    ids = torch.randint(7, 100, (8, 12), generator=g)
    valid = torch.arange(12)[None] < lengths[:, None]
    ids[~valid] = 0
    return Batch(input_ids=ids, input_lengths=lengths, token_mask=valid.float(), sample_mask=torch.ones(8))


def hf_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    valid = torch.arange(ids.shape[1])[None] < lengths[:, None]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=valid.long()).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logprobs, (1, 0)) * valid


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    cluster = VirtualCluster([2], max_colocated_worker_groups=4)
    yield cluster
    cluster.shutdown()


def test_lora_trains_adapters_only_and_exports_the_merged_model(cluster, tmp_path):
    from transformers import AutoModelForCausalLM

    batch = make_batch()
    one = Policy(cluster, lora_cfg(), init_reference_model=True, name="lora-1")
    two = Policy(cluster, lora_cfg(num_workers=2), init_reference_model=False, name="lora-2")
    try:
        before = one.state_dict_for_export()
        assert all(".lora_" not in name and "base_model" not in name for name in before)  # the base model's names
        for policy in (one, two):
            for _ in range(2):
                policy.train(batch, NLLLoss())
        after = one.state_dict_for_export()
        changed = sorted(name for name in before if not torch.equal(before[name], after[name]))
        # Only the wrapped projections moved (through their adapters); everything else is frozen.
        assert changed and all(name.endswith(tuple(f"{t}.weight" for t in TARGETS)) for name in changed)
        assert len(changed) == 2 * len(TARGETS)  # 2 layers

        # FSDP2 over two workers (frozen and trainable parameters in the same units) = one worker.
        after_two = two.state_dict_for_export()
        for name, value in after.items():
            torch.testing.assert_close(after_two[name], value, atol=1e-6, rtol=0, msg=name)

        # The reference is the base model (adapters start at B = 0), unchanged by training.
        reference = one.get_reference_logprobs(batch)["logprobs"]
        torch.testing.assert_close(reference, hf_logprobs(load_causal_lm("tiny"), batch), atol=1e-5, rtol=0)
        # The merged export reloads in plain transformers with the trainer's logprobs.
        exported = AutoModelForCausalLM.from_pretrained(one.export_hf(str(tmp_path / "hf")))
        torch.testing.assert_close(hf_logprobs(exported, batch), one.get_logprobs(batch)["logprobs"], atol=1e-5, rtol=0)
        assert not torch.allclose(reference, one.get_logprobs(batch)["logprobs"], atol=1e-3)

        # A LoRA checkpoint converts to the same merged model.
        one.save_checkpoint(str(tmp_path / "ckpt"))
        converted = AutoModelForCausalLM.from_pretrained(convert_to_hf(tmp_path / "ckpt", tmp_path / "converted"))
        for name, value in exported.state_dict().items():
            assert torch.equal(converted.state_dict()[name], value), name
        assert [name for name, _, _ in one.refit_info()] == list(after)

        # Refit sends the merged weights to a plain (non-LoRA) generation engine.
        generation = NativeGeneration(cluster, GenerationSpec("tiny", {"max_new_tokens": 4}), name="lora-gen")
        try:
            metadata = build_refit_metadata(one.refit_info(), dtypes=generation.weight_dtypes())
            generation.prepare_refit_info(metadata)
            refit_policy_generation(one, generation, metadata, version=1, verify=True)
            assert set(generation.get_weights_checksums()) == {one.weights_checksum()}  # both workers
        finally:
            generation.shutdown()
    finally:
        one.shutdown()
        two.shutdown()
