"""The Python API: `posttrain grpo` as an object, with TRL-style reward functions and data sets.

    from posttrain import GRPO

    def brevity(prompts, completions, answer, **columns):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    trainer = GRPO(model="tiny", reward_funcs=[brevity], train_dataset=rows, eval_dataset=held_out,
                   config={"grpo": {"max_num_steps": 50}})
    result = trainer.train()        # the same job as the command line; returns metrics and paths
    trainer.evaluate()              # `posttrain eval` on the latest checkpoint

The API only writes a config: the data sets become JSONL files under `<logger.log_dir>/data/`
(`data.dataset: jsonl`), the reward functions an `env.rewards` section (`reward_fn_env`), and the
job is `posttrain.cli.run_job`, exactly what `posttrain grpo --config <logger.log_dir>/config.yaml`
runs. Errors are `posttrain.errors.UserError`s with the CLI's one-line messages.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from posttrain.config import GRPOMasterConfig, config_to_yaml, load_config
from posttrain.errors import UserError

REWARD_ENV = "rewards"  # the env section (and task name) the reward functions serve
Dataset = Union[str, os.PathLike, Sequence[dict], Any]  # a JSONL path, a list of dicts or a datasets.Dataset
Config = Union[None, str, os.PathLike, dict, GRPOMasterConfig]


@dataclass
class TrainResult:
    """What `GRPO.train` ran and left.

    Attributes:
        metrics: the last logged step's metrics (`train/...`, `validation/...`, `timing/...`).
        history: every logged step's metrics, `{step: {name: value}}` (step 0: the validation
            before training); the run's metrics.jsonl, merged by step.
        log_dir: `logger.log_dir` (metrics.jsonl, TensorBoard, config.yaml, report.png).
        checkpoint: the latest `step_N` checkpoint (a model for `policy.model_name`, `posttrain
            eval` or `posttrain convert`), or None when checkpointing is off.
    """

    metrics: dict[str, float]
    history: dict[int, dict[str, float]]
    log_dir: Path
    checkpoint: Optional[Path] = None
    config: Optional[GRPOMasterConfig] = field(default=None, repr=False)


class GRPO:
    """GRPO on your reward functions and data, as `posttrain grpo` runs it.

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
            their weighted sum.
    """

    command = "grpo"  # the `posttrain` command this class runs

    def __init__(
        self,
        model: Optional[str] = None,
        reward_funcs: Union[None, Callable, str, Sequence[Union[Callable, str]]] = None,
        train_dataset: Optional[Dataset] = None,
        eval_dataset: Optional[Dataset] = None,
        config: Config = None,
        reward_weights: Optional[Sequence[float]] = None,
    ):
        base_overrides = _config_overrides(config)
        base = _load(config, base_overrides, self.command)
        overrides = list(base_overrides)
        if model is not None:
            overrides.append(_override("policy.model_name", str(model)))
            if base.sft_warmup is not None and base.sft_warmup.policy.model_name != str(model):
                overrides.append("sft_warmup=null")
        data_dir = Path(base.logger.log_dir) / "data"
        if train_dataset is not None:
            overrides += ["data.dataset=jsonl", "data.blend=[]",
                          _override("data.train_path", str(dataset_jsonl(train_dataset, data_dir, "train"))),
                          _override("data.validation_path", None if eval_dataset is None
                                    else str(dataset_jsonl(eval_dataset, data_dir, "validation")))]
        elif eval_dataset is not None:
            overrides.append(_override("data.validation_path", str(dataset_jsonl(eval_dataset, data_dir, "validation"))))
        if reward_funcs is not None:
            from posttrain.environments.reward_fn_env import reward_fn_section

            section = reward_fn_section(list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else reward_funcs,
                                        reward_weights)
            overrides += [_override("data.env_name", REWARD_ENV), _override(f"env.{REWARD_ENV}", section)]
        elif reward_weights is not None:
            raise UserError("reward_weights needs reward_funcs")
        self.config: GRPOMasterConfig = _load(config, overrides, self.command)  # type: ignore[assignment]

    def train(self) -> TrainResult:
        """Run the job (`posttrain grpo`: preflight checks, optional SFT warm start, GRPO; resumes
        from the latest checkpoint like the CLI) and return its metrics and paths."""
        from posttrain.cli import run_job
        from posttrain.utils.logger import METRICS_FILE, read_metrics_jsonl

        run_job(self.command, self.config)
        log_dir = Path(self.config.logger.log_dir)
        history = read_metrics_jsonl(log_dir / METRICS_FILE) if (log_dir / METRICS_FILE).exists() else {}
        return TrainResult(metrics=history[max(history)] if history else {}, history=history, log_dir=log_dir,
                           checkpoint=self.latest_checkpoint(), config=self.config)

    def latest_checkpoint(self) -> Optional[Path]:
        """The latest `step_N` under `checkpointing.checkpoint_dir`, or None."""
        from posttrain.models.paths import latest_step_dir

        ckpt = self.config.checkpointing
        return latest_step_dir(Path(ckpt.checkpoint_dir)) if ckpt.enabled else None

    def evaluate(self, dataset: Optional[Dataset] = None, num_generations_per_prompt: int = 1) -> dict[str, float]:
        """`posttrain eval` of the latest checkpoint (before any: `policy.model_name`) on `dataset`
        (default None: the validation rows), scored by the same environments; greedy for
        `num_generations_per_prompt` 1 (default), else sampled with pass@k. Logs under
        `<logger.log_dir>/eval` (`eval_results.jsonl`); returns the metrics."""
        from posttrain.cli import run_job
        from posttrain.config import EvalMasterConfig

        cfg, g = self.config, self.config.grpo
        data = cfg.data
        if dataset is not None:
            path = dataset_jsonl(dataset, Path(cfg.logger.log_dir) / "data", "validation")
            data = data.model_copy(update={"dataset": "jsonl", "blend": [], "validation_path": str(path),
                                           "train_path": data.train_path or str(path)})
        checkpoint = self.latest_checkpoint()
        policy = cfg.policy.model_copy(update={"model_name": str(checkpoint)} if checkpoint else {})
        eval_cfg = EvalMasterConfig.model_validate({
            "policy": policy.model_dump(), "data": data.model_dump(), "env": cfg.env.model_dump(),
            "cluster": cfg.cluster.model_dump(), "checkpointing": {"enabled": False},
            "logger": {**cfg.logger.model_dump(), "log_dir": str(Path(cfg.logger.log_dir) / "eval"),
                       "tensorboard_enabled": False, "report": False},
            "eval": {"num_generations_per_prompt": num_generations_per_prompt, "max_samples": g.max_val_samples,
                     "batch_size": g.val_batch_size, "max_rollout_turns": g.max_rollout_turns, "seed": g.seed},
        })
        return run_job("eval", eval_cfg)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(config=<{len(config_to_yaml(self.config).splitlines())} lines>, "
                f"model={self.config.policy.model_name!r})")


class PPO(GRPO):
    """PPO with a critic (`posttrain ppo`) on your reward functions and data: `GRPO`'s arguments,
    with the `critic` section in `config` (default None: the embedded `ppo_tiny.yaml`)."""

    command = "ppo"


# ------------------------------------------------------------------------------------- helpers
def _override(key: str, value: Any) -> str:
    """`key=value` with the value as JSON (which YAML reads back exactly)."""
    return f"{key}={json.dumps(value, default=str)}"


def _config_overrides(config: Config) -> list[str]:
    """A dict config's keys as overrides of the embedded default (sections merge key by key)."""
    if not isinstance(config, dict):
        return []
    return [_override(str(key), value) for key, value in config.items()]


def _load(config: Config, overrides: list[str], command: str = "grpo") -> GRPOMasterConfig:
    """The config `config` names with `overrides` applied, validated for `command` (a `ConfigError`
    names the key)."""
    if isinstance(config, GRPOMasterConfig):
        import tempfile

        # Through the loader, so overrides and their errors work as for a YAML file.
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="posttrain-config-", delete=False) as f:
            f.write(config_to_yaml(config))
        try:
            return load_config(command, f.name, overrides)  # type: ignore[return-value]
        finally:
            os.unlink(f.name)
    if config is None or isinstance(config, dict):
        return load_config(command, None, overrides)  # type: ignore[return-value]
    if isinstance(config, (str, os.PathLike)):
        return load_config(command, config, overrides)  # type: ignore[return-value]
    raise UserError(f"config must be a GRPOMasterConfig, a YAML path or a dict, got {type(config).__name__}")


def dataset_jsonl(dataset: Dataset, directory: Path, split: str) -> Path:
    """A JSONL file of `dataset`: a path is used as it is; rows (a list of dicts or a
    `datasets.Dataset`) are written to `<directory>/<split>-<content hash>.jsonl` (atomically; the
    same rows give the same file, so a rerun resumes against the same data)."""
    if isinstance(dataset, (str, os.PathLike)):
        path = Path(dataset)
        if not path.is_file():
            raise UserError(f"{split} dataset {str(path)!r}: no such JSONL file")
        return path
    if isinstance(dataset, dict):
        raise UserError(f"{split} dataset must be a list of rows (dicts), a datasets.Dataset or a JSONL path, not a dict")
    lines = []
    for i, row in enumerate(dataset):
        if not isinstance(row, dict):
            raise UserError(f"{split} dataset row {i}: expected a dict of columns, got {type(row).__name__}")
        try:
            lines.append(json.dumps(row, ensure_ascii=False))
        except (TypeError, ValueError) as e:
            column = next((k for k, v in row.items() if not _json_ok(v)), "?")
            raise UserError(f"{split} dataset row {i}, column {column!r}: not JSON-serialisable ({e})") from None
    if not lines:
        raise UserError(f"{split} dataset has no rows")
    text = "\n".join(lines) + "\n"
    path = directory / f"{split}-{hashlib.sha1(text.encode()).hexdigest()[:12]}.jsonl"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return path


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False
