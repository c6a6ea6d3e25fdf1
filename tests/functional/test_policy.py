"""Policy training workers on real Ray actors with a real tiny HF model (gloo, CPU).

The references are computed in the test process with plain transformers: log_softmax of the
model's logits, and one SGD step over the whole batch at once. Data parallelism (FSDP2 over two
workers), micro-batching and sequence packing must reproduce them.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithms.loss import ClippedPGLoss, NLLLoss
from posttrain.config.schema import LossConfig, PolicyConfig
from posttrain.distributed.batch import Batch
from posttrain.distributed.cluster import VirtualCluster
from posttrain.distributed.worker_group import WorkerError
from posttrain.models.hf import load_causal_lm
from posttrain.models.policy.checkpoint import convert_to_hf
from posttrain.models.policy.forward import (
    dynamic_microbatches,
    fixed_size_microbatches,
    microbatch_logprobs,
    packed_microbatches,
)
from posttrain.models.policy.policy import Policy

# The timeout is a hang guard, not a speed test: beside two CPU hogs this module ran 4-6x its quiet time.
pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]

LR = 1.0  # SGD with lr 1: the weight change is minus the gradient
LENGTHS = [14, 5, 9, 7, 16, 3, 11, 12]  # bins of 20 tokens: 2 on rank 0, 3 on rank 1


def make_batch(seed: int = 0) -> Batch:
    """8 right-padded rows: prompt = first 3 tokens, the rest trained on; row 6 masked out."""
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
    return Batch(
        input_ids=ids, input_lengths=lengths, token_mask=token_mask, sample_mask=sample_mask, advantages=advantages
    )


def policy_cfg(**overrides) -> PolicyConfig:
    base = dict(
        model_name="tiny",
        optimizer=dict(name="sgd", lr=LR, weight_decay=0.0),
        max_grad_norm=None,
        train_global_batch_size=8,
        train_micro_batch_size=8,
        logprob_batch_size=3,
    )
    base.update(overrides)
    return PolicyConfig.model_validate(base)


def reference_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """log p(token_i | <i) with plain transformers, 0 at position 0 and in the padding."""
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    valid = torch.arange(ids.shape[1])[None] < lengths[:, None]
    logits = model(input_ids=ids, attention_mask=valid.long()).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logprobs, (1, 0)) * valid


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    return load_causal_lm("tiny")


@pytest.fixture(scope="module")
def pg_batch(hf_model) -> Batch:
    """A GRPO-like batch whose old/generation logprobs are perturbed, so some ratios get clipped."""
    batch = make_batch()
    with torch.no_grad():
        logprobs = reference_logprobs(hf_model, batch)
    noise = 0.3 * torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(1))
    batch["prev_logprobs"] = logprobs + noise
    batch["generation_logprobs"] = logprobs + noise
    return batch


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    # 4, not 3: with thirds of a CPU, Ray's rounded free share (0.3333) looks smaller than 1/3.
    cluster = VirtualCluster([2], max_colocated_worker_groups=4, reuse_worker_processes=True)  # worker_host.py
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def dp2(cluster, tmp_path_factory):
    """Two FSDP2 workers, micro-batches of 2 rows, reference model kept; plus its initial checkpoint."""
    policy = Policy(cluster, policy_cfg(train_micro_batch_size=2, num_workers=2), init_reference_model=True, name="dp2")
    initial = tmp_path_factory.mktemp("dp2") / "initial"
    policy.save_checkpoint(str(initial))
    yield policy, str(initial)
    policy.shutdown()


@pytest.fixture(scope="module")
def dp2_packed(cluster):
    """Two FSDP2 workers with sequence packing: bins of <= 20 tokens (2 bins on rank 0, 3 on rank 1,
    so rank 0 runs a dummy bin to keep FSDP's collectives in step). Activation checkpointing is on
    too: recomputing activations in backward must not change the gradient."""
    cfg = policy_cfg(
        sequence_packing=dict(enabled=True, train_mb_tokens=20, logprob_mb_tokens=20), activation_checkpointing=True,
        num_workers=2,
    )
    policy = Policy(cluster, cfg, init_reference_model=False, name="dp2_packed")
    yield policy
    policy.shutdown()


def sgd_update(model: torch.nn.Module, batch: Batch, loss_fn) -> dict[str, torch.Tensor]:
    """New weights after one SGD step on the whole batch in one piece (the reference)."""
    model = type(model).from_pretrained(model.name_or_path).train()  # a fresh copy
    mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
    loss, _ = loss_fn(reference_logprobs(model, batch), batch, batch["sample_mask"].sum(), mask.sum())
    loss.backward()
    return {name: (p - LR * p.grad).detach() for name, p in model.named_parameters()}


def assert_weights_close(actual: dict, expected: dict, atol: float = 1e-5) -> None:
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------ in-process
def test_micro_batching_modes_give_the_same_logprobs(hf_model):
    """Fixed-size, dynamic and packed micro-batches of one model agree with the plain forward."""
    batch = make_batch()
    with torch.no_grad():
        expected = reference_logprobs(hf_model, batch)
        plans = {
            "fixed": fixed_size_microbatches(batch, 3),
            "dynamic": dynamic_microbatches(batch, max_tokens=32, round_to=4),
            "packed": packed_microbatches(batch, max_tokens=20, algorithm="modified_first_fit_decreasing"),
        }
        for mode, mbs in plans.items():
            out = torch.zeros_like(expected)
            for mb in mbs:
                logprobs = microbatch_logprobs(hf_model, mb, torch.device("cpu"), torch.float32)
                out[mb.index, : logprobs.shape[1]] = logprobs
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=0, msg=lambda m: f"{mode}: {m}")
    assert len(plans["packed"]) < batch.size  # several rows really shared a bin


# ------------------------------------------------------------------------------ Ray workers
def test_logprobs_two_workers_packed_and_unpacked_in_callers_order(dp2, dp2_packed, hf_model):
    policy, initial = dp2
    policy.load_checkpoint(initial)
    batch = make_batch()
    with torch.no_grad():
        expected = reference_logprobs(hf_model, batch)
    unpacked = policy.get_logprobs(batch)["logprobs"]
    packed = dp2_packed.get_logprobs(batch)["logprobs"]
    assert unpacked.shape == expected.shape and unpacked.dtype == torch.float32
    torch.testing.assert_close(unpacked, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)
    # A shuffled batch comes back shuffled the same way.
    order = torch.tensor([6, 1, 7, 0, 3, 5, 2])  # 7 rows: shards of 4 and 3
    torch.testing.assert_close(policy.get_logprobs(batch.select(order))["logprobs"], expected[order], atol=1e-5, rtol=0)
    assert (unpacked[:, 0] == 0).all() and (unpacked[1, 5:] == 0).all()


@pytest.mark.parametrize("packed", [False, True], ids=["micro_batches", "packed"])
def test_two_workers_step_equals_one_big_batch(dp2, dp2_packed, hf_model, pg_batch, packed):
    """Clipped PG loss (token-level global normalisation): 2 FSDP workers x several micro-batches
    or packed bins give the weights of one SGD step on the whole batch."""
    loss_fn = ClippedPGLoss(LossConfig())
    expected = sgd_update(hf_model, pg_batch, loss_fn)
    if packed:
        policy = dp2_packed
        policy.load_checkpoint(dp2[1])
    else:
        policy, initial = dp2
        policy.load_checkpoint(initial)
    metrics = policy.train(pg_batch, loss_fn)
    assert_weights_close(policy.state_dict_for_export(), expected)
    mask = pg_batch["token_mask"][:, 1:] * pg_batch["sample_mask"][:, None]
    assert metrics["global_valid_toks"] == mask.sum().item() == 11 + 2 + 6 + 4 + 13 + 0 + 9  # lengths - 3, row 6 out
    assert metrics["global_valid_seqs"] == 7.0
    assert metrics["lr"] == LR
    assert metrics["loss"] != 0.0 and metrics["grad_norm"] > 0.0


def test_nll_metrics_are_global_and_reference_stays_initial(dp2, hf_model):
    policy, initial = dp2
    policy.load_checkpoint(initial)
    batch = make_batch()
    with torch.no_grad():
        initial_logprobs = reference_logprobs(hf_model, batch)
    mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
    expected_loss = -(initial_logprobs[:, 1:] * mask).sum() / mask.sum()
    metrics = policy.train(batch, NLLLoss(), micro_batch_size=1)
    assert metrics["loss"] == pytest.approx(expected_loss.item(), abs=1e-5)
    assert metrics["num_valid_tokens"] == mask.sum().item()
    # The weights moved, the reference did not.
    assert not torch.allclose(policy.get_logprobs(batch)["logprobs"], initial_logprobs, atol=1e-3)
    torch.testing.assert_close(policy.get_reference_logprobs(batch)["logprobs"], initial_logprobs, atol=1e-5, rtol=0)


def test_checkpoint_resume_gives_bit_identical_next_step(cluster, pg_batch, tmp_path):
    """AdamW with warm-up, so optimizer moments, scheduler position and step all have to come back.
    A checkpoint saved without optimizer state (`checkpointing.save_optimizer=false`) has none on
    disk and resumes the weights and the schedule with fresh optimizer moments."""
    from posttrain.models.policy.checkpoint import has_optimizer_state

    cfg = policy_cfg(
        train_micro_batch_size=2,
        max_grad_norm=1.0,
        optimizer=dict(name="adamw", lr=1e-3),
        scheduler=dict(name="linear", warmup_steps=1, total_steps=4),
    )
    loss_fn = ClippedPGLoss(LossConfig())
    original = Policy(cluster, cfg, init_reference_model=False, name="original")
    try:
        original.train(pg_batch, loss_fn)
        saved = original.save_checkpoint(str(tmp_path / "step_1"))
        assert not (tmp_path / "step_1.tmp").exists()
        no_optimizer = original.save_checkpoint(str(tmp_path / "no_optimizer"), save_optimizer=False)
        assert has_optimizer_state(saved) and not has_optimizer_state(no_optimizer)
        expected_metrics = original.train(pg_batch, loss_fn)
        expected_weights = original.state_dict_for_export()
    finally:
        original.shutdown()

    resumed = Policy(cluster, cfg, init_reference_model=False, weights_path=saved, name="resumed")
    try:
        metrics = resumed.train(pg_batch, loss_fn)
        assert metrics == expected_metrics  # loss, grad norm, lr (step 1 of the schedule): bit for bit
        assert metrics["lr"] == pytest.approx(1e-3)
        weights = resumed.state_dict_for_export()
        assert all(torch.equal(weights[k], v) for k, v in expected_weights.items())
    finally:
        resumed.shutdown()

    fresh = Policy(cluster, cfg, init_reference_model=False, weights_path=no_optimizer, name="fresh_optimizer")
    try:
        metrics = fresh.train(pg_batch, loss_fn)
        # Same weights before the step, so the same loss; the schedule goes on (step 1's lr) while
        # Adam's moments start from zero, so the update differs.
        assert metrics["loss"] == expected_metrics["loss"] and metrics["lr"] == pytest.approx(1e-3)
        weights = fresh.state_dict_for_export()
        assert not all(torch.equal(weights[k], v) for k, v in expected_weights.items())
    finally:
        fresh.shutdown()


def test_muon_on_two_fsdp_workers_trains_both_groups_and_resumes_bit_identically(cluster, pg_batch, tmp_path):
    """`policy.optimizer.name: muon` on sharded (DTensor) parameters: a step moves the Muon
    matrices and the AdamW rest, and its sharded state (momentum buffers, Adam moments) comes back
    from a checkpoint so that the next step is bit-identical."""
    cfg = policy_cfg(num_workers=2, train_micro_batch_size=2, optimizer=dict(name="muon", lr=1e-2, weight_decay=0.1))
    loss_fn = ClippedPGLoss(LossConfig())
    original = Policy(cluster, cfg, init_reference_model=False, name="muon")
    try:
        initial = original.state_dict_for_export()
        original.train(pg_batch, loss_fn)
        after_one = original.state_dict_for_export()
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
            assert not torch.equal(after_one[name], initial[name]), name
        saved = original.save_checkpoint(str(tmp_path / "step_1"))
        expected_metrics = original.train(pg_batch, loss_fn)
        expected_weights = original.state_dict_for_export()
    finally:
        original.shutdown()
    resumed = Policy(cluster, cfg, init_reference_model=False, weights_path=saved, name="muon_resumed")
    try:
        assert resumed.train(pg_batch, loss_fn) == expected_metrics
        weights = resumed.state_dict_for_export()
        assert all(torch.equal(weights[k], v) for k, v in expected_weights.items())
    finally:
        resumed.shutdown()


def test_hf_export_and_convert_reload_with_identical_logits(dp2, hf_model, pg_batch, tmp_path):
    from transformers import AutoModelForCausalLM

    policy, initial = dp2
    policy.load_checkpoint(initial)
    policy.train(pg_batch, ClippedPGLoss(LossConfig()))
    batch = make_batch(seed=3)
    expected = policy.get_logprobs(batch)["logprobs"]
    out = policy.export_hf(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        torch.testing.assert_close(reference_logprobs(exported, batch), expected, atol=1e-5, rtol=0)
    # The same weights through a checkpoint and the offline converter.
    policy.save_checkpoint(str(tmp_path / "ckpt"))
    converted = AutoModelForCausalLM.from_pretrained(convert_to_hf(tmp_path / "ckpt", tmp_path / "converted"))
    for (name, a), (_, b) in zip(exported.state_dict().items(), converted.state_dict().items()):
        assert torch.equal(a, b), name
    names = [name for name, _, _ in policy.refit_info()]
    assert names == list(policy.state_dict_for_export())


class NaNLoss:
    """NLL whose second micro-batch on each rank is NaN."""

    loss_type = "token"
    input_type = "logprobs"

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, logprobs, batch, global_valid_seqs, global_valid_toks):
        self.calls += 1
        loss, metrics = NLLLoss()(logprobs, batch, global_valid_seqs, global_valid_toks)
        return (loss * float("nan") if self.calls == 2 else loss), metrics


def test_nan_loss_raises_before_the_optimizer_step(dp2, pg_batch):
    policy, initial = dp2
    policy.load_checkpoint(initial)
    before = policy.state_dict_for_export()
    with pytest.raises(WorkerError, match=r"non-finite loss at train call 0, optimizer step 0, micro-batch\(es\) \[1\]"):
        policy.train(pg_batch, NaNLoss())
    after = policy.state_dict_for_export()
    assert all(torch.equal(after[k], v) for k, v in before.items())


# ------------------------------------------------------------------------- distillation
def reference_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token logits aligned to `input_ids` ([B, S, V]; position i predicts token i), 0 at
    position 0 and in the padding, with plain transformers."""
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    valid = torch.arange(ids.shape[1])[None] < lengths[:, None]
    logits = model(input_ids=ids, attention_mask=valid.long()).logits.float()
    return torch.nn.functional.pad(logits[:, :-1], (0, 0, 1, 0)) * valid[..., None]


def distill_batch() -> Batch:
    """`make_batch` rows with a random teacher's top-5 (logits and vocabulary indices)."""
    batch = make_batch(seed=5)
    teacher = torch.randn(*batch["input_ids"].shape, 103, generator=torch.Generator().manual_seed(6)) * 3
    top = teacher.topk(5, dim=-1)
    batch["teacher_topk_logits"], batch["teacher_topk_indices"] = top.values, top.indices
    return batch


def test_teacher_topk_logits_match_plain_transformers(dp2, dp2_packed, hf_model):
    """`get_topk_logits` (the teacher's answer) on 2 workers, unpacked and packed, is the top-k of
    the model's own next-token logits at every real position, in the caller's row order."""
    policy, initial = dp2
    policy.load_checkpoint(initial)
    dp2_packed.load_checkpoint(initial)
    batch = make_batch(seed=4)
    with torch.no_grad():
        expected = reference_logits(hf_model, batch).topk(5, dim=-1)
    real = (torch.arange(batch["input_ids"].shape[1])[None] < batch["input_lengths"][:, None])
    real[:, 0] = False
    for who in (policy, dp2_packed):
        top = who.get_topk_logits(batch, 5)
        assert top["topk_logits"].shape == top["topk_indices"].shape == (8, 16, 5)
        torch.testing.assert_close(top["topk_logits"][real], expected.values[real], atol=1e-5, rtol=0)
        assert torch.equal(top["topk_indices"][real], expected.indices[real])
        assert (top["topk_logits"][~real] == 0).all()


@pytest.mark.parametrize("packed", [False, True], ids=["micro_batches", "packed"])
def test_distillation_step_two_workers_equals_one_big_batch(dp2, dp2_packed, hf_model, packed):
    """The distillation loss (full logits, global token normalisation): 2 FSDP workers x micro-
    batches of 2 rows, or packed bins, give the weights of one SGD step on the whole batch."""
    from posttrain.algorithms.distill_loss import DistillationLoss

    loss_fn = DistillationLoss("mixed", mixed_kl_weight=0.3, zero_outside_topk=True)
    batch = distill_batch()
    model = type(hf_model).from_pretrained(hf_model.name_or_path).train()  # a fresh copy
    mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
    loss, _ = loss_fn(reference_logits(model, batch), batch, batch["sample_mask"].sum(), mask.sum())
    loss.backward()
    expected = {name: (p - LR * p.grad).detach() for name, p in model.named_parameters()}

    policy = dp2_packed if packed else dp2[0]
    policy.load_checkpoint(dp2[1])
    metrics = policy.train(batch, loss_fn)
    assert_weights_close(policy.state_dict_for_export(), expected)
    assert metrics["loss"] == pytest.approx(loss.item(), abs=1e-5)
    assert metrics["num_valid_tokens"] == metrics["global_valid_toks"] == mask.sum().item()


def test_batch_invariant_logprobs_depend_on_the_sequence_alone(cluster, hf_model, pg_batch):
    """policy.batch_invariant: a row's logprobs are bit-identical whatever rows, padding width or
    micro-batching (dynamic batching here, packing on the second worker group) surround it; and
    training stays exact (one SGD step equals the whole-batch reference)."""
    loss_fn = ClippedPGLoss(LossConfig())
    expected = sgd_update(hf_model, pg_batch, loss_fn)
    for extra in (dict(dynamic_batching=dict(enabled=True, train_mb_tokens=24, logprob_mb_tokens=24)),
                  dict(sequence_packing=dict(enabled=True, train_mb_tokens=20, logprob_mb_tokens=20))):
        policy = Policy(cluster, policy_cfg(batch_invariant=True, **extra), init_reference_model=False,
                        name="batch_invariant")
        try:
            batch = make_batch()
            whole = policy.get_logprobs(batch)["logprobs"]
            torch.testing.assert_close(whole, reference_logprobs(hf_model, batch).detach(), atol=1e-5, rtol=0)
            # Other companions, another order, a wider padding (32 columns instead of 16).
            order = torch.tensor([5, 0, 3])
            others = batch.select(order)
            others["input_ids"] = torch.nn.functional.pad(others["input_ids"], (0, 16))
            for key in ("token_mask", "advantages"):
                others[key] = torch.nn.functional.pad(others[key], (0, 16))
            alone = policy.get_logprobs(others)["logprobs"]
            for row, source in enumerate(order.tolist()):
                length = LENGTHS[source]
                assert torch.equal(alone[row, :length], whole[source, :length]), (row, source)
                assert (alone[row, length:] == 0).all()
            policy.train(pg_batch, loss_fn)
            assert_weights_close(policy.state_dict_for_export(), expected)
        finally:
            policy.shutdown()
