"""`posttrain.GRPO`: `posttrain grpo` as an object, with TRL-style reward functions and data sets."""

from __future__ import annotations

from typing import Optional, Sequence

from posttrain.api.common import (
    Callback,
    Config,
    Dataset,
    RewardFuncs,
    Trainer,
    config_overrides,
    load_trainer_config,
    model_overrides,
    prompt_data_overrides,
)
from posttrain.config import GRPOMasterConfig


class GRPO(Trainer):
    """GRPO on your reward functions and data, as `posttrain grpo` runs it (DAPO, GSPO, Dr.GRPO,
    CISPO: the config's `loss_fn` / `grpo` keys, or a preset YAML as `config`).

    Args:
        model: `policy.model_name` (a hub id, a local HF directory, a `step_N` checkpoint or a
            preset such as `tiny`); default None keeps the config's. The config's SFT warm start
            (`sft_warmup`) is kept only when it trains this same model.
        reward_funcs: a function or a list, `def reward(prompts, completions, **columns) ->
            list[float]` (TRL's signature, plain or async; see `posttrain.environments.reward_fn_env`),
            or `module:function` names; they serve every row. Default None keeps the config's
            environments.
        train_dataset: rows `{"prompt": text or chat messages, <other columns>}` as a list of
            dicts, a `datasets.Dataset` or a JSONL path; default None keeps the config's data.
        eval_dataset: validation rows, in the same forms (default None: no validation, unless the
            config's own data has a validation split and no `train_dataset` is given).
        config: a `GRPOMasterConfig`, a YAML path (read as `--config` reads it) or a dict of keys
            set over the embedded default (`{"grpo": {"max_num_steps": 50}}` or
            `{"grpo.max_num_steps": 50}`); default None: the embedded default
            (`grpo_math_tiny.yaml`).
        reward_weights: one weight per reward function (default None: 1.0 each); the reward is
            their weighted sum. Under GDPO (`{"grpo.adv_estimator.name": "gdpo"}`, TRL's
            `multi_objective_aggregation="normalize_then_sum"`) each function's rewards are a
            component normalised within its group first, then weighted by these.
        callbacks: objects with `on_step_end(step, metrics) -> bool` or such functions, called
            after each GRPO step (not the warm start's); True stops the run after that step
            (`posttrain.algorithms.loop.step_callbacks`). Default None.
    """

    command = section = "grpo"

    def __init__(
        self,
        model: Optional[str] = None,
        reward_funcs: RewardFuncs = None,
        train_dataset: Optional[Dataset] = None,
        eval_dataset: Optional[Dataset] = None,
        config: Config = None,
        reward_weights: Optional[Sequence[float]] = None,
        callbacks: Optional[Sequence[Callback]] = None,
    ):
        overrides = config_overrides(config)
        base = load_trainer_config(self.command, config, overrides)
        overrides += model_overrides(base, model)
        overrides += prompt_data_overrides(base, train_dataset, eval_dataset, reward_funcs, reward_weights)
        cfg: GRPOMasterConfig = load_trainer_config(self.command, config, overrides)  # type: ignore[assignment]
        super().__init__(cfg, callbacks)
