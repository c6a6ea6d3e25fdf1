"""Cross-tokenizer distillation: the text alignment of two tokenisations (`distill_xtok_align`), the
teacher's answer put back on the student's rows (`distill_xtok.student_targets`) and the loss
(`CrossTokenizerDistillationLoss`), with exact values on hand-made sequences."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithms.distill_loss import DistillationLoss
from posttrain.algorithms.distill_xtok import alignment_problem, needs_alignment, student_targets
from posttrain.algorithms.distill_xtok_align import (
    RowAlignment, Span, align_response, align_spans, decoded_token_ends, exact_match_map, next_token_map, offset_ends,
    same_vocabulary, token_pieces,
)
from posttrain.algorithms.distill_xtok_loss import CrossTokenizerDistillationLoss, shared_topk_kl, span_sums
from posttrain.config.loader import load_config
from posttrain.errors import UserError
from posttrain.models.tiny import build_pairs_tokenizer, build_tokenizer

CHAR, PAIRS = build_tokenizer(), build_pairs_tokenizer()


# ------------------------------------------------------------------------------------ alignment
def test_spans_cut_where_both_tokenisations_have_a_boundary():
    # "12+34=46": characters (ends 1..8) against digit pairs (12 | + | 34 | = | 46).
    assert align_spans([1, 2, 3, 4, 5, 6, 7, 8], [2, 3, 5, 6, 8], 8) == [
        (0, 2, 0, 1), (2, 3, 1, 2), (3, 5, 2, 3), (5, 6, 3, 4), (6, 8, 4, 5)]
    # No common boundary inside the text: one span of everything.
    assert align_spans([2, 4], [1, 3, 4], 4) == [(0, 2, 0, 3)]
    # A token without a boundary after it (None) joins the next one's span.
    assert align_spans([1, 2, 3], [None, 2, 3], 3) == [(0, 2, 0, 2), (2, 3, 2, 3)]
    assert align_spans([1, None, 3], [2, 3], 3) == [(0, 3, 0, 2)]
    # A zero-width token (end 0) belongs to the first span; empty sequences give no spans.
    assert align_spans([0, 2, 3], [2, 3], 3) == [(0, 2, 0, 1), (2, 3, 1, 2)]
    assert align_spans([], [1], 1) == [] and align_spans([1], [], 1) == []
    # The teacher dropped the last character: the student's last token joins the last span.
    assert align_spans([1, 2, 3], [1, 2], 3) == [(0, 1, 0, 1), (1, 3, 1, 2)]


def test_offset_ends_allow_a_boundary_only_where_no_later_token_starts_before_it():
    # Two tokens of one multi-byte character share its offsets (byte-level BPE): no cut between them.
    assert offset_ends([(0, 1), (1, 2), (1, 2), (2, 4)]) == [1, None, 2, 4]
    assert offset_ends([(0, 2), (2, 3)]) == [2, 3]
    assert offset_ends([]) == []


def test_decoded_token_ends_from_the_students_own_tokens():
    ids = CHAR("ab+1", add_special_tokens=False)["input_ids"]
    assert decoded_token_ends(CHAR, ids) == ("ab+1", [1, 2, 3, 4])

    class Joining:  # a decoder that joins pieces ("x" + "y" decodes to "Z"): no boundary after "x"
        def decode(self, ids, **_):
            text = "".join({1: "x", 2: "y", 3: "w"}[i] for i in ids)
            return text.replace("xy", "Z")

    assert decoded_token_ends(Joining(), [3, 1, 2, 3]) == ("wZw", [1, None, 2, 3])


def test_a_response_is_re_tokenised_by_the_teacher_and_aligned():
    to_student = exact_match_map(CHAR, PAIRS)
    # A 3-digit answer: its hundreds and tens are one teacher token (a span of 2 student tokens).
    response = CHAR("123", add_special_tokens=False)["input_ids"] + [CHAR.eos_token_id]
    teacher_ids, spans = align_response(CHAR, PAIRS, response, to_student)
    assert PAIRS.convert_ids_to_tokens(teacher_ids) == ["12", "3", "<|im_end|>"]
    assert spans == [Span(0, 2, 0, 1, False), Span(2, 3, 1, 2, True), Span(3, 4, 2, 3, True)]  # eos <-> eos
    # A 2-digit answer: one shared token each side per character.
    response = CHAR("85", add_special_tokens=False)["input_ids"] + [CHAR.eos_token_id]
    teacher_ids, spans = align_response(CHAR, PAIRS, response, to_student)
    assert PAIRS.convert_ids_to_tokens(teacher_ids) == ["8", "5", "<|im_end|>"]
    assert spans == [Span(0, 1, 0, 1, True), Span(1, 2, 1, 2, True), Span(2, 3, 2, 3, True)]
    response = CHAR("123+4", add_special_tokens=False)["input_ids"] + [CHAR.eos_token_id]
    teacher_ids, spans = align_response(CHAR, PAIRS, response, to_student)
    assert PAIRS.convert_ids_to_tokens(teacher_ids) == ["12", "3", "+", "4", "<|im_end|>"]
    assert spans == [Span(0, 2, 0, 1, False), Span(2, 3, 1, 2, True), Span(3, 4, 2, 3, True),
                     Span(4, 5, 3, 4, True), Span(5, 6, 4, 5, True)]
    # Without a final eos (cut at max_new_tokens) there is no end span.
    teacher_ids, spans = align_response(CHAR, PAIRS, CHAR("1234", add_special_tokens=False)["input_ids"], to_student)
    assert PAIRS.convert_ids_to_tokens(teacher_ids) == ["12", "3", "4"]
    assert spans == [Span(0, 2, 0, 1, False), Span(2, 3, 1, 2, True), Span(3, 4, 2, 3, True)]
    assert align_response(CHAR, PAIRS, [CHAR.eos_token_id], to_student) == ([PAIRS.eos_token_id], [Span(0, 1, 0, 1, True)])


def test_token_pieces_are_each_tokens_characters():
    assert token_pieces(CHAR, CHAR("12+", add_special_tokens=False)["input_ids"] + [CHAR.eos_token_id]) == [
        "1", "2", "+", ""]
    assert token_pieces(PAIRS, PAIRS("123", add_special_tokens=False)["input_ids"]) == ["12", "3"]
    assert token_pieces(CHAR, []) == [] and token_pieces(CHAR, [CHAR.eos_token_id]) == [""]


def test_the_teachers_next_token_distribution_read_through_the_text():
    reading = next_token_map(CHAR, PAIRS)
    ids = [PAIRS.convert_tokens_to_ids(t) for t in ("12", "13", "1", "8", "<|im_end|>", "<|im_start|>")]
    logprobs = [math.log(p) for p in (0.4, 0.2, 0.1, 0.15, 0.1, 0.05)]
    char = CHAR.convert_tokens_to_ids
    # The answer's first character: every teacher token starting with "1" counts for the student's "1".
    dist, reference = reading.distribution(ids, logprobs, "")
    assert dist.keys() == {char("1"), char("8"), CHAR.eos_token_id} and reference == 1.0
    assert dist[char("1")] == pytest.approx(0.7) and dist[char("8")] == pytest.approx(0.15)
    assert dist[CHAR.eos_token_id] == pytest.approx(0.1)  # <|im_start|> (special, not the eos): left out
    # After "1": the teacher's "12" against "13"; its lone "1" ends here (its next token would tell).
    dist, reference = reading.distribution(ids, logprobs, "1")
    assert dist == pytest.approx({char("2"): 0.4, char("3"): 0.2}) and reference == pytest.approx(0.7)
    assert reading.distribution(ids, logprobs, "9") == ({}, 0.0)
    # After the teacher's token "1" (a 3-digit answer is likelier: its "14"), the next character is
    # "4" from "14", or what the teacher writes after a lone "1" (eos 0.9, "5" 0.1) times its 0.05.
    before = ([PAIRS.convert_tokens_to_ids(t) for t in ("14", "1", "8")], [math.log(p) for p in (0.8, 0.05, 0.1)])
    after = ([PAIRS.eos_token_id, PAIRS.convert_tokens_to_ids("5")], [math.log(0.9), math.log(0.1)])
    dist, reference = reading.after_token(before, "1", math.log(0.05), *after)
    assert dist == pytest.approx({char("4"): 0.8, CHAR.eos_token_id: 0.045, char("5"): 0.005})
    assert reference == pytest.approx(0.85)
    assert reading.student_first("7x") == char("7") and reading.student_first("\u00e9") == -1  # <unk>: none


def test_exact_match_vocabulary_maps_shared_strings_and_the_two_eos():
    to_student = exact_match_map(CHAR, PAIRS)
    assert to_student.shape == (len(PAIRS),) == (201,)
    # The 96 characters, <pad>, <unk>, <bos> and eos: 100 shared; no digit pair and no <|im_start|>.
    assert int((to_student >= 0).sum()) == 100
    assert int(to_student[PAIRS.convert_tokens_to_ids("7")]) == CHAR.convert_tokens_to_ids("7")
    assert int(to_student[PAIRS.convert_tokens_to_ids("77")]) == -1
    assert int(to_student[PAIRS.convert_tokens_to_ids("<|im_start|>")]) == -1
    assert int(to_student[PAIRS.eos_token_id]) == CHAR.eos_token_id
    assert same_vocabulary(CHAR, build_tokenizer()) and not same_vocabulary(CHAR, PAIRS)
    identity = exact_match_map(CHAR, CHAR)
    assert identity.tolist() == list(range(len(CHAR)))


# ------------------------------------------------------------------------------------ detection
def test_alignment_is_decided_by_the_vocabularies_or_the_key():
    assert needs_alignment("auto", "teacher", CHAR, PAIRS) and not needs_alignment("auto", "teacher", CHAR, CHAR)
    assert needs_alignment("always", "teacher", CHAR, CHAR)
    assert not needs_alignment("never", "teacher", CHAR, CHAR)
    with pytest.raises(UserError, match=r"^teacher's tokenizer \(201 tokens\) differs from the student's \(103\) and "
                                        r"distillation.tokenizer_alignment=never"):
        needs_alignment("never", "teacher", CHAR, PAIRS)


def test_what_cannot_be_aligned_is_refused_in_one_line():
    cfg = load_config("distill", overrides=["distillation.max_rollout_turns=2", "teachers={math: {model_name: tiny}}"])
    assert alignment_problem(cfg, "teacher", PAIRS).startswith(
        "distillation.max_rollout_turns=2: teacher has another tokenizer than the student")
    single = load_config("distill")
    assert alignment_problem(single, "teacher", PAIRS) is None
    assert "slow (Python) tokenizer" in alignment_problem(single, "teacher", object())
    piped = load_config("distill", overrides=["teacher.pipeline_parallel_size=2", "teacher.num_workers=2"])
    assert alignment_problem(piped, "teacher", PAIRS).startswith("teacher.pipeline_parallel_size=2")


# ------------------------------------------------------------------------------ student targets
def test_the_teachers_answer_lands_on_the_students_tokens():
    # Student row: 2 prompt tokens, response "12+" (3 tokens); teacher row: 3 prompt tokens, "12", "+".
    row = RowAlignment(student_start=2, teacher_start=3, spans=[Span(0, 2, 0, 1, False), Span(2, 3, 1, 2, True)],
                       pieces=["1", "2", "+"])
    t = PAIRS.convert_tokens_to_ids
    c = CHAR.convert_tokens_to_ids
    token_logprobs = torch.tensor([[0.0, -9.0, -9.0, -0.25, -0.5, -9.0]])
    topk_logits = torch.full((1, 6, 3), -20.0)
    topk_indices = torch.zeros(1, 6, 3, dtype=torch.long)
    # At "12": the teacher's top-3 "12", "1", "8" (probabilities 0.5, 0.25, 0.25 of its whole distribution).
    topk_logits[0, 3] = torch.tensor([0.5, 0.25, 0.25]).log()
    topk_indices[0, 3] = torch.tensor([t("12"), t("1"), t("8")])
    # At "+": "+", "<|im_start|>" (special, no student counterpart), "7".
    topk_logits[0, 4] = torch.tensor([0.6, 0.3, 0.1]).log()
    topk_indices[0, 4] = torch.tensor([t("+"), t("<|im_start|>"), t("7")])
    scored = {"token_logprobs": token_logprobs, "topk_logits": topk_logits, "topk_indices": topk_indices,
              "logsumexp": torch.zeros(1, 6)}
    reading = next_token_map(CHAR, PAIRS)
    out = student_targets([row], scored, seq_len=6, next_tokens=reading)
    assert out["xtok_span"].tolist() == [[-1, -1, 0, 0, 1, -1]]
    assert out["xtok_teacher_logprob"].tolist() == [[0.0, 0.0, -0.25, -0.25, -0.5, 0.0]]
    assert out["xtok_match"].tolist() == [[0.0, 0.0, 1.0, 1.0, 1.0, 0.0]]
    assert out["xtok_covered"].tolist() == [[0.0, 0.0, 1.0, 1.0, 1.0, 0.0]]
    # "1": 0.75 ("12", "1"), "8": 0.25; after "1": "2" 0.5 alone (the lone "1" ends there); "+": 0.6
    # against "7": 0.1.
    assert out["teacher_topk_indices"][0, 2].tolist() == [c("1"), c("8"), 0]
    assert out["teacher_topk_logits"][0, 2, :2].exp().tolist() == pytest.approx([0.75, 0.25])
    assert out["teacher_topk_valid"][0, 2].tolist() == [True, True, False]
    assert out["teacher_topk_indices"][0, 3, 0].item() == c("2") and out["teacher_topk_valid"][0, 3].sum() == 1
    assert out["teacher_topk_logits"][0, 3, 0].exp().item() == pytest.approx(0.5)
    assert out["teacher_topk_indices"][0, 4, :2].tolist() == [c("+"), c("7")]
    assert out["teacher_topk_logits"][0, 4, :2].exp().tolist() == pytest.approx([0.6, 0.1])
    assert not out["teacher_topk_valid"][0, :2].any() and out["xtok_row"].tolist() == [1.0]
    # With the generation's log-probabilities, each span's baseline is the mean log-ratio of the spans
    # at its place: one row here, so its own (-0.75 - -0.25 and -1.0 - -0.5).
    generated = torch.tensor([[0.0, 0.0, -0.5, -0.25, -1.0, 0.0]])
    with_baseline = student_targets([row, row], {k: v.expand(2, *v.shape[1:]) for k, v in scored.items()}, seq_len=6,
                                    next_tokens=reading, generation_logprobs=torch.cat([generated, generated - 1.0]))
    assert with_baseline["xtok_baseline"].tolist() == [[0.0, 0.0, -1.5, -1.5, -1.0, 0.0]] * 2  # means of 2 rows
    assert out["xtok_baseline"].abs().sum() == 0
    # Below the teacher's mass the student's tokens reach, a token loses the distribution term and its
    # span is left to the span term: "1" reaches all of it, "+" 0.7, "2" after "1" 0.5 of 0.75.
    strict = student_targets([row], scored, seq_len=6, next_tokens=reading, min_shared_mass=0.68)
    assert strict["xtok_match"].tolist() == [[0.0, 0.0, 1.0, 0.0, 1.0, 0.0]]
    assert strict["xtok_covered"].tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]
    stricter = student_targets([row], scored, seq_len=6, next_tokens=reading, min_shared_mass=0.8)
    assert stricter["xtok_match"].tolist() == [[0.0, 0.0, 1.0, 0.0, 0.0, 0.0]] and stricter["xtok_covered"].sum() == 0
    assert strict["xtok_span"].tolist() == out["xtok_span"].tolist()
    # With the teacher's token texts, the "+" after its "12" (log-probability -0.25, no longer token
    # starting with "12" in its top-k) gets the distribution there times e^-0.25: the same once renormalised.
    texts = RowAlignment(row.student_start, row.teacher_start, row.spans, row.pieces, teacher_pieces=["12", "+"])
    boundary = student_targets([texts], scored, seq_len=6, next_tokens=reading)
    assert boundary["teacher_topk_logits"][0, 4, :2].exp().tolist() == pytest.approx([0.6 * math.exp(-0.25),
                                                                                      0.1 * math.exp(-0.25)])
    assert boundary["xtok_match"].tolist() == out["xtok_match"].tolist()
    # A span of two teacher tokens has no distribution term.
    two = RowAlignment(student_start=2, teacher_start=3, spans=[Span(0, 3, 0, 2, False)], pieces=["1", "2", "+"])
    assert student_targets([two], scored, seq_len=6, next_tokens=reading)["xtok_match"].sum() == 0


# ------------------------------------------------------------------------------------------ loss
def cross_batch() -> dict:
    """One row: a prompt token, then 3 response tokens (ids 0, 1, 2): span 0 = tokens 1-2 (teacher
    log-probability -1.0), span 1 = token 3 (-0.5), an exact match whose teacher top-3 over student
    ids (0, 1, 2) has logits (2, 0, 1) and id 2 not shared."""
    k = 3
    batch = {
        "input_ids": torch.tensor([[0, 0, 1, 2]]),
        "token_mask": torch.tensor([[0.0, 1.0, 1.0, 1.0]]),
        "sample_mask": torch.tensor([1.0]),
        "xtok_row": torch.tensor([1.0]),
        "xtok_span": torch.tensor([[-1, 0, 0, 1]]),
        "xtok_teacher_logprob": torch.tensor([[0.0, -1.0, -1.0, -0.5]]),
        "xtok_match": torch.tensor([[0.0, 0.0, 0.0, 1.0]]),
        "teacher_topk_logits": torch.zeros(1, 4, k),
        "teacher_topk_indices": torch.zeros(1, 4, k, dtype=torch.long),
        "teacher_topk_valid": torch.zeros(1, 4, k, dtype=torch.bool),
    }
    batch["teacher_topk_logits"][0, 3] = torch.tensor([2.0, 0.0, 1.0])
    batch["teacher_topk_indices"][0, 3] = torch.tensor([0, 1, 2])
    batch["teacher_topk_valid"][0, 3] = torch.tensor([True, True, False])
    return batch


def test_span_sums_group_tokens_by_span():
    values = torch.tensor([[1.0, 2.0, 4.0, 8.0]])
    sums, counts = span_sums(values, torch.tensor([[-1, 0, 0, 1]]), torch.tensor([[False, True, True, True]]))
    assert sums.tolist() == [[6.0, 6.0, 6.0, 8.0]] and counts.tolist() == [[2.0, 2.0, 2.0, 1.0]]


def test_loss_value_and_gradient_on_a_hand_made_row():
    logits = torch.zeros(1, 4, 3, requires_grad=True)  # uniform student: log p = -ln 3 per token
    loss, metrics = CrossTokenizerDistillationLoss()(logits, cross_batch(), 1, 3)
    r0, r1 = -2 * math.log(3) + 1.0, -math.log(3) + 0.5  # span log-ratios, student minus teacher
    q = torch.softmax(torch.tensor([2.0, 0.0]), 0)  # the teacher over the two shared tokens
    match_kl = float((q * (q.log() - math.log(0.5))).sum())  # forward KL to the uniform student there
    assert loss.item() == pytest.approx((r0 + r1 + match_kl) / 3, abs=1e-6)
    assert metrics["xtok_reverse_kl"] == pytest.approx((r0 + r1) / 3, abs=1e-6)
    assert metrics["xtok_match_kl"] == pytest.approx(match_kl / 3, abs=1e-6)
    assert (metrics["xtok_aligned_tokens"], metrics["xtok_match_tokens"], metrics["num_valid_tokens"]) == (3, 1, 3)
    loss.backward()
    uniform = torch.full((3,), 1 / 3)
    # Span tokens: r_s / 3 x (one-hot(token) - p); the matched token adds the top-k KL's gradient.
    expected_1 = r0 / 3 * (torch.nn.functional.one_hot(torch.tensor(0), 3) - uniform)
    expected_2 = r0 / 3 * (torch.nn.functional.one_hot(torch.tensor(1), 3) - uniform)
    expected_3 = r1 / 3 * (torch.nn.functional.one_hot(torch.tensor(2), 3) - uniform)
    expected_3[:2] += (torch.full((2,), 0.5) - q) / 3  # forward KL over the shared pair: p - q
    assert torch.allclose(logits.grad[0, 1], expected_1, atol=1e-6)
    assert torch.allclose(logits.grad[0, 2], expected_2, atol=1e-6)
    assert torch.allclose(logits.grad[0, 3], expected_3, atol=1e-6)
    assert logits.grad[0, 0].abs().sum() == 0


def test_weights_and_reverse_kl_type():
    logits = torch.zeros(1, 4, 3)
    span_only, _ = CrossTokenizerDistillationLoss(match_weight=0.0)(logits, cross_batch(), 1, 3)
    assert span_only.item() == pytest.approx((-3 * math.log(3) + 1.5) / 3, abs=1e-6)
    reverse, metrics = CrossTokenizerDistillationLoss(kl_type="reverse", span_weight=0.0)(logits, cross_batch(), 1, 3)
    q = torch.softmax(torch.tensor([2.0, 0.0]), 0)
    assert reverse.item() == pytest.approx(float((0.5 * (math.log(0.5) - q.log())).sum()) / 3, abs=1e-6)
    with pytest.raises(ValueError, match="must be >= 0"):
        CrossTokenizerDistillationLoss(span_weight=-1.0)


def test_one_token_spans_of_one_vocabulary_give_the_top_k_kl_of_todays_loss():
    # tokenizer_alignment=always with the student's own tokenizer: every span is one shared token,
    # and the exact-match term is DistillationLoss's forward KL over the renormalised top-k.
    torch.manual_seed(0)
    logits, teacher = torch.randn(2, 5, 7), torch.randn(2, 5, 3)
    indices = torch.stack([torch.randperm(7)[:3] for _ in range(10)]).view(2, 5, 3)
    base = {"input_ids": torch.randint(0, 7, (2, 5)), "token_mask": torch.tensor([[0.0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]),
            "sample_mask": torch.ones(2), "teacher_topk_logits": teacher, "teacher_topk_indices": indices}
    today, _ = DistillationLoss()(logits, base, 2, 6)
    cross = {**base, "xtok_row": torch.ones(2), "xtok_span": torch.arange(5).expand(2, 5).clone(),
             "xtok_teacher_logprob": torch.zeros(2, 5), "xtok_match": torch.ones(2, 5),
             "teacher_topk_valid": torch.ones(2, 5, 3, dtype=torch.bool)}
    aligned, _ = CrossTokenizerDistillationLoss(span_weight=0.0)(logits, cross, 2, 6)
    assert aligned.item() == pytest.approx(today.item(), abs=1e-6)
    forward, _ = shared_topk_kl(logits, teacher, indices, torch.zeros(2, 5, 3, dtype=torch.bool))
    assert forward.abs().sum() == 0  # nothing shared: no term (and no NaN)


def test_rows_of_both_kinds_of_teacher_add_in_one_step():
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 3)
    same = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "token_mask": torch.tensor([[0.0, 1, 1, 1]]),
            "sample_mask": torch.ones(1), "teacher_topk_logits": torch.randn(1, 4, 3),
            "teacher_topk_indices": torch.tensor([[[0, 1, 2]] * 4])}
    cross = cross_batch()
    mixed = {"input_ids": torch.cat([same["input_ids"], cross["input_ids"]]),
             "token_mask": torch.cat([same["token_mask"], cross["token_mask"]]), "sample_mask": torch.ones(2),
             "teacher_topk_logits": torch.cat([same["teacher_topk_logits"], cross["teacher_topk_logits"]]),
             "teacher_topk_indices": torch.cat([same["teacher_topk_indices"], cross["teacher_topk_indices"]]),
             "teacher_topk_valid": torch.cat([torch.zeros(1, 4, 3, dtype=torch.bool), cross["teacher_topk_valid"]]),
             "xtok_row": torch.tensor([0.0, 1.0]), "xtok_span": torch.cat([torch.full((1, 4), -1), cross["xtok_span"]]),
             "xtok_teacher_logprob": torch.cat([torch.zeros(1, 4), cross["xtok_teacher_logprob"]]),
             "xtok_match": torch.cat([torch.zeros(1, 4), cross["xtok_match"]]), "task_index": torch.tensor([0, 1])}
    total, metrics = CrossTokenizerDistillationLoss()(logits, mixed, 2, 6)
    today, _ = DistillationLoss()(logits[:1], same, 1, 6)
    aligned, _ = CrossTokenizerDistillationLoss()(logits[1:], cross, 1, 6)
    assert total.item() == pytest.approx(today.item() + aligned.item(), abs=1e-6)
    assert metrics["kl_tokens_task0"] == metrics["kl_tokens_task1"] == 3
    assert (metrics["kl_sum_task0"] + metrics["kl_sum_task1"]) / 6 == pytest.approx(total.item(), abs=1e-6)


def test_teachers_of_another_tokenizer_are_found_and_refused_before_any_worker_starts(tmp_path, monkeypatch):
    from posttrain.algorithms.distill import cross_tokenizer_keys

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    base = ["sft_warmup=null", "teacher_warmup=null", "policy.model_name=tiny", "distillation.tokenizer_alignment=auto"]
    found = cross_tokenizer_keys(load_config("distill", overrides=[*base, "teacher.model_name=tiny-pairs"]))
    assert list(found) == ["teacher"] and len(found["teacher"]) == 201
    assert cross_tokenizer_keys(load_config("distill", overrides=[*base, "teacher.model_name=tiny-qwen2"])) == {}
    with pytest.raises(UserError, match=r"^distillation.max_rollout_turns=2: teacher has another tokenizer"):
        cross_tokenizer_keys(load_config("distill", overrides=[*base, "teacher.model_name=tiny-pairs",
                                                                "distillation.max_rollout_turns=2"]))


def test_the_digit_pair_tokenizer_and_its_model_names():
    from posttrain.models.paths import model_vocab_size, parse_tiny_name, tiny_tokenizer_kind

    # Only the two digits a text starts with pair up, and only before a third: a 3-digit answer's
    # hundreds and tens, not a 2-digit answer, nor a prompt's operands.
    encoded = PAIRS("123+45=", add_special_tokens=False)
    assert PAIRS.convert_ids_to_tokens(encoded["input_ids"]) == ["12", "3", "+", "4", "5", "="]
    assert PAIRS.convert_ids_to_tokens(PAIRS("85", add_special_tokens=False)["input_ids"]) == ["8", "5"]
    assert PAIRS.decode(encoded["input_ids"]) == "123+45="
    encoded = PAIRS("<|im_start|>user\n47+38=", add_special_tokens=False)
    assert PAIRS.convert_ids_to_tokens(encoded["input_ids"]) == [
        "<|im_start|>", "u", "s", "e", "r", "\n", "4", "7", "+", "3", "8", "="]
    prompt = PAIRS.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    assert (PAIRS.pad_token_id, PAIRS.eos_token_id, PAIRS.eos_token) == (0, 3, "<|im_end|>")
    assert [parse_tiny_name(n) for n in ("small-pairs", "small-qwen2-pairs", "small-pairs-qwen2", "small-x")] == [
        ("small", "llama"), ("small", "qwen2"), None, None]
    assert [tiny_tokenizer_kind(n) for n in ("small-pairs", "small", "pairs")] == ["pairs", "char", "char"]
    assert model_vocab_size("small-pairs") == 201 and model_vocab_size("small") == 103


def test_the_baseline_changes_the_gradient_not_the_value():
    batch = cross_batch()
    batch["xtok_baseline"] = torch.tensor([[0.0, 0.25, 0.25, -0.5]])
    plain, with_baseline = torch.zeros(1, 4, 3, requires_grad=True), torch.zeros(1, 4, 3, requires_grad=True)
    loss = CrossTokenizerDistillationLoss(match_weight=0.0)
    value, _ = loss(plain, cross_batch(), 1, 3)
    value_b, _ = loss(with_baseline, batch, 1, 3)
    assert value.item() == pytest.approx(value_b.item(), abs=1e-7)
    value.backward()
    value_b.backward()
    r0, r1 = -2 * math.log(3) + 1.0, -math.log(3) + 0.5
    assert torch.allclose(with_baseline.grad[0, 1], plain.grad[0, 1] * (r0 - 0.25) / r0, atol=1e-6)
    assert torch.allclose(with_baseline.grad[0, 3], plain.grad[0, 3] * (r1 + 0.5) / r1, atol=1e-6)


def test_a_span_the_teachers_distribution_covers_has_no_span_term():
    # Span 1 (token 3) is covered: only the distribution term there; span 0 keeps its span term.
    batch = {**cross_batch(), "xtok_covered": torch.tensor([[0.0, 0.0, 0.0, 1.0]])}
    logits = torch.zeros(1, 4, 3, requires_grad=True)
    loss, metrics = CrossTokenizerDistillationLoss()(logits, batch, 1, 3)
    r0, r1 = -2 * math.log(3) + 1.0, -math.log(3) + 0.5
    q = torch.softmax(torch.tensor([2.0, 0.0]), 0)
    match_kl = float((q * (q.log() - math.log(0.5))).sum())
    assert loss.item() == pytest.approx((r0 + match_kl) / 3, abs=1e-6)
    assert metrics["xtok_reverse_kl"] == pytest.approx((r0 + r1) / 3, abs=1e-6)  # still over every span
    assert (metrics["xtok_span_tokens"], metrics["xtok_match_tokens"]) == (2, 1)
    loss.backward()
    expected_3 = torch.zeros(3)
    expected_3[:2] = (torch.full((2,), 0.5) - q) / 3  # the forward KL's gradient alone
    assert torch.allclose(logits.grad[0, 3], expected_3, atol=1e-6)


def test_gradient_steps_move_the_student_toward_the_teacher():
    # Two rows answering the same token 1 after a prompt token, each a span of its own: the teacher
    # gives it -0.1 in row 0 (likes it) and -3.0 in row 1; the baseline is the rows' mean log-ratio.
    p = -math.log(3)  # a uniform student
    batch = {"input_ids": torch.tensor([[0, 1], [0, 1]]), "token_mask": torch.tensor([[0.0, 1.0], [0.0, 1.0]]),
             "sample_mask": torch.ones(2), "xtok_row": torch.ones(2), "xtok_span": torch.tensor([[-1, 0], [-1, 0]]),
             "xtok_teacher_logprob": torch.tensor([[0.0, -0.1], [0.0, -3.0]]), "xtok_match": torch.zeros(2, 2),
             "teacher_topk_logits": torch.zeros(2, 2, 2), "teacher_topk_indices": torch.zeros(2, 2, 2, dtype=torch.long),
             "teacher_topk_valid": torch.zeros(2, 2, 2, dtype=torch.bool),
             "xtok_baseline": torch.full((2, 2), ((p + 0.1) + (p + 3.0)) / 2)}
    logits = torch.zeros(2, 2, 3, requires_grad=True)
    CrossTokenizerDistillationLoss()(logits, batch, 2, 2)[0].backward()
    stepped = torch.log_softmax(logits.detach() - 1.0 * logits.grad, -1)
    assert stepped[0, 1, 1] > p > stepped[1, 1, 1]  # up where the teacher likes it more than on average
    # r - b = -1.45 and +1.45, over 2 tokens: the gradient on the sampled logit is (r - b) / 2 x (1 - 1/3).
    assert logits.grad[0, 1, 1].item() == pytest.approx(-1.45 / 2 * 2 / 3, abs=1e-6)
    # The distribution term: one SGD step brings the student's two shared tokens toward the teacher's 0.88 / 0.12.
    batch = {**cross_batch(), "xtok_covered": torch.ones(1, 4)}
    logits = torch.zeros(1, 4, 3, requires_grad=True)
    CrossTokenizerDistillationLoss()(logits, batch, 1, 3)[0].backward()
    before, after = torch.softmax(torch.zeros(2), 0), torch.softmax((logits.detach() - 3.0 * logits.grad)[0, 3, :2], 0)
    q = torch.softmax(torch.tensor([2.0, 0.0]), 0)
    assert (after - q).abs().sum() < (before - q).abs().sum() and after[0] > before[0]
