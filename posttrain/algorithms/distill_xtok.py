"""Distillation teachers whose tokenizer differs from the student's (cross-tokenizer on-policy
distillation).

Whether a teacher needs it is decided at set-up (`distillation.tokenizer_alignment`: `auto` compares
the two vocabularies, `same_vocabulary`). Such a teacher cannot read the student's token ids, so each
step, for each of its rows:

1. its prompt is the same data row rendered by the teacher's own tokenizer (chat template,
   `data.use_chat_template`, `data.system_prompt`: `teacher_prompts` builds the teacher's copy of
   the training split once, read by the row's index);
2. the student's response is decoded to text and tokenised by the teacher (`align_response`); the
   two token sequences are cut into aligned spans at the character offsets where both have a
   token boundary (`distill_xtok_align`);
3. the teacher scores its row in one forward: each of its tokens' log-probability and its top-k
   logits (`get_topk_logits(..., token_logprobs=True)`);
4. `student_targets` puts that back on the student's row: each response token gets its span's
   index and the teacher's log-probability of the span; a span whose teacher side is one token also
   gets, at each of its student tokens, the teacher's distribution of the next characters read as
   the student's next token (`NextTokenMap`).

`CrossTokenizerDistillationLoss` (`distill_xtok_loss.py`) turns that into the student's loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from posttrain.algorithms.distill_xtok_align import (
    NextTokenMap, RowAlignment, align_response, exact_match_map, next_token_map, same_vocabulary, token_pieces,
)
from posttrain.errors import UserError

ALIGNMENT_MODES = ("auto", "always", "never")
# Keys of the training batch the cross-tokenizer teachers add (per token [B, S] unless said).
XTOK_KEYS = ("xtok_span", "xtok_teacher_logprob", "xtok_match", "xtok_covered", "teacher_topk_valid", "xtok_row")


@dataclass
class CrossTokenizerTeacher:
    """What a teacher of another tokenizer needs besides its worker group."""

    tokenizer: Any
    prompts: Sequence[Any]  # the training split rendered by the teacher (datums by row index)
    val_prompts: list  # the validation split rendered by the teacher (its accuracy)
    to_student: torch.Tensor  # [teacher vocabulary] the student id of the same string, or -1
    next_tokens: NextTokenMap  # the teacher's next-token distribution read as the student's
    max_len: int  # teacher.max_total_sequence_length
    min_shared_mass: float = 0.5  # loss_fn.xtok_match_min_mass
    baseline: bool = True  # loss_fn.xtok_span_baseline


def needs_alignment(mode: str, key: str, student_tok: Any, teacher_tok: Any) -> bool:
    """Whether the teacher `key` reads the student's rows through text alignment: `always`, or `auto`
    with a vocabulary that differs from the student's. `never` refuses a differing vocabulary in one
    line (`UserError`)."""
    if mode not in ALIGNMENT_MODES:
        raise UserError(f"distillation.tokenizer_alignment={mode!r}; choose one of {', '.join(ALIGNMENT_MODES)}")
    same = same_vocabulary(student_tok, teacher_tok)
    if mode == "never" and not same:
        raise UserError(f"{key}'s tokenizer ({len(teacher_tok)} tokens) differs from the student's ({len(student_tok)}) "
                        "and distillation.tokenizer_alignment=never: set it to auto (the default) to align the two by text "
                        "(docs/algorithms.md)")
    return mode == "always" or (mode == "auto" and not same)


def alignment_problem(cfg: Any, key: str, teacher_tok: Any) -> Optional[str]:
    """Why the teacher `key` cannot be aligned by text with this config, or None."""
    d = cfg.distillation
    if d.max_rollout_turns > 1:
        return (f"distillation.max_rollout_turns={d.max_rollout_turns}: {key} has another tokenizer than the student, "
                "and a cross-tokenizer teacher scores single-turn answers only (set it to 1)")
    if not getattr(teacher_tok, "is_fast", False):
        return (f"{key}'s tokenizer is a slow (Python) tokenizer: aligning by text needs character offsets, which only "
                "a fast (tokenizers) one gives; convert it, or give a teacher with tokenizer.json")
    if teacher_tok.eos_token_id is None:
        return f"{key}'s tokenizer has no eos token: the student's end of answer has nothing to align with"
    section = cfg.teacher if key == "teacher" else cfg.teachers[key.split(".", 1)[1]]
    if section.pipeline_parallel_size > 1:
        return f"{key}.pipeline_parallel_size={section.pipeline_parallel_size}: a teacher gives full logits only with 1"
    return None


def teacher_prompts(cfg: Any, section: Any, tokenizer: Any) -> tuple[Sequence[Any], list]:
    """The training split (lazily built) and the validation split (at most `distillation.max_val_samples`)
    rendered by the teacher's tokenizer, with its `max_total_sequence_length`: the same rows, in the same
    order, as the student's (`job.build_datums`)."""
    from posttrain.data.processors import build_prompt_message_log
    from posttrain.job import build_datums

    as_teacher = cfg.model_copy(update={"policy": cfg.policy.model_copy(
        update={"max_total_sequence_length": section.max_total_sequence_length})})
    train = build_datums(as_teacher, build_prompt_message_log, tokenizer, "train", lazy=True)
    val = build_datums(as_teacher, build_prompt_message_log, tokenizer, "validation", cfg.distillation.max_val_samples)
    return train, val


def make_cross_teacher(cfg: Any, section: Any, student_tok: Any, teacher_tok: Any) -> CrossTokenizerTeacher:
    train, val = teacher_prompts(cfg, section, teacher_tok)
    to_student = exact_match_map(student_tok, teacher_tok)
    return CrossTokenizerTeacher(tokenizer=teacher_tok, prompts=train, val_prompts=val, to_student=to_student,
                                 next_tokens=next_token_map(student_tok, teacher_tok, to_student),
                                 max_len=section.max_total_sequence_length,
                                 min_shared_mass=cfg.loss_fn.xtok_match_min_mass,
                                 baseline=cfg.loss_fn.xtok_span_baseline)


# --------------------------------------------------------------------------------- each step
def teacher_batch(samples: Sequence[Any], student_tok: Any, teacher: CrossTokenizerTeacher) -> tuple[Any, list[RowAlignment]]:
    """The teacher's rows for the student's `samples` (prompt rendered by the teacher, then the
    student's response re-tokenised) and each row's alignment. A row the student's data masks out
    (an over-long prompt), or whose teacher prompt is over-long, gets no spans; spans past the
    teacher's `max_total_sequence_length` are dropped."""
    from posttrain.data.message_log import flatten_message_logs

    logs, alignments = [], []
    for sample in samples:
        prompt = teacher.prompts[sample.idx]
        if prompt.task_name != sample.task_name:  # the two renderings must be of one row
            raise RuntimeError(f"row {sample.idx}: the teacher's copy is of task {prompt.task_name!r}, "
                               f"the student's of {sample.task_name!r}")
        prompt_ids = prompt.message_log[0]["token_ids"]
        response = sample.message_log[1]["token_ids"] if len(sample.message_log) > 1 else torch.zeros(0, dtype=torch.long)
        teacher_ids, spans = align_response(student_tok, teacher.tokenizer, response.tolist(), teacher.to_student)
        room = max(teacher.max_len - prompt_ids.numel(), 0)
        if sample.loss_multiplier == 0 or prompt.loss_multiplier == 0:
            spans = []
        spans = [s for s in spans if s.t_hi <= room]
        logs.append([{"role": "user", "content": "", "token_ids": prompt_ids},
                     {"role": "assistant", "content": "", "token_ids": torch.tensor(teacher_ids[:room], dtype=torch.long)}])
        alignments.append(RowAlignment(student_start=sample.message_log[0]["token_ids"].numel(),
                                       teacher_start=prompt_ids.numel(), spans=spans,
                                       pieces=token_pieces(student_tok, response.tolist()),
                                       teacher_pieces=[teacher.next_tokens.strings[i] or "" if 0 <= i < len(
                                           teacher.next_tokens.strings) else "" for i in teacher_ids[:room]]))
    return flatten_message_logs(logs, pad_token_id=teacher.tokenizer.pad_token_id), alignments


def student_targets(alignments: Sequence[RowAlignment], scored: Mapping[str, torch.Tensor], seq_len: int,
                    next_tokens: NextTokenMap, min_shared_mass: float = 0.5,
                    generation_logprobs: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """The teacher's answer put on the student's rows (`[B, S]`, `[B, S, k]` aligned to the student's
    `input_ids`, S = `seq_len`):

    - `xtok_span` (long): the index of the span a response token is in (-1 elsewhere);
    - `xtok_teacher_logprob`: the teacher's log-probability of that span (the sum over its tokens);
    - `xtok_match`: 1.0 at a student token that has the teacher's next-token distribution: in a span
      whose teacher side is one token, the teacher's top-k there read through the text
      (`NextTokenMap.distribution`, after the span's earlier student tokens), where the student tokens
      it reaches hold at least `min_shared_mass` of the teacher's probability (of its tokens that start
      with those earlier tokens' text, after the first); below that the teacher means a continuation
      the student cannot spell in one token, and the rest, renormalised, would say the opposite;
    - `teacher_topk_logits`, `teacher_topk_indices`, `teacher_topk_valid` (bool): there, that
      distribution (log-probabilities over student ids, the most probable first; `valid` on the
      entries filled);
    - `xtok_covered`: 1.0 on the tokens of a span where every student token has it (the span term
      leaves those spans to the distribution term);
    - `xtok_row` `[B]`: 1.0 (rows of a cross-tokenizer teacher);
    - `xtok_baseline`: with the student's `generation_logprobs` `[B, S]`, each span's baseline: the mean
      log-ratio (student minus teacher, at generation) of the spans at the same place in their rows
      (the first span of the answer, the second, ...), else 0.

    `scored`: the teacher's `token_logprobs` and `logsumexp` `[B, T]`, `topk_logits` and `topk_indices` `[B, T, k]`."""
    rows, k = len(alignments), scored["topk_logits"].shape[-1]
    span_index = torch.full((rows, seq_len), -1, dtype=torch.long)
    teacher_logprob = torch.zeros(rows, seq_len)
    match = torch.zeros(rows, seq_len)
    covered = torch.zeros(rows, seq_len)
    topk_logits = torch.zeros(rows, seq_len, k)
    topk_indices = torch.zeros(rows, seq_len, k, dtype=torch.long)
    topk_valid = torch.zeros(rows, seq_len, k, dtype=torch.bool)
    ratios: dict[int, list[float]] = {}
    for b, row in enumerate(alignments):
        for n, span in enumerate(row.spans):
            s_lo, s_hi = row.student_start + span.s_lo, row.student_start + span.s_hi
            t_lo, t_hi = row.teacher_start + span.t_lo, row.teacher_start + span.t_hi
            span_index[b, s_lo:s_hi] = n
            teacher_logprob[b, s_lo:s_hi] = scored["token_logprobs"][b, t_lo:t_hi].sum()
            if generation_logprobs is not None:
                ratios.setdefault(n, []).append(float(generation_logprobs[b, s_lo:s_hi].sum() - teacher_logprob[b, s_lo]))
            if t_hi - t_lo != 1:
                continue
            ids, logprobs = topk_at(scored, b, t_lo)
            before = row.teacher_pieces[span.t_lo - 1] if 0 < span.t_lo <= len(row.teacher_pieces) else ""
            prefix, every = "", True
            for j in range(span.s_lo, span.s_hi):
                if j == span.s_lo and before:  # at a teacher boundary: its token before may go on (`after_token`)
                    dist, reference = next_tokens.after_token(topk_at(scored, b, t_lo - 1), before,
                                                              float(scored["token_logprobs"][b, t_lo - 1]), ids, logprobs)
                else:
                    dist, reference = next_tokens.distribution(ids, logprobs, prefix)
                piece = row.pieces[j] if j < len(row.pieces) else ""
                prefix += piece
                if not dist or sum(dist.values()) < min_shared_mass * reference or (not piece and j < span.s_hi - 1):
                    every = False
                    continue
                entries = sorted(dist.items(), key=lambda item: -item[1])[:k]
                at = row.student_start + j
                match[b, at] = 1.0
                topk_indices[b, at, :len(entries)] = torch.tensor([i for i, _ in entries])
                topk_logits[b, at, :len(entries)] = torch.tensor([p for _, p in entries]).log()
                topk_valid[b, at, :len(entries)] = True
            if every:
                covered[b, s_lo:s_hi] = 1.0
    baseline = torch.zeros(rows, seq_len)
    for n, values in ratios.items():
        baseline[span_index == n] = sum(values) / len(values)
    return {"xtok_span": span_index, "xtok_teacher_logprob": teacher_logprob, "xtok_match": match,
            "xtok_covered": covered, "teacher_topk_logits": topk_logits, "teacher_topk_indices": topk_indices,
            "teacher_topk_valid": topk_valid, "xtok_row": torch.ones(rows), "xtok_baseline": baseline}


def topk_at(scored: Mapping[str, torch.Tensor], row: int, position: int) -> tuple[list[int], list[float]]:
    """The teacher's top-k ids and log-probabilities at `position` of `row`."""
    return (scored["topk_indices"][row, position].tolist(),
            (scored["topk_logits"][row, position] - scored["logsumexp"][row, position]).tolist())


def score_cross_tokenizer(policy: Any, teacher: CrossTokenizerTeacher, samples: Sequence[Any], student_tok: Any,
                          seq_len: int, k: int, temperature: float,
                          generation_logprobs: Optional[torch.Tensor] = None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One cross-tokenizer teacher's answer for `samples` (its rows of the step), on the student's rows
    (`student_targets`), and counts for the step's metrics (`xtok/spans`, `xtok/exact_match_spans`,
    `xtok/teacher_tokens`)."""
    batch, alignments = teacher_batch(samples, student_tok, teacher)
    scored = policy.get_topk_logits(batch, k, temperature, token_logprobs=True)
    spans = [s for row in alignments for s in row.spans]
    targets = student_targets(alignments, scored, seq_len, teacher.next_tokens, teacher.min_shared_mass,
                              generation_logprobs if teacher.baseline else None)
    covered = targets["xtok_covered"] * (targets["xtok_span"] >= 0)
    counts = {"xtok/spans": float(len(spans)), "xtok/exact_match_spans": float(sum(s.match for s in spans)),
              "xtok/multi_token_spans": float(sum(s.s_hi - s.s_lo > 1 or s.t_hi - s.t_lo > 1 for s in spans)),
              "xtok/student_tokens": float(sum(s.s_hi - s.s_lo for s in spans)),
              "xtok/distribution_tokens": float(targets["xtok_match"].sum()),
              "xtok/covered_tokens": float(covered.sum()),
              "xtok/teacher_tokens": float(sum(s.t_hi - s.t_lo for s in spans))}
    return targets, counts


def all_teachers_targets(train_data: Any, samples: Sequence[Any], routes: Mapping[str, list[int]], teachers: Mapping[str, Any],
                         cross: Mapping[str, CrossTokenizerTeacher], student_tok: Any, k: int,
                         temperature: float) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Every teacher's answer on its rows (`routes`: teacher key -> row indices), in the rows' order:
    a same-tokenizer teacher's top-k as today (`get_topk_logits` on the student's rows), a
    cross-tokenizer one's through `score_cross_tokenizer`; the cross keys (`XTOK_KEYS`) are 0 / -1 on
    the other rows."""
    rows, seq_len = train_data["input_ids"].shape
    out: dict[str, torch.Tensor] = {
        "teacher_topk_logits": torch.zeros(rows, seq_len, k), "teacher_topk_indices": torch.zeros(rows, seq_len, k, dtype=torch.long),
        "teacher_topk_valid": torch.zeros(rows, seq_len, k, dtype=torch.bool),
        "xtok_span": torch.full((rows, seq_len), -1, dtype=torch.long), "xtok_teacher_logprob": torch.zeros(rows, seq_len),
        "xtok_match": torch.zeros(rows, seq_len), "xtok_covered": torch.zeros(rows, seq_len), "xtok_row": torch.zeros(rows),
        "xtok_baseline": torch.zeros(rows, seq_len),
    }
    counts: dict[str, float] = {}
    for key, indices in routes.items():
        index = torch.tensor(indices)
        if key in cross:
            part, part_counts = score_cross_tokenizer(teachers[key], cross[key], [samples[i] for i in indices], student_tok,
                                                      seq_len, k, temperature, train_data["generation_logprobs"][index])
            for name, value in part_counts.items():
                counts[name] = counts.get(name, 0.0) + value
        else:
            top = teachers[key].get_topk_logits(train_data.select(indices), k, temperature)
            part = {"teacher_topk_logits": top["topk_logits"], "teacher_topk_indices": top["topk_indices"]}
        for name, values in part.items():
            if values.ndim == 1:
                out[name][index] = values
            else:
                out[name][index, :values.shape[1]] = values
    return out, counts
