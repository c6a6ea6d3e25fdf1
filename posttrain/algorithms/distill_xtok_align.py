"""Aligning two tokenisations of one text, for a distillation teacher whose tokenizer differs from
the student's (cross-tokenizer distillation; the idea of TRL's GOLD / ULD and of NeMo-RL's
x-token distillation, with our own, simpler alignment).

The student's response is a sequence of its own token ids; its text is what they decode to. The
teacher reads the same text tokenised its own way. Each token ends at a character offset of the
text; an offset where *both* sequences have a token boundary cuts the text into aligned spans:

    text      "12+34=46"          student (characters)  1 2 + 3 4 = 4 6
                                  teacher (digit pairs)  12 + 34 = 46
    spans     [12] [+] [34] [=] [46]   student tokens 2,1,2,1,2 / teacher tokens 1,1,1,1,1

Within a span both sides spell the same characters, so the span's log-probability (the sum of its
tokens' log-probabilities) is comparable across the two models: it is each model's probability of
writing that piece of text next, given the same text before it. A span where both sides are one
token of the same string (`+`, `=` above) is an exact match (`exact_match_map`). Where a span's
teacher side is one token, the teacher's next-token distribution there also reads as the student's
at each of the span's tokens (`NextTokenMap`: the teacher's `12` counts for the student's `1`, then
for its `2` after `1`), so the two next-token distributions can be compared.

Everything here is pure (tokenizers in, integers out) and unit-tested on hand-made sequences.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

# decode() options that keep every token's characters (special tokens too) and add none.
DECODE = dict(skip_special_tokens=False, clean_up_tokenization_spaces=False)


@dataclass(frozen=True)
class Span:
    """One aligned span: student tokens `[s_lo, s_hi)` and teacher tokens `[t_lo, t_hi)` (indices in
    each side's response), spelling the same text; `match`: one token on each side, of the same string."""

    s_lo: int
    s_hi: int
    t_lo: int
    t_hi: int
    match: bool = False


@dataclass
class RowAlignment:
    """A training row's alignment: where each side's response starts in its row, and the spans."""

    student_start: int
    teacher_start: int
    spans: list[Span] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # each student response token's text ("" for eos)
    teacher_pieces: list[str] = field(default_factory=list)  # each teacher response token's ("" for eos)


def decoded_token_ends(tokenizer: Any, ids: Sequence[int]) -> tuple[str, list[Optional[int]]]:
    """`(text, ends)`: the text `ids` decode to, and for each token the character offset where it ends
    in that text, or None where no boundary can be placed after it (decoding up to it does not give a
    prefix of the text: a token holding part of a multi-byte character, or one the decoder joins with
    the next). One decode per token when the tokens decode on their own to the whole text (character
    and most word-piece vocabularies), else one decode per prefix."""
    ids = [int(i) for i in ids]
    text = tokenizer.decode(ids, **DECODE)
    pieces = [tokenizer.decode([i], **DECODE) for i in ids]
    if "".join(pieces) == text:
        ends, total = [], 0
        for piece in pieces:
            total += len(piece)
            ends.append(total)
        return text, ends
    ends_or_none: list[Optional[int]] = []
    for n in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:n], **DECODE)
        ends_or_none.append(len(prefix) if text.startswith(prefix) else None)
    return text, ends_or_none


def offset_ends(offsets: Sequence[tuple[int, int]]) -> list[Optional[int]]:
    """Each token's end offset where a boundary can follow it (no later token starts before that
    offset), else None; `offsets` as a fast tokenizer's `offset_mapping` (start, end) per token."""
    ends: list[Optional[int]] = [None] * len(offsets)
    first_later_start = math.inf
    for i in range(len(offsets) - 1, -1, -1):
        start, end = offsets[i]
        ends[i] = end if end <= first_later_start else None
        first_later_start = min(first_later_start, start)
    return ends


def _span_of_each_token(ends: Sequence[Optional[int]], cuts: Sequence[int]) -> list[int]:
    """For each token, the index of the span it falls in: that of the first cut at or after its end
    (a token without a known end takes the next known one's; ends are made non-decreasing)."""
    spans, known, last = [0] * len(ends), None, 0
    for i in range(len(ends) - 1, -1, -1):
        known = ends[i] if ends[i] is not None else known
        spans[i] = min(bisect.bisect_left(cuts, known), len(cuts) - 1) if known is not None else len(cuts) - 1
    for i, s in enumerate(spans):  # never back into an earlier span
        last = spans[i] = max(s, last)
    return spans


def align_spans(student_ends: Sequence[Optional[int]], teacher_ends: Sequence[Optional[int]],
                text_length: int) -> list[tuple[int, int, int, int]]:
    """The aligned spans `(s_lo, s_hi, t_lo, t_hi)` (token ranges, end exclusive) of two tokenisations
    of one text of `text_length` characters, from each token's end offset (`decoded_token_ends`,
    `offset_ends`; None: no boundary after it).

    The cuts are the offsets where both sides have a boundary (and the text's end); a span is the
    tokens of each side between two cuts. A span with no token on one side (a zero-width token, or
    characters one tokenizer dropped) joins the next span, or the previous one at the end. Empty
    sequences give no spans."""
    if not student_ends or not teacher_ends:
        return []
    both = ({e for e in student_ends if e is not None} & {e for e in teacher_ends if e is not None})
    cuts = sorted(c for c in both if 0 < c < text_length) + [max(text_length, 0)]
    s_span, t_span = _span_of_each_token(student_ends, cuts), _span_of_each_token(teacher_ends, cuts)
    groups: list[list[list[int]]] = [[[], []] for _ in cuts]
    for i, k in enumerate(s_span):
        groups[k][0].append(i)
    for i, k in enumerate(t_span):
        groups[k][1].append(i)
    merged: list[list[list[int]]] = []
    carry: list[list[int]] = [[], []]
    for s_tokens, t_tokens in groups:
        s_tokens, t_tokens = carry[0] + s_tokens, carry[1] + t_tokens
        if s_tokens and t_tokens:
            merged.append([s_tokens, t_tokens])
            carry = [[], []]
        else:
            carry = [s_tokens, t_tokens]
    if (carry[0] or carry[1]) and merged:  # left over at the end: joins the last span
        merged[-1][0] += carry[0]
        merged[-1][1] += carry[1]
    return [(s[0], s[-1] + 1, t[0], t[-1] + 1) for s, t in merged]


def token_strings(tokenizer: Any) -> list[str]:
    """Each id's text (`decode([id])`, special tokens as written)."""
    return [tokenizer.decode([i], **DECODE) for i in range(len(tokenizer))]


def exact_match_map(student: Any, teacher: Any) -> torch.Tensor:
    """`[len(teacher)]` int64: for each teacher id the student id of the same string, or -1.

    A string is shared when exactly one id of each vocabulary decodes to it on its own (ambiguous
    strings, empty ones and partial characters, which decode to U+FFFD, are left out). The two
    end-of-sequence tokens are mapped to each other whatever they spell: both end the answer."""
    def unique(tokenizer: Any) -> dict[str, int]:
        seen: dict[str, list[int]] = {}
        for i, text in enumerate(token_strings(tokenizer)):
            if text and "\ufffd" not in text:
                seen.setdefault(text, []).append(i)
        return {text: ids[0] for text, ids in seen.items() if len(ids) == 1}

    student_ids, teacher_ids = unique(student), unique(teacher)
    to_student = torch.full((len(teacher),), -1, dtype=torch.long)
    for text, t in teacher_ids.items():
        if text in student_ids:
            to_student[t] = student_ids[text]
    if student.eos_token_id is not None and teacher.eos_token_id is not None:
        to_student[to_student == student.eos_token_id] = -1
        to_student[teacher.eos_token_id] = student.eos_token_id
    return to_student


def same_vocabulary(student: Any, teacher: Any) -> bool:
    """Whether the two tokenizers give every id the same token (`get_vocab`, added tokens included):
    then the student's token ids mean the same to the teacher, and distillation compares them as they
    are (`DistillationLoss`)."""
    return student.get_vocab() == teacher.get_vocab()


def align_response(student_tok: Any, teacher_tok: Any, response_ids: Sequence[int],
                   to_student: torch.Tensor) -> tuple[list[int], list[Span]]:
    """The teacher's tokens for a student response and the aligned spans.

    The response's text (without a final end-of-sequence token) is tokenised by the teacher on its
    own (as a continuation of the teacher's prompt, rendered by the teacher); a final student
    end-of-sequence token becomes the teacher's, as a span of its own. Returns the teacher's response
    ids and the spans, `match` set where both sides are one token that `to_student` maps across."""
    ids = [int(i) for i in response_ids]
    ends_with_eos = bool(ids) and student_tok.eos_token_id is not None and ids[-1] == student_tok.eos_token_id
    body = ids[:-1] if ends_with_eos else ids
    text, student_ends = decoded_token_ends(student_tok, body) if body else ("", [])
    encoded = teacher_tok(text, add_special_tokens=False, return_offsets_mapping=True) if text else None
    teacher_ids = list(encoded["input_ids"]) if encoded else []
    teacher_ends = offset_ends(encoded["offset_mapping"]) if encoded else []
    spans = [Span(*s) for s in align_spans(student_ends, teacher_ends, len(text))]
    if ends_with_eos:
        spans.append(Span(len(body), len(body) + 1, len(teacher_ids), len(teacher_ids) + 1))
        teacher_ids.append(int(teacher_tok.eos_token_id))
    out = []
    for span in spans:
        single = span.s_hi - span.s_lo == 1 and span.t_hi - span.t_lo == 1
        t = teacher_ids[span.t_lo] if single else -1
        match = single and 0 <= t < len(to_student) and int(to_student[t]) == ids[span.s_lo]
        out.append(Span(span.s_lo, span.s_hi, span.t_lo, span.t_hi, match))
    return teacher_ids, out


def token_pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token's characters in the text `ids` decode to (`decoded_token_ends`); a token with no
    boundary after it gets "" and the next one its characters too. A final end-of-sequence token: ""."""
    ids = [int(i) for i in ids]
    ends_with_eos = bool(ids) and tokenizer.eos_token_id is not None and ids[-1] == tokenizer.eos_token_id
    body = ids[:-1] if ends_with_eos else ids
    text, ends = decoded_token_ends(tokenizer, body) if body else ("", [])
    pieces, start = [], 0
    for end in ends:
        pieces.append(text[start:end] if end is not None else "")
        start = end if end is not None else start
    if pieces and start < len(text):  # characters no boundary closed: the last token's
        pieces[-1] += text[start:]
    return pieces + [""] * ends_with_eos


@dataclass
class NextTokenMap:
    """The teacher's next-token distribution read as the student's, through the text.

    At an aligned span whose teacher side is one token, the teacher's top-k at that token is a
    distribution over how the text goes on. Each of the span's student tokens j, after the span's
    earlier student tokens (`prefix`), gets the teacher's distribution of the next characters: each
    teacher token whose text starts with `prefix` and goes on gives its probability to the student
    token its remaining text starts with (`student_first`), the others (another continuation, or a
    teacher token that ends exactly at `prefix`, whose continuation the teacher's next position would
    tell) are left out. With a character-level student and a teacher whose token is `12`, the
    student's `1` gets the teacher's mass on every token starting with `1` (`1`, `12`, `13`, ...),
    then its `2` the teacher's `12` against `13`, ... (the teacher's next-character marginal, as in
    byte-level readings of token-level models). For a one-token span of the same string this is the
    exact-match distribution plus the teacher's longer tokens that start with a shared one.

    `strings`: each teacher id's text (None: a special token); `exact`: each teacher id's student id
    of the same string or -1 (`exact_match_map`; how the eos tokens map); `student_first(text)`: the
    student id the student's tokenisation of `text` starts with, or -1."""

    strings: list[Optional[str]]
    exact: torch.Tensor
    student_first: Callable[[str], int]

    def distribution(self, ids: Sequence[int], logprobs: Sequence[float], prefix: str) -> tuple[dict[int, float], float]:
        """`({student id: teacher probability}, prefix mass)` for the student's next token after `prefix`,
        from the teacher's top-k `ids` and their `logprobs`; the prefix mass is the top-k's probability on
        tokens starting with `prefix` (1.0 for an empty prefix: the whole distribution)."""
        out: dict[int, float] = {}
        under_prefix = 0.0
        for i, logprob in zip(ids, logprobs):
            i, p = int(i), math.exp(float(logprob))
            text = self.strings[i] if 0 <= i < len(self.strings) else None
            if text is None:  # a special token: only the eos, as the answer's next token
                if not prefix and 0 <= i < len(self.exact) and int(self.exact[i]) >= 0:
                    out[int(self.exact[i])] = out.get(int(self.exact[i]), 0.0) + p
                continue
            if not text.startswith(prefix):
                continue
            under_prefix += p
            student = self.student_first(text[len(prefix):]) if len(text) > len(prefix) else -1
            if student >= 0:
                out[student] = out.get(student, 0.0) + p
        return out, (1.0 if not prefix else under_prefix)

    def after_token(self, before: tuple[Sequence[int], Sequence[float]], token: str, token_logprob: float,
                    ids: Sequence[int], logprobs: Sequence[float]) -> tuple[dict[int, float], float]:
        """`distribution` at a teacher token boundary, with the teacher's token before it (`token`, of
        log-probability `token_logprob`; the top-k `before` at its place): the teacher's tokens there
        that start with `token` and go on give their probability to the student token their rest
        starts with, and the token itself its probability times the distribution here (`ids`,
        `logprobs`, the teacher's next token after it). Reading only the distribution here would
        condition on the teacher having written `token` rather than one of its longer tokens: after
        a lone `1` it has learned only 2-digit answers, so a student that writes `1` and stops would
        find a teacher that agrees. Returns the distribution and the teacher's probability of text
        starting with `token` (the reference of the mass gate)."""
        out: dict[int, float] = {}
        longer = 0.0
        for i, logprob in zip(*before):
            i = int(i)
            text = self.strings[i] if 0 <= i < len(self.strings) else None
            if text is None or not text.startswith(token) or len(text) == len(token):
                continue
            p = math.exp(float(logprob))
            longer += p
            student = self.student_first(text[len(token):])
            if student >= 0:
                out[student] = out.get(student, 0.0) + p
        p_token = math.exp(float(token_logprob))
        here, _ = self.distribution(ids, logprobs, "")
        for student, p in here.items():
            out[student] = out.get(student, 0.0) + p_token * p
        return out, longer + p_token


def next_token_map(student: Any, teacher: Any, to_student: Optional[torch.Tensor] = None) -> NextTokenMap:
    """`NextTokenMap` of two tokenizers: the teacher's token texts (special tokens and partial
    characters left out), `exact_match_map`, and the student's first token of a text (memoised;
    -1 where it is unknown, special or not a prefix of the text)."""
    specials = set(teacher.all_special_ids)
    strings = [None if i in specials or not text or "\ufffd" in text else text
               for i, text in enumerate(token_strings(teacher))]
    student_specials = set(student.all_special_ids)
    memo: dict[str, int] = {}

    def student_first(text: str) -> int:
        if text not in memo:
            ids = student(text, add_special_tokens=False)["input_ids"]
            first = int(ids[0]) if ids else -1
            piece = student.decode([first], **DECODE) if first >= 0 else ""
            ok = first >= 0 and first not in student_specials and piece and text.startswith(piece)
            memo[text] = first if ok else -1
        return memo[text]

    return NextTokenMap(strings, exact_match_map(student, teacher) if to_student is None else to_student, student_first)
