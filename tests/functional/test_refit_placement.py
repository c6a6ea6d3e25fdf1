"""Refit from real policy workers into real generation workers, colocated and split placement."""

from __future__ import annotations

import pytest
import torch

from posttrain.job import make_cluster, make_generation
from posttrain.algorithms.loss import NLLLoss
from posttrain.config.loader import load_config
from posttrain.distributed.batch import Batch
from posttrain.models.refit import build_refit_metadata, refit_policy_generation

pytestmark = pytest.mark.functional


def _cfg():
    return load_config("grpo", overrides=[
        "policy.scheduler.name=constant",  # a Policy built outside a job has no run length to decay over
        "sft_warmup=null", "policy.model_name=tiny", "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=4", "policy.optimizer.lr=1e-2", "policy.generation.max_new_tokens=8",
        "policy.generation.temperature=0.7",
    ])


@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "split"])
def test_refit_makes_generation_weights_equal_policy_weights(ray_cluster, colocated):
    from posttrain.models.policy.policy import Policy

    cfg = _cfg()
    policy_cluster = make_cluster(cfg, 1, colocated_groups=2 if colocated else 1, name=f"policy-{colocated}")
    gen_cluster = policy_cluster if colocated else make_cluster(cfg, 1, name="generation-split")
    policy = generation = None
    try:
        policy = Policy(policy_cluster, cfg.policy, init_reference_model=False)
        generation = make_generation(cfg, gen_cluster)
        metadata = build_refit_metadata(policy.refit_info(), 1 << 20)  # 1 MiB buckets: several buffers
        assert len(metadata.bucket_sizes) > 1
        generation.prepare_refit_info(metadata)
        assert generation.get_weights_checksums() == [policy.weights_checksum()]  # both load model_name

        # One training step moves the policy away from the generation weights.
        torch.manual_seed(0)
        ids = torch.randint(7, 100, (8, 12))
        batch = Batch(input_ids=ids, input_lengths=torch.full((8,), 12), token_mask=torch.ones(8, 12),
                      sample_mask=torch.ones(8))
        policy.train(batch, NLLLoss())
        assert generation.get_weights_checksums() != [policy.weights_checksum()]

        refit_policy_generation(policy, generation, metadata, version=1, verify=True)
        assert generation.get_weights_checksums() == [policy.weights_checksum()]
        assert generation.weights_version == 1

        # With equal weights, the engine's processed logprobs (temperature 0.7) match the
        # trainer's logprobs at that temperature: token_mult_prob_error < 1.001.
        prompts = Batch(input_ids=ids[:, :5], input_lengths=torch.full((8,), 5), seeds=torch.arange(8))
        out = generation.generate(prompts, greedy=False)
        full = Batch(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
        train_lp = policy.get_logprobs(full, temperature=0.7)["logprobs"]
        positions = torch.arange(out["output_ids"].shape[1])[None, :]
        generated = (positions >= 5) & (positions < out["unpadded_sequence_lengths"][:, None])
        assert generated.sum() > 0
        err = torch.exp((out["logprobs"] - train_lp).abs())[generated].mean().item()
        assert 1.0 <= err < 1.001
    finally:
        for part in (generation, policy):
            if part is not None:
                part.shutdown()
        policy_cluster.shutdown()
        if not colocated:
            gen_cluster.shutdown()


def test_refit_into_a_bfloat16_engine_sends_bf16_and_verifies(ray_cluster):
    """float32 masters, bfloat16 engine: the buffers carry bf16 (half the bytes), the engine holds
    exactly bf16(master), and the verification compares in the engine's dtypes."""
    from posttrain.models.policy.policy import Policy

    cfg = _cfg()
    cfg.policy.precision = "bfloat16"
    cluster = make_cluster(cfg, 1, colocated_groups=2, name="policy-bf16")
    policy = generation = None
    try:
        policy = Policy(cluster, cfg.policy, init_reference_model=False)
        generation = make_generation(cfg, cluster)
        dtypes = generation.weight_dtypes()
        assert set(dtypes.values()) == {torch.bfloat16}
        full = build_refit_metadata(policy.refit_info())
        metadata = build_refit_metadata(policy.refit_info(), dtypes=dtypes)
        assert {s.dtype for s in metadata.slots} == {torch.bfloat16}
        assert metadata.total_bytes < 0.51 * full.total_bytes
        generation.prepare_refit_info(metadata)

        torch.manual_seed(0)
        ids = torch.randint(7, 100, (8, 12))
        policy.train(Batch(input_ids=ids, input_lengths=torch.full((8,), 12), token_mask=torch.ones(8, 12),
                           sample_mask=torch.ones(8)), NLLLoss())
        assert generation.get_weights_checksums() != [policy.weights_checksum(dtypes)]
        refit_policy_generation(policy, generation, metadata, version=1, verify=True)
        assert generation.get_weights_checksums() == [policy.weights_checksum(dtypes)]
        assert generation.get_weights_checksums() != [policy.weights_checksum()]  # masters stay float32
    finally:
        for part in (generation, policy):
            if part is not None:
                part.shutdown()
        cluster.shutdown()
