"""`posttrain.SFT`, `posttrain.DPO` and `posttrain.RewardModel`: the trainers on a fixed data set,
with TRL's column names (`prompt` / `completion` or `messages` for SFT, `prompt` / `chosen` /
`rejected` for preference pairs)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from posttrain.api.common import (
    Callback,
    Config,
    Dataset,
    Trainer,
    config_overrides,
    load_trainer_config,
    message_text,
    model_overrides,
    rows_data_overrides,
)
from posttrain.errors import UserError


def sft_row(row: Any, where: str) -> dict:
    """An SFT row in posttrain's columns (`prompt`, `answer`): TRL's prompt-completion form
    (`prompt` text or messages, `completion` text or the assistant's message), its conversational
    form (`messages`, the last one the assistant's: it is trained on, the others are the prompt),
    or posttrain's own (`prompt`, `answer`). Other columns are kept."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a dict of columns, got {type(row).__name__}")
    rest = {k: v for k, v in row.items() if k not in ("prompt", "completion", "messages", "answer")}
    if "messages" in row and "prompt" not in row:
        messages = row["messages"]
        if not (isinstance(messages, list) and len(messages) >= 2 and isinstance(messages[-1], dict)
                and messages[-1].get("role") == "assistant"):
            raise UserError(f"{where}, column 'messages': expected a conversation whose last message is the "
                            "assistant's (the part trained on)")
        return {**rest, "prompt": messages[:-1], "answer": message_text(messages, "messages", where)}
    for column in ("completion", "answer"):
        if "prompt" in row and column in row:
            return {**rest, "prompt": row["prompt"], "answer": message_text(row[column], column, where)}
    raise UserError(f"{where}: needs 'prompt' and 'completion' (or 'answer'), or 'messages'; it has {sorted(row)}")


def pair_row(row: Any, where: str) -> dict:
    """A preference pair in posttrain's columns: `prompt` (text, or a one-turn conversation) and
    `chosen` / `rejected` (text, or TRL's conversational form: the assistant's message)."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a dict of columns, got {type(row).__name__}")
    missing = [c for c in ("prompt", "chosen", "rejected") if c not in row]
    if missing:
        raise UserError(f"{where}: needs 'prompt', 'chosen' and 'rejected'; it lacks {missing} (it has {sorted(row)})")
    prompt = row["prompt"]
    if isinstance(prompt, list):  # TRL's conversational prompt: one user turn
        if len(prompt) != 1 or not isinstance(prompt[0], dict) or prompt[0].get("role") != "user":
            raise UserError(f"{where}, column 'prompt': a preference prompt is text or one user message "
                            "(a system prompt goes in data.system_prompt)")
        prompt = prompt[0].get("content", "")
    return {**row, "prompt": prompt, "chosen": message_text(row["chosen"], "chosen", where),
            "rejected": message_text(row["rejected"], "rejected", where)}


class _OfflineTrainer(Trainer):
    """A trainer on a fixed data set: model, rows (normalised by `normalize`), config, callbacks."""

    normalize = staticmethod(sft_row)

    def __init__(self, model: Optional[str] = None, train_dataset: Optional[Dataset] = None,
                 eval_dataset: Optional[Dataset] = None, config: Config = None,
                 callbacks: Optional[Sequence[Callback]] = None):
        overrides = config_overrides(config)
        base = load_trainer_config(self.command, config, overrides)
        overrides += model_overrides(base, model)
        overrides += rows_data_overrides(base, train_dataset, eval_dataset, self.normalize)
        super().__init__(load_trainer_config(self.command, config, overrides), callbacks)


class SFT(_OfflineTrainer):
    """Supervised fine-tuning (next-token NLL on the responses), as `posttrain sft` runs it.

    Args:
        model: `policy.model_name` (a hub id, a local HF directory, a `step_N` checkpoint or a
            preset such as `tiny`); default None keeps the config's.
        train_dataset: rows as a list of dicts, a `datasets.Dataset` or a JSONL path, in TRL's
            columns: `{"prompt", "completion"}` (text, or chat messages and the assistant's
            message) or `{"messages": [...]}` (the last message, the assistant's, is trained on);
            posttrain's `{"prompt", "answer"}` too. Default None keeps the config's data.
        eval_dataset: validation rows in the same forms (`validation/loss`,
            `validation/accuracy_greedy`); default None: no validation when `train_dataset` is given.
        config: an `SFTMasterConfig`, a YAML path or a dict of keys over the embedded default
            (`sft_tiny.yaml`): `{"sft": {"max_num_steps": 100}}` or `{"sft.max_num_steps": 100}`.
        callbacks: `on_step_end(step, metrics) -> bool` objects or functions, after each step; True
            stops the run after that step. Default None.
    """

    command = section = "sft"


class DPO(_OfflineTrainer):
    """Direct Preference Optimization (Rafailov et al. 2023), as `posttrain dpo` runs it; the
    reference is the initial model.

    Args:
        model: `policy.model_name` (default None: the config's).
        train_dataset: preference pairs `{"prompt", "chosen", "rejected"}` (TRL's columns; text, or
            the conversational form) as a list of dicts, a `datasets.Dataset` or a JSONL path;
            default None keeps the config's data.
        eval_dataset: validation pairs (`validation/accuracy`, `validation/reward_margin`, ...);
            default None: no validation when `train_dataset` is given.
        config: a `DPOMasterConfig`, a YAML path or a dict over the embedded default (`dpo_tiny.yaml`;
            beta is `dpo.reference_policy_kl_penalty`).
        callbacks: as `SFT`'s.
    """

    command = section = "dpo"
    normalize = staticmethod(pair_row)


class RewardModel(_OfflineTrainer):
    """A Bradley-Terry reward model (a scalar head on the model), as `posttrain rm` trains it;
    `model` / `load_model()` give an `AutoModelForSequenceClassification`, and `rm.export_dir` an
    HF directory for the `reward_model` environment.

    Args:
        model, train_dataset, eval_dataset, callbacks: as `DPO`'s (pairs
            `{"prompt", "chosen", "rejected"}`; `validation/accuracy`: chosen scored higher).
        config: an `RMMasterConfig`, a YAML path or a dict over the embedded default (`rm_tiny.yaml`).
    """

    command = section = "rm"
    normalize = staticmethod(pair_row)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """A reward model does not generate: its scores are validated during training
        (`validation/accuracy` in `TrainResult.history`)."""
        raise UserError("RewardModel.evaluate: a reward model does not generate; its validation/accuracy on the "
                        "eval_dataset pairs is in train().history")
