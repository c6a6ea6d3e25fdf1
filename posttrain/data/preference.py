"""Preference pairs for DPO and reward models: records, message logs and interleaved batches.

A preference record is `{"prompt": str, "chosen": str, "rejected": str}`: two responses to one
prompt, the first preferred. Sources (`data.dataset`, as for SFT):
- `arithmetic`: synthetic pairs. The prompt comes from `posttrain.data.arithmetic` (train and
  validation are disjoint by problem), `chosen` is the right answer and `rejected` a plausible
  wrong one (`wrong_answer`: by default the answer with its last digit dropped or repeated).
  Seeded by `data.seed`.
- `jsonl`: `data.train_path` / `data.validation_path`, one JSON object per line, with the keys
  `data.prompt_key` (default "prompt"), `data.chosen_key` ("chosen") and `data.rejected_key`
  ("rejected"). `data.prompt_template` is applied to the prompt.
- `hf`: the same keys in a Hugging Face data set (see `posttrain.data.datasets`).

A pair datum (NeMo-RL's DPO `DatumSpec`) holds two message logs that share the prompt:

    {"message_log_chosen": [...], "message_log_rejected": [...], "length_chosen": int,
     "length_rejected": int, "loss_multiplier": float, "idx": int}

Batches interleave the two rows of every pair, `[c0, r0, c1, r1, ...]`, which is the layout
`DPOLoss` and `PreferenceLoss` expect; both rows of a pair carry the same `sample_mask`.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from posttrain.config.schema import DataConfig
from posttrain.data.arithmetic import generate_arithmetic
from posttrain.data.datasets import DataError, Split, distinct_problems, read_source_rows
from posttrain.data.prompt_template import format_prompt
from posttrain.data.message_log import flatten_message_logs
from posttrain.data.processors import build_sft_example
from posttrain.distributed.batch import Batch


# ------------------------------------------------------------------------------------- records
# Slips that turn a right integer answer into a plausible wrong one, each `(digits, rng) -> digits
# or None` (None: does not apply, e.g. nothing to swap in "7"). They are the mistakes small
# models make: stopping early, repeating a token, swapping two, losing a carry.
def _drop_last_digit(digits: str, rng: random.Random) -> str | None:
    return digits[:-1] if len(digits) > 1 else None


def _repeat_last_digit(digits: str, rng: random.Random) -> str | None:
    return digits + digits[-1] if digits != "0" else None


def _swap_adjacent_digits(digits: str, rng: random.Random) -> str | None:
    spots = [i for i in range(len(digits) - 1) if digits[i] != digits[i + 1] and (i > 0 or digits[1] != "0")]
    if not spots:
        return None
    i = rng.choice(spots)
    return digits[:i] + digits[i + 1] + digits[i] + digits[i + 2:]


def _lost_carry(digits: str, rng: random.Random) -> str | None:
    value = int(digits)
    return str(value + 10 if value < 10 or rng.random() < 0.5 else value - 10)


WRONG_ANSWER_SLIPS: dict[str, Callable[[str, random.Random], str | None]] = {
    "drop_last_digit": _drop_last_digit,
    "repeat_last_digit": _repeat_last_digit,
    "swap_adjacent_digits": _swap_adjacent_digits,
    "lost_carry": _lost_carry,
}


# The slips of the synthetic pairs by default: a tiny model trained from scratch learns to tell
# them from the right answer within a minute on a CPU (swapped digits and lost carries take a
# model that can already add; pass `slips=tuple(WRONG_ANSWER_SLIPS)` for the harder mix).
DEFAULT_SLIPS = ("drop_last_digit", "repeat_last_digit")


def wrong_answer(answer: str, rng: random.Random, slips: Sequence[str] = DEFAULT_SLIPS) -> str:
    """A plausible wrong answer to the integer `answer` (never equal to it, same sign).

    One of the `slips` (names in `WRONG_ANSWER_SLIPS`) that applies to `answer`, drawn uniformly
    with `rng` (all slips when none of them applies, e.g. to `0`): `46` becomes `4` or `466`
    by default, `64`, `36` or `56` with the other slips.
    """
    unknown = [name for name in slips if name not in WRONG_ANSWER_SLIPS]
    if unknown or not slips:
        raise ValueError(f"unknown wrong-answer slips {unknown or slips}; choose from {list(WRONG_ANSWER_SLIPS)}")
    sign, digits = ("-", answer[1:]) if answer.startswith("-") else ("", answer)
    if not digits.isdigit():
        raise ValueError(f"wrong_answer needs an integer answer, got {answer!r}")
    for names in (slips, tuple(WRONG_ANSWER_SLIPS)):
        candidates = [WRONG_ANSWER_SLIPS[name](digits, rng) for name in names]
        candidates = [c for c in candidates if c is not None and c != digits]
        if candidates:
            return sign + rng.choice(candidates)
    raise AssertionError(f"no wrong answer for {answer!r}")  # lost_carry always applies


def arithmetic_preference_pairs(
    n_train: int,
    n_val: int,
    operations: Sequence[str] = ("add",),
    num_digits: int = 2,
    seed: int = 1234,
    slips: Sequence[str] = DEFAULT_SLIPS,
) -> tuple[list[dict], list[dict]]:
    """Synthetic `{"prompt", "chosen", "rejected"}` pairs: the right answer is chosen.

    Problems come from `generate_arithmetic` (so train and validation never share a problem);
    rejected answers from `wrong_answer(answer, rng, slips)` with a `random.Random` seeded by
    `seed` and the split. The output is a pure function of the arguments.
    """
    train, val = generate_arithmetic(n_train, n_val, operations, num_digits, seed)

    def pairs(records: list[dict], split_seed: int) -> list[dict]:
        rng = random.Random(split_seed)
        return [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": wrong_answer(r["answer"], rng, slips)}
                for r in records]

    return pairs(train, seed * 2 + 1), pairs(val, seed * 2 + 2)


def _as_text(value: Any, key: str, at: str) -> str:
    # Numbers become strings (JSON may hold 46 or "46"); anything else is a data error.
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise DataError(f"{at}: {key!r} must be a string, got {type(value).__name__}: {value!r:.80}")


def _to_pairs(rows: Sequence[dict], locations: Sequence[str], data_cfg: DataConfig) -> list[dict]:
    """Map the configured keys to `prompt` / `chosen` / `rejected`, applying `data.prompt_template`."""
    keys = (("prompt", data_cfg.prompt_key, "prompt_key"), ("chosen", data_cfg.chosen_key, "chosen_key"),
            ("rejected", data_cfg.rejected_key, "rejected_key"))
    records = []
    for row, at in zip(rows, locations):
        record = {}
        for name, key, option in keys:
            if key not in row:
                raise DataError(f"{at}: missing key {key!r} (data.{option}); record has {sorted(row)}")
            record[name] = _as_text(row[key], key, at)
        record["prompt"] = format_prompt(data_cfg, {**row, "prompt": record["prompt"]}, at)
        records.append(record)
    return records


def load_preference_records(data_cfg: DataConfig, split: Split) -> list[dict]:
    """Preference records of one split as `{"prompt", "chosen", "rejected"}` dicts.

    For `jsonl` and `hf` without `data.validation_path`, the validation split is empty.
    Errors name the file and line (`jsonl`) or the data set and row (`hf`).
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    if data_cfg.dataset == "arithmetic":
        train, val = arithmetic_preference_pairs(
            data_cfg.num_train, data_cfg.num_validation, data_cfg.operations, data_cfg.num_digits, data_cfg.seed
        )
        return train if split == "train" else val
    pairs = _to_pairs(*read_source_rows(data_cfg, split), data_cfg)
    # As for prompts (`load_records`): a repeated validation pair would count twice in validation/accuracy.
    return distinct_problems(pairs, "pairs") if split == "validation" else pairs


# -------------------------------------------------------------------------------- message logs
def build_preference_example(
    record: dict,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_length: int,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
    idx: int = 0,
) -> dict[str, Any]:
    """A pair datum: two message logs `[user (prompt), assistant (response, "loss": True)]`.

    Each log is built exactly as `build_sft_example` builds an SFT example (the prompt not trained
    on, the response with its end-of-turn / eos tokens trained on), so a DPO-trained policy sees
    the same token layout as an SFT-trained one.

    Args:
        record: needs `prompt`, `chosen` and `rejected` (strings).
        tokenizer: a Hugging Face tokenizer.
        max_seq_length: when either sequence (prompt + response) is longer, both are truncated
            (as `build_sft_example` does) and the pair gets `loss_multiplier` 0.0: the pair is
            masked out of the loss, never a crash (the preflight counts such pairs per data file:
            `posttrain.data.row_lengths`).
        use_chat_template: wrap the prompt with the tokenizer's chat template (default True).
        system_prompt: optional system message (default None).
        idx: the pair's index, kept in the datum.
    """
    for key in ("prompt", "chosen", "rejected"):
        if key not in record:
            raise DataError(f"preference pair idx {idx}: record has no {key!r} key (keys: {sorted(record)})")
    sides = {}
    for side in ("chosen", "rejected"):
        sides[side] = build_sft_example(
            {"prompt": record["prompt"], "answer": record[side]}, tokenizer, max_seq_length,
            use_chat_template=use_chat_template, system_prompt=system_prompt, idx=idx,
        )
    chosen, rejected = sides["chosen"], sides["rejected"]
    loss_multiplier = min(chosen["loss_multiplier"], rejected["loss_multiplier"])
    return {
        "message_log_chosen": chosen["message_log"],
        "message_log_rejected": rejected["message_log"],
        "length_chosen": chosen["length"],
        "length_rejected": rejected["length"],
        "loss_multiplier": loss_multiplier,
        "idx": idx,
    }


def flatten_preference_pairs(datums: Sequence[dict], pad_token_id: int) -> Batch:
    """`2 * len(datums)` rows interleaving chosen and rejected: `[c0, r0, c1, r1, ...]`.

    Returns `flatten_message_logs`' tensors (`token_mask` is 1 on the response tokens only) plus
    `sample_mask [2N]`, each pair's `loss_multiplier` on both of its rows.
    """
    logs = [log for d in datums for log in (d["message_log_chosen"], d["message_log_rejected"])]
    batch = flatten_message_logs(logs, pad_token_id=pad_token_id)
    pair_mask = torch.tensor([float(d["loss_multiplier"]) for d in datums])
    batch["sample_mask"] = pair_mask.repeat_interleave(2)
    return batch


def pair_batches(datums: Sequence[dict], pairs_per_batch: int, pad_token_id: int) -> list[Batch]:
    """`flatten_preference_pairs` of each run of `pairs_per_batch` consecutive pairs (the last may be shorter)."""
    return [flatten_preference_pairs(datums[i : i + pairs_per_batch], pad_token_id)
            for i in range(0, len(datums), pairs_per_batch)]
