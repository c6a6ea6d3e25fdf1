"""Rows longer than `policy.max_total_sequence_length`, counted per data file before a job starts.

A row over the limit is not a crash: its processor cuts it and masks it out of the loss
(`loss_multiplier` 0; `build_prompt_message_log`, `build_sft_example`, `build_preference_example`).
A warning per row buried the one thing to know (a VL example printed over 1,000 of them), so the
preflight says it once per data file instead: how many rows exceed the limit, the longest, and the
key to raise; and `preflight.check_row_lengths` refuses the run when most of a file's rows would be masked (one
line), since such a run trains on almost nothing.

A row's length is what its processor builds with no limit: the prompt as the model sees it (chat
template, system prompt, tools, image tokens) for the rollout jobs, prompt + answer for SFT, the
longer of prompt + chosen and prompt + rejected for preference pairs.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence


# Rows tokenized per data file at most: this many evenly spaced, plus the `LONGEST_CHECKED` longest
# in characters (where the longest in tokens almost always is). A larger file's count is an
# estimate from the evenly spaced ones. Building a row costs about 0.4 ms on a busy core, one with
# an image about 7 ms (its pixels are processed).
ROWS_CHECKED = 250
LONGEST_CHECKED = 32
MOSTLY = 0.5  # more than this share of a file's rows over the limit refuses the run
TEXT_KEYS = ("messages", "prompt", "answer", "chosen", "rejected")


@dataclass
class FileLengths:
    """The over-limit rows of one data file: of its `rows`, `over` of the `checked` exceed the limit
    (`spaced_over` of the `spaced` evenly spaced ones), the longest `longest` tokens."""

    source: str
    rows: int
    checked: int
    over: int
    spaced: int
    spaced_over: int
    longest: int

    @property
    def share(self) -> float:
        """The share of the file's rows over the limit (exact, or estimated from the evenly spaced rows)."""
        return self.over / self.rows if self.checked == self.rows else self.spaced_over / self.spaced

    def line(self, key: str, limit: int) -> str:
        """How many rows exceed `key`=`limit`, and the longest."""
        if self.checked == self.rows:
            count = f"{self.over:,} of {self.rows:,} rows"
        elif self.spaced_over:
            count = f"about {round(self.share * self.rows):,} of {self.rows:,} rows ({self.over:,} of {self.checked:,} checked)"
        else:
            count = f"at least {self.over:,} of {self.rows:,} rows (of the {self.checked:,} checked)"
        return f"{count} of {self.source} exceed {key}={limit} (longest {self.longest:,} tokens)"


def source_of(record: dict, fallback: str) -> str:
    """The data file (or data set, generator, blend component) a record comes from: its `origin`
    (`file:line`, `name row i`) without the row, else `fallback`."""
    origin = record.get("origin")
    if not origin:
        return fallback
    return re.sub(r"(:\d+| row \d+)$", "", origin)


def file_lengths(records: Sequence[dict], length_of: Callable[[dict], int], limit: int, fallback: str) -> list[FileLengths]:
    """The over-limit counts of each data file among `records` (`ROWS_CHECKED` evenly spaced rows
    and the `LONGEST_CHECKED` longest in characters of a larger file), files with none left out."""
    by_source: dict[str, list[dict]] = {}
    for record in records:
        by_source.setdefault(source_of(record, fallback), []).append(record)
    found = []
    for source, rows in by_source.items():
        spaced = range(0, len(rows), max(1, -(-len(rows) // ROWS_CHECKED)))
        chars = [sum(len(str(row.get(key, ""))) for key in TEXT_KEYS) for row in rows]
        longest = sorted(range(len(rows)), key=chars.__getitem__)[-LONGEST_CHECKED:]
        lengths = {i: length_of(rows[i]) for i in sorted({*spaced, *longest})}
        over = [n for n in lengths.values() if n > limit]
        if over:
            found.append(FileLengths(source, len(rows), len(lengths), len(over), len(spaced),
                                     sum(lengths[i] > limit for i in spaced), max(over)))
    return found


def row_length_of(cfg: Any, tokenizer: Any) -> Callable[[dict], int]:
    """`record -> tokens` as the job's processor builds the record, with no limit."""
    from posttrain.config.schema import DPOMasterConfig, RMMasterConfig, SFTMasterConfig

    options = dict(use_chat_template=cfg.data.use_chat_template, system_prompt=cfg.data.system_prompt)
    if isinstance(cfg, (DPOMasterConfig, RMMasterConfig)):
        from posttrain.data.preference import build_preference_example

        def pair(record: dict) -> int:
            datum = build_preference_example(record, tokenizer, sys.maxsize, **options)
            return max(datum["length_chosen"], datum["length_rejected"])

        return pair
    if isinstance(cfg, SFTMasterConfig):
        from posttrain.data.processors import build_sft_example

        return lambda record: build_sft_example(record, tokenizer, sys.maxsize, **options)["length"]
    from posttrain.data.processors import build_prompt_message_log

    return lambda record: build_prompt_message_log(record, tokenizer, sys.maxsize, **options).prompt_length
