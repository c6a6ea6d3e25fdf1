"""The distillation loss against hand-computed KLs (tiny vocabularies, one or two tokens)."""

import math

import pytest
import torch

from posttrain.algorithms.distill_loss import LOG_EPS_OUTSIDE_TOPK, DistillationLoss
from posttrain.algorithms.loss import LOSS_REGISTRY, build_loss
from posttrain.utils.metrics import valid_counts

LN = math.log


def one_token(student_logits, teacher_topk_logits, teacher_topk_indices):
    """A row of two positions: position 0 (ignored) and one generated token at position 1."""
    vocab, k = len(student_logits), len(teacher_topk_logits)
    logits = torch.zeros(1, 2, vocab)
    logits[0, 1] = torch.tensor(student_logits)
    logits.requires_grad_(True)
    batch = {
        "token_mask": torch.tensor([[0.0, 1.0]]),
        "sample_mask": torch.ones(1),
        "teacher_topk_logits": torch.zeros(1, 2, k),
        "teacher_topk_indices": torch.zeros(1, 2, k, dtype=torch.long),
    }
    batch["teacher_topk_logits"][0, 1] = torch.tensor(teacher_topk_logits)
    batch["teacher_topk_indices"][0, 1] = torch.tensor(teacher_topk_indices)
    return logits, batch


def call(loss_fn, logits, batch):
    seqs, toks = valid_counts(batch)
    return loss_fn(logits, batch, seqs, toks)


# Student logits [0, ln 2, 5] on a 3-token vocabulary; the teacher's top-2 are tokens 1 and 0 with
# equal logits. Renormalised over {1, 0}: student (2/3, 1/3), teacher (1/2, 1/2).
RENORM = ([0.0, LN(2.0), 5.0], [0.0, 0.0], [1, 0])
RENORM_FORWARD = 0.5 * LN(0.5 / (2 / 3)) + 0.5 * LN(0.5 / (1 / 3))
RENORM_REVERSE = (2 / 3) * LN((2 / 3) / 0.5) + (1 / 3) * LN((1 / 3) / 0.5)


def test_forward_kl_over_renormalised_topk():
    loss, metrics = call(DistillationLoss("forward"), *one_token(*RENORM))
    assert loss.item() == pytest.approx(RENORM_FORWARD, abs=1e-6)
    assert metrics["forward_kl"] == pytest.approx(RENORM_FORWARD, abs=1e-6)
    assert metrics["reverse_kl"] == pytest.approx(RENORM_REVERSE, abs=1e-6)
    # Student probabilities 1, 2, e^5 (/ sum): mass on the teacher's top-2 is 3 / (3 + e^5).
    assert metrics["student_topk_mass"] == pytest.approx(3 / (3 + math.exp(5)), rel=1e-5)
    assert metrics["num_valid_tokens"] == 1.0 and metrics["num_valid_samples"] == 1.0


def test_reverse_and_mixed_kl():
    loss, _ = call(DistillationLoss("reverse"), *one_token(*RENORM))
    assert loss.item() == pytest.approx(RENORM_REVERSE, abs=1e-6)
    loss, _ = call(DistillationLoss("mixed", mixed_kl_weight=0.25), *one_token(*RENORM))
    assert loss.item() == pytest.approx(0.25 * RENORM_FORWARD + 0.75 * RENORM_REVERSE, abs=1e-6)
    # The weight's ends are the pure KLs.
    assert call(DistillationLoss("mixed", mixed_kl_weight=1.0), *one_token(*RENORM))[0].item() == pytest.approx(
        RENORM_FORWARD, abs=1e-6)


# zero_outside_topk: student probabilities (1/6, 2/6, 3/6) over the whole vocabulary; the teacher's
# top-2 are tokens 2 and 1 with probabilities (3/4, 1/4) after renormalising its logits (ln 3, 0).
FULL = ([0.0, LN(2.0), LN(3.0)], [LN(3.0), 0.0], [2, 1])
FULL_FORWARD = 0.75 * LN(0.75 / 0.5) + 0.25 * LN(0.25 / (1 / 3))
FULL_REVERSE_TOPK = 0.5 * LN(0.5 / 0.75) + (1 / 3) * LN((1 / 3) / 0.25)
FULL_OUTSIDE = (1 / 6) * (LN(1 / 6) - LOG_EPS_OUTSIDE_TOPK)  # token 0, against a teacher probability e^-100


def test_zero_outside_topk_uses_full_vocabulary_probabilities():
    loss, metrics = call(DistillationLoss("forward", zero_outside_topk=True), *one_token(*FULL))
    assert loss.item() == pytest.approx(FULL_FORWARD, abs=1e-6)
    assert metrics["student_topk_mass"] == pytest.approx(5 / 6, abs=1e-6)
    loss, metrics = call(DistillationLoss("reverse", zero_outside_topk=True), *one_token(*FULL))
    assert loss.item() == pytest.approx(FULL_REVERSE_TOPK + FULL_OUTSIDE, abs=1e-4)
    assert metrics["reverse_kl"] == pytest.approx(FULL_REVERSE_TOPK, abs=1e-6)  # logged without the outside term
    loss, _ = call(DistillationLoss("mixed", mixed_kl_weight=0.5, zero_outside_topk=True), *one_token(*FULL))
    assert loss.item() == pytest.approx(0.5 * FULL_FORWARD + 0.5 * (FULL_REVERSE_TOPK + FULL_OUTSIDE), abs=1e-4)
    # Without the flag the same numbers renormalise the student over {2, 1}: (3/5, 2/5).
    loss, _ = call(DistillationLoss("forward"), *one_token(*FULL))
    assert loss.item() == pytest.approx(0.75 * LN(0.75 / 0.6) + 0.25 * LN(0.25 / 0.4), abs=1e-6)


def test_matching_distributions_give_zero_loss_and_gradient():
    logits, batch = one_token([1.0, 2.0, -1.0], [2.0, 1.0], [1, 0])
    loss, _ = call(DistillationLoss("mixed"), logits, batch)
    loss.backward()
    assert abs(loss.item()) < 1e-7
    assert logits.grad.abs().max().item() < 1e-6


def test_forward_kl_gradient_is_student_minus_teacher():
    # d/dz_i sum_S q (q - log_softmax_S(z)) = p_i - q_i on the top-k, 0 elsewhere.
    logits, batch = one_token(*RENORM)
    call(DistillationLoss("forward"), logits, batch)[0].backward()
    grad = logits.grad[0, 1]
    assert grad.tolist() == pytest.approx([1 / 3 - 0.5, 2 / 3 - 0.5, 0.0], abs=1e-6)
    assert logits.grad[0, 0].abs().max().item() == 0.0  # position 0 never trains


def batch_of_rows(seed=0, rows=4, seq=5, vocab=7, k=3):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, seq, vocab, generator=g)
    teacher_logits = torch.randn(rows, seq, vocab, generator=g)
    top = teacher_logits.topk(k, dim=-1)
    batch = {
        "token_mask": torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]).float(),
        "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0]),
        "teacher_topk_logits": top.values,
        "teacher_topk_indices": top.indices,
    }
    return logits, batch


def per_token_forward(logits, batch, row, pos):
    idx = batch["teacher_topk_indices"][row, pos]
    q = torch.log_softmax(batch["teacher_topk_logits"][row, pos], -1)
    p = torch.log_softmax(logits[row, pos, idx], -1)
    return float((q.exp() * (q - p)).sum())


def test_masks_and_global_token_mean():
    logits, batch = batch_of_rows()
    loss, metrics = call(DistillationLoss("forward"), logits, batch)
    # Valid tokens: positions >= 1 with token_mask 1 in rows whose sample_mask is 1 (row 2 is out).
    valid = [(r, p) for r in (0, 1, 3) for p in range(1, 5) if batch["token_mask"][r, p] > 0]
    assert len(valid) == 3 + 2 + 4 and metrics["num_valid_tokens"] == 9.0 and metrics["num_valid_samples"] == 3.0
    expected = sum(per_token_forward(logits, batch, r, p) for r, p in valid) / len(valid)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    # Masked positions do not matter: scrambling them leaves the loss unchanged.
    scrambled = logits.clone()
    scrambled[2] = 100.0
    scrambled[0, :2] = -50.0
    assert call(DistillationLoss("forward"), scrambled, batch)[0].item() == pytest.approx(loss.item(), abs=1e-6)


@pytest.mark.parametrize("kl_type,zero_outside_topk", [("forward", False), ("reverse", True), ("mixed", False)])
def test_micro_batches_with_global_counts_sum_to_the_full_batch(kl_type, zero_outside_topk):
    """Each micro-batch divides by the step's global token count, so losses, gradients and metrics
    of any split add up to those of the whole batch (how the policy worker accumulates)."""
    loss_fn = DistillationLoss(kl_type, zero_outside_topk=zero_outside_topk)
    logits, batch = batch_of_rows(seed=3)
    seqs, toks = valid_counts(batch)
    full_logits = logits.clone().requires_grad_(True)
    full_loss, full_metrics = loss_fn(full_logits, batch, seqs, toks)
    full_loss.backward()

    split_logits = logits.clone().requires_grad_(True)
    total, sums = 0.0, {}
    for rows in (slice(0, 1), slice(1, 4)):
        part = {key: value[rows] for key, value in batch.items()}
        loss, metrics = loss_fn(split_logits[rows], part, seqs, toks)
        loss.backward()
        total += loss.item()
        for name, value in metrics.items():
            sums[name] = sums.get(name, 0.0) + value
    assert total == pytest.approx(full_loss.item(), abs=1e-6)
    assert torch.allclose(split_logits.grad, full_logits.grad, atol=1e-7)
    for name in ("loss", "forward_kl", "reverse_kl", "student_topk_mass", "num_valid_tokens"):
        assert sums[name] == pytest.approx(full_metrics[name], abs=1e-6)


def test_registered_and_bad_options():
    assert LOSS_REGISTRY["distillation"] is DistillationLoss
    loss_fn = build_loss("distillation", kl_type="reverse", mixed_kl_weight=0.3, zero_outside_topk=True)
    assert (loss_fn.kl_type, loss_fn.mixed_kl_weight, loss_fn.zero_outside_topk) == ("reverse", 0.3, True)
    assert loss_fn.input_type == "logits" and loss_fn.loss_type == "token"
    with pytest.raises(ValueError, match="kl_type='js'"):
        DistillationLoss("js")
    with pytest.raises(ValueError, match=r"mixed_kl_weight=1.5 must be in \[0, 1\]"):
        DistillationLoss("mixed", mixed_kl_weight=1.5)


def test_teacher_index_outside_student_vocabulary_is_named():
    logits, batch = one_token([0.0, 1.0, 2.0], [1.0, 0.0], [5, 0])
    with pytest.raises(ValueError, match="index 5 is outside the student's vocabulary of 3 tokens"):
        call(DistillationLoss(), logits, batch)
    logits, batch = one_token([0.0, 1.0, 2.0], [1.0, 0.0], [1, 0])
    with pytest.raises(KeyError, match="teacher_topk_logits"):
        call(DistillationLoss(), logits, {k: v for k, v in batch.items() if k != "teacher_topk_logits"})
