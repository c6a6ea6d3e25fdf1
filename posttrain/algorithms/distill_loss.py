"""Top-k KL loss of on-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes"; the form of NeMo-RL's `DistillationLossFn`).

The student generated the tokens; the teacher scored the same rows and kept, at every position,
its `k` largest logits and their vocabulary indices (`teacher_topk_logits`, `teacher_topk_indices`,
`[B, S, k]`, aligned to `input_ids` like every per-token tensor: position i describes the
distribution of token i given tokens < i). With S the teacher's top-k set at one position:

- teacher: q = log_softmax(teacher logits over S) (the teacher's mass is renormalised onto S);
- student: p = log_softmax(student logits over S) by default, or, with `zero_outside_topk`, the
  student's full-vocabulary log-probabilities at S (not renormalised: the student is pushed to put
  all of its mass on S, where the teacher has it);
- forward KL(teacher || student) = sum_S e^q (q - p) (mass-covering),
  reverse KL(student || teacher) = sum_S e^p (p - q) (mode-seeking; with `zero_outside_topk` it also
  counts the student's mass outside S against a teacher probability of e^LOG_EPS_OUTSIDE_TOPK there),
  mixed = w * forward + (1 - w) * reverse (`mixed_kl_weight` = w).

The per-token KL is averaged over the generated tokens of the whole optimizer step: divided by
the global valid token count, so micro-batches and data-parallel ranks sum to the full-batch mean
(docs/internals.md, "Loss functions").
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

import torch
import torch.nn.functional as F

from posttrain.algorithms.loss import Count, Metrics, loss_mask, masked_mean, register_loss

KL_TYPES = ("forward", "reverse", "mixed")
# log of the probability the teacher is taken to give tokens outside its top-k under
# `zero_outside_topk` (NeMo-RL's `log_infinitesimal`): makes student mass there cost ~100 nats per unit.
LOG_EPS_OUTSIDE_TOPK = -100.0


def topk_logprobs(
    student_logits: torch.Tensor, teacher_topk_logits: torch.Tensor, teacher_topk_indices: torch.Tensor,
    zero_outside_topk: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(student_logprobs, teacher_logprobs, student_full_logprobs_or_None)` over the teacher's top-k.

    Args:
        student_logits: `[..., V]` float logits.
        teacher_topk_logits, teacher_topk_indices: `[..., k]`.
        zero_outside_topk: student log-probabilities over the whole vocabulary (returned as the
            third value too, for the mass outside the top-k) instead of renormalised over the top-k.
    """
    indices = teacher_topk_indices.long()
    teacher = F.log_softmax(teacher_topk_logits.float(), dim=-1)
    if zero_outside_topk:
        full = F.log_softmax(student_logits.float(), dim=-1)
        return full.gather(-1, indices), teacher, full
    return F.log_softmax(student_logits.float().gather(-1, indices), dim=-1), teacher, None


@register_loss("distillation")
class DistillationLoss:
    """Forward, reverse or mixed KL between the student and the teacher's top-k distribution.

    Args:
        kl_type: "forward" (default; KL(teacher || student)), "reverse" (KL(student || teacher)) or
            "mixed" (`mixed_kl_weight` x forward + (1 - `mixed_kl_weight`) x reverse).
        mixed_kl_weight: weight of the forward term for "mixed" (default 0.5), in [0, 1].
        zero_outside_topk: treat the teacher's probability outside its top-k as ~0 and use the
            student's full-vocabulary probabilities (default False: both renormalised over the top-k).

    Called with the student's logits `[B, S, V]` (position i: logits of token i given tokens < i;
    position 0 is ignored) and a batch carrying `token_mask`, `sample_mask`, `teacher_topk_logits`
    and `teacher_topk_indices`. Metrics (token means over the step, so they sum over micro-batches
    and ranks): `loss` (the configured KL), `forward_kl` and `reverse_kl` over the top-k (without the
    outside-top-k term), `student_topk_mass` (the student's full-vocabulary probability on the
    teacher's top-k), `num_valid_tokens`, `num_valid_samples`; with a `[B]` `task_index` in the
    batch (a run of several tasks), also `kl_sum_task<i>` and `kl_tokens_task<i>`, the KL summed over
    task i's valid tokens and their count (`distill_teachers.per_task_kl` divides them).
    """

    loss_type: Literal["token", "sequence"] = "token"
    input_type: Literal["logits"] = "logits"

    def __init__(self, kl_type: str = "forward", mixed_kl_weight: float = 0.5, zero_outside_topk: bool = False):
        if kl_type not in KL_TYPES:
            raise ValueError(f"loss_fn.kl_type={kl_type!r}; choose one of {', '.join(KL_TYPES)}")
        if not 0.0 <= mixed_kl_weight <= 1.0:
            raise ValueError(f"loss_fn.mixed_kl_weight={mixed_kl_weight} must be in [0, 1]")
        self.kl_type = kl_type
        self.mixed_kl_weight = float(mixed_kl_weight)
        self.zero_outside_topk = bool(zero_outside_topk)

    def __call__(
        self, logits: torch.Tensor, batch: Mapping[str, Any], global_valid_seqs: Count, global_valid_toks: Count
    ) -> tuple[torch.Tensor, Metrics]:
        who = "distillation loss"
        if logits.ndim != 3:
            raise ValueError(f"{who}: expects the student's logits [B, S, V], got shape {tuple(logits.shape)}")
        for key in ("teacher_topk_logits", "teacher_topk_indices"):
            if key not in batch:
                raise KeyError(f"{who}: batch is missing {key!r} (the teacher's top-k); it has {sorted(batch)}")
            if batch[key].shape[:2] != logits.shape[:2]:
                raise ValueError(f"{who}: batch[{key!r}] has shape {tuple(batch[key].shape)}, expected "
                                 f"[B, S, k] with [B, S] = {tuple(logits.shape[:2])} like the logits")
        vocab = logits.shape[-1]
        indices = batch["teacher_topk_indices"][:, 1:].to(logits.device)
        if indices.numel() and int(indices.max()) >= vocab:
            raise ValueError(f"{who}: teacher top-k index {int(indices.max())} is outside the student's vocabulary "
                             f"of {vocab} tokens: teacher and student vocabularies differ")
        _, _, sample_mask, mask = loss_mask(logits[..., 0], batch, who)
        student, teacher, student_full = topk_logprobs(
            logits[:, 1:], batch["teacher_topk_logits"][:, 1:].to(logits.device), indices, self.zero_outside_topk
        )
        student_probs, teacher_probs = student.exp(), teacher.exp()
        forward = (teacher_probs * (teacher - student)).sum(-1)
        reverse = (student_probs * (student - teacher)).sum(-1)
        if student_full is not None:
            # The student's mass outside the top-k against the teacher's ~0 there:
            # sum_{v not in S} p_v (log p_v - LOG_EPS_OUTSIDE_TOPK).
            p_log_p_outside = (student_full.exp() * student_full).sum(-1) - (student_probs * student).sum(-1)
            mass_outside = (1.0 - student_probs.sum(-1)).clamp(min=0.0)
            reverse_full = reverse + p_log_p_outside - LOG_EPS_OUTSIDE_TOPK * mass_outside
        else:
            reverse_full = reverse
        if self.kl_type == "forward":
            per_token = forward
        elif self.kl_type == "reverse":
            per_token = reverse_full
        else:
            per_token = self.mixed_kl_weight * forward + (1.0 - self.mixed_kl_weight) * reverse_full
        loss = masked_mean(per_token, mask, global_normalization_factor=global_valid_toks)

        with torch.no_grad():
            def token_mean(values: torch.Tensor) -> float:
                return masked_mean(values, mask, global_normalization_factor=global_valid_toks).item()

            if student_full is None:
                mass = (logits[:, 1:].float().gather(-1, indices.long()).logsumexp(-1)
                        - logits[:, 1:].float().logsumexp(-1)).exp()
            else:
                mass = student_probs.sum(-1)
            metrics = {
                "loss": loss.item(),
                "forward_kl": token_mean(forward),
                "reverse_kl": token_mean(reverse),
                "student_topk_mass": token_mean(mass),
                "num_valid_tokens": mask.sum().item(),
                "num_valid_samples": sample_mask.sum().item(),
            }
            if "task_index" in batch:  # a run of several tasks: each task's KL sum and tokens
                task_index = batch["task_index"].to(per_token.device)
                token_kl = (per_token * mask).sum(-1)
                for i in task_index.unique().tolist():
                    rows = task_index == i
                    metrics[f"kl_sum_task{i}"] = token_kl[rows].sum().item()
                    metrics[f"kl_tokens_task{i}"] = mask[rows].sum().item()
        return loss, metrics
