"""The student's loss when some teacher has another tokenizer (cross-tokenizer on-policy
distillation; `distill_xtok.py` builds its inputs).

On a row of a cross-tokenizer teacher, with aligned spans s (`distill_xtok_align`) of student tokens
j and the span log-probabilities S_s = sum_{j in s} log p_student(token_j) and T_s (the teacher's, of
its own tokens of the same text):

- **distribution term** (each student token that has the teacher's next-token distribution,
  `xtok_match`): in a span whose teacher side is one token, the teacher's top-k there read through
  the text as a distribution over the student's next token (`distill_xtok_align.NextTokenMap`: a
  teacher token's probability goes to the student token its text starts with, after the span's
  earlier student tokens), compared with the student's over those tokens, both renormalised over
  them (`loss_fn.kl_type`: forward, reverse or mixed), as the same-tokenizer KL over the top-k;
  on one-token spans of one string this is GOLD / ULD's KL over the shared vocabulary;
- **span term** (the tokens of every other aligned span, where the teacher's distribution does not
  reach each student token, `xtok_covered` 0): the log-ratio r_s = S_s - T_s is a one-sample
  estimate of the reverse KL(student || teacher) over that piece of text, sampled by the student.
  Its gradient, E[r_s grad S_s], is the policy gradient with the reward -r_s (Agarwal et al. 2024's
  on-policy reverse KL; the per-token form of Thinking Machines' "on-policy distillation", 2025,
  discount 0, with spans for tokens): each token of the span gets `sg(r_s - b_s) * log p(token_j)`,
  with a baseline b_s (`xtok_baseline`: the step's mean log-ratio of the spans at the same place in
  their rows, from the generation's log-probabilities) that leaves the gradient's expectation
  unchanged and removes its push on every sample by the mean reverse KL. Its value is written as
  r_s / n_s per token (n_s: the span's student tokens), so the loss reads as the sampled reverse KL
  per token. Where the distribution term covers a span it replaces this one-sample estimate (the
  whole distribution instead of one sample: both together would count the span twice).

per token: `span_weight` x span term + `match_weight` x exact-match term, summed over the step's
tokens and divided by its global valid-token count, like `DistillationLoss`. Rows of a teacher with
the student's tokenizer get `DistillationLoss` unchanged (the two kinds of rows add in one step).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

import torch
import torch.nn.functional as F

from posttrain.algorithms.distill_loss import DistillationLoss
from posttrain.algorithms.loss import Count, Metrics, loss_mask, masked_mean, register_loss

# Stands for a logit outside the entries compared (exp of it is 0 in float32, and stays finite).
_MASKED = -1.0e9


def span_sums(values: torch.Tensor, span: torch.Tensor, inside: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(sum, count)` `[B, S]`: for each token, the sum of `values` over the tokens of its row's span
    (`span` index, -1 outside any) where `inside`, and how many such tokens the span has."""
    index = span.clamp(min=0)
    width = int(index.max().item()) + 1 if index.numel() else 1
    weight = inside.to(values.dtype)
    sums = values.new_zeros(values.shape[0], width).scatter_add(1, index, values * weight)
    counts = values.new_zeros(values.shape[0], width).scatter_add(1, index, weight)
    return sums.gather(1, index), counts.gather(1, index)


def shared_topk_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, indices: torch.Tensor,
                   valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(forward, reverse)` KL `[...]` between teacher and student over the entries `valid` of the
    teacher's top-k (`indices` in the student's vocabulary), both renormalised over them; 0 where
    none is valid."""
    t = F.log_softmax(teacher_logits.float().masked_fill(~valid, _MASKED), dim=-1)
    s = F.log_softmax(student_logits.float().gather(-1, indices.long()).masked_fill(~valid, _MASKED), dim=-1)
    zero = torch.zeros((), device=t.device)
    forward = torch.where(valid, t.exp() * (t - s), zero).sum(-1)
    reverse = torch.where(valid, s.exp() * (s - t), zero).sum(-1)
    some = valid.any(-1)
    return forward * some, reverse * some


@register_loss("distillation_xtok")
class CrossTokenizerDistillationLoss:
    """`DistillationLoss` on rows of a same-tokenizer teacher, the span and exact-match terms (module
    docstring) on rows of a cross-tokenizer teacher (`xtok_row` 1).

    Args: `kl_type`, `mixed_kl_weight`, `zero_outside_topk` as `DistillationLoss` (the exact-match term
    uses `kl_type` and `mixed_kl_weight`; it always renormalises over the shared top-k);
    `span_weight`, `match_weight` (default 1.0 each): the span and distribution terms' weights.

    Batch keys besides `DistillationLoss`'s: `input_ids`, `xtok_row` `[B]`, `xtok_span` (long),
    `xtok_teacher_logprob`, `xtok_match` `[B, S]`, `teacher_topk_valid` `[B, S, k]`, and optional
    `xtok_covered`, `xtok_baseline` `[B, S]` (0 when absent) (`distill_xtok.student_targets`).
    Metrics (token sums over the step divided by its global valid tokens, so they add over micro-batches):
    `loss`, `xtok_reverse_kl` (the span log-ratios of every aligned span: the sampled reverse KL per
    token), `xtok_match_kl` (the distribution term), `xtok_aligned_tokens`, `xtok_match_tokens` (those with
    the distribution term), `xtok_span_tokens` (those with the span term), `num_valid_tokens`,
    `num_valid_samples`, and `DistillationLoss`'s on a step with same-tokenizer rows; with `task_index`,
    `kl_sum_task<i>` / `kl_tokens_task<i>` over both kinds of rows.
    """

    loss_type: Literal["token", "sequence"] = "token"
    input_type: Literal["logits"] = "logits"

    def __init__(self, kl_type: str = "forward", mixed_kl_weight: float = 0.5, zero_outside_topk: bool = False,
                 span_weight: float = 1.0, match_weight: float = 1.0):
        self.same = DistillationLoss(kl_type, mixed_kl_weight, zero_outside_topk)
        if span_weight < 0 or match_weight < 0:
            raise ValueError(f"loss_fn.xtok_span_weight={span_weight} and loss_fn.xtok_match_weight={match_weight} "
                             "must be >= 0")
        self.span_weight, self.match_weight = float(span_weight), float(match_weight)

    def __call__(self, logits: torch.Tensor, batch: Mapping[str, Any], global_valid_seqs: Count,
                 global_valid_toks: Count) -> tuple[torch.Tensor, Metrics]:
        who = "cross-tokenizer distillation loss"
        for key in ("input_ids", "xtok_row", "xtok_span", "xtok_teacher_logprob", "xtok_match", "teacher_topk_valid"):
            if key not in batch:
                raise KeyError(f"{who}: batch is missing {key!r}; it has {sorted(batch)}")
        device = logits.device
        cross = batch["xtok_row"].to(device) > 0
        _, _, sample_mask, mask = loss_mask(logits[..., 0], batch, who)
        loss = logits.new_zeros(())
        metrics: dict[str, float] = {}
        if not bool(cross.all()):  # rows of a same-tokenizer teacher: today's loss on them alone
            same_rows = dict(batch, token_mask=batch["token_mask"] * (~cross).to(batch["token_mask"].device)[:, None])
            loss, same_metrics = self.same(logits, same_rows, global_valid_seqs, global_valid_toks)
            metrics.update({k: v for k, v in same_metrics.items() if not k.startswith(("loss", "num_valid"))})

        cross_mask = mask * cross[:, None]
        shifted = logits[:, 1:].float()
        targets = batch["input_ids"][:, 1:].to(device).long()
        token_lp = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - shifted.logsumexp(-1)
        span = batch["xtok_span"][:, 1:].to(device)
        aligned = (span >= 0) & (cross_mask > 0)
        student_span, tokens = span_sums(token_lp, span, aligned)
        log_ratio = (student_span - batch["xtok_teacher_logprob"][:, 1:].to(device)).detach()
        # value r_s / n_s per token (the span's r_s once), gradient (r_s - b_s) * grad log p(token_j)
        baseline = batch["xtok_baseline"][:, 1:].to(device) if "xtok_baseline" in batch else torch.zeros_like(log_ratio)
        covered = batch["xtok_covered"][:, 1:].to(device) > 0 if "xtok_covered" in batch else torch.zeros_like(aligned)
        spanned = aligned & ~covered
        span_term = (log_ratio / tokens.clamp(min=1) + (log_ratio - baseline) * (token_lp - token_lp.detach())) * spanned

        match = (batch["xtok_match"][:, 1:].to(device) > 0) & aligned
        forward, reverse = shared_topk_kl(shifted, batch["teacher_topk_logits"][:, 1:].to(device),
                                          batch["teacher_topk_indices"][:, 1:].to(device),
                                          batch["teacher_topk_valid"][:, 1:].to(device) & match[..., None])
        kl_type, w = self.same.kl_type, self.same.mixed_kl_weight
        match_kl = forward if kl_type == "forward" else reverse if kl_type == "reverse" else w * forward + (1 - w) * reverse
        per_token = self.span_weight * span_term + self.match_weight * match_kl * match
        loss = loss + masked_mean(per_token, cross_mask, global_normalization_factor=global_valid_toks)

        with torch.no_grad():
            def token_sum_mean(values: torch.Tensor) -> float:
                return masked_mean(values, cross_mask, global_normalization_factor=global_valid_toks).item()

            metrics.update({
                "loss": loss.item(),
                "xtok_reverse_kl": token_sum_mean(log_ratio / tokens.clamp(min=1) * aligned),
                "xtok_match_kl": token_sum_mean(match_kl * match),
                "xtok_aligned_tokens": aligned.sum().item(),
                "xtok_match_tokens": match.sum().item(),
                "xtok_span_tokens": spanned.sum().item(),
                "num_valid_tokens": mask.sum().item(),
                "num_valid_samples": sample_mask.sum().item(),
            })
            if "task_index" in batch:  # each task's loss per token, over both kinds of rows
                task_index = batch["task_index"].to(device)
                token_loss = (per_token.detach() * cross_mask).sum(-1)
                for i in task_index.unique().tolist():
                    rows = task_index == i
                    metrics[f"kl_sum_task{i}"] = metrics.get(f"kl_sum_task{i}", 0.0) + token_loss[rows].sum().item()
                    metrics[f"kl_tokens_task{i}"] = metrics.get(f"kl_tokens_task{i}", 0.0) + cross_mask[rows].sum().item()
        return loss, metrics
