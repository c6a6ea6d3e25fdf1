"""`posttrain.evaluate`: `posttrain eval` as a function, on a model, rows and reward functions."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from posttrain.api.common import (
    Config,
    Dataset,
    RewardFuncs,
    config_overrides,
    dataset_jsonl,
    load_trainer_config,
    model_overrides,
    override,
    prompt_data_overrides,
)


def evaluate(
    model: Optional[str] = None,
    dataset: Optional[Dataset] = None,
    reward_funcs: RewardFuncs = None,
    config: Config = None,
    reward_weights: Optional[Sequence[float]] = None,
    num_generations_per_prompt: Optional[int] = None,
) -> dict[str, float]:
    """Score `model` on `dataset` as `posttrain eval` does: greedy accuracy for one generation per
    prompt, else pass@k and cons@k over k samples; returns the metrics (also appended to
    `<logger.log_dir>/eval_results.jsonl`).

    Args:
        model: `policy.model_name` (a hub id, a local HF directory, a `step_N` checkpoint, a preset,
            or `TrainResult.model_dir()` of a run); default None keeps the config's.
        dataset: rows `{"prompt": text or chat messages, <other columns>}` as a list of dicts, a
            `datasets.Dataset` or a JSONL path, all evaluated (up to `eval.max_samples`); default
            None: the config's validation data.
        reward_funcs: reward functions as GRPO takes them (default None: the config's environments,
            e.g. `math` grading the `answer` column).
        config: an `EvalMasterConfig`, a YAML path or a dict of keys over the embedded default
            (`eval_tiny.yaml`); default None: that default.
        reward_weights: one weight per reward function (default None: 1.0 each).
        num_generations_per_prompt: k (default None: the config's `eval.num_generations_per_prompt`).
    """
    from posttrain.cli import run_job

    overrides = config_overrides(config)
    base = load_trainer_config("eval", config, overrides)
    overrides += model_overrides(base, model)
    if dataset is not None:  # the rows are the evaluated split
        path = str(dataset_jsonl(dataset, Path(base.logger.log_dir) / "data", "validation"))
        overrides += ["data.dataset=jsonl", "data.blend=[]", "data.validation_sets={}", override("data.train_path", path),
                      override("data.validation_path", path), "eval.split=validation"]
    overrides += prompt_data_overrides(base, None, None, reward_funcs, reward_weights)
    if num_generations_per_prompt is not None:
        overrides.append(override("eval.num_generations_per_prompt", num_generations_per_prompt))
    return run_job("eval", load_trainer_config("eval", config, overrides))
