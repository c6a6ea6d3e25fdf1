"""What every trainer of the Python API shares: `TrainResult`, the `Trainer` base (config in any
form, callbacks, the job, the trained model), data sets as JSONL files, and the rows' columns.

A trainer only writes a config: data sets become JSONL files under `<logger.log_dir>/data/`
(`data.dataset: jsonl`), reward functions an `env.rewards` section, and `train()` runs
`posttrain.cli.run_job`, exactly what `posttrain <command> --config <logger.log_dir>/config.yaml`
runs. Errors are `posttrain.errors.UserError`s with the CLI's one-line messages.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from posttrain.config import config_to_yaml, load_config
from posttrain.config.schema import SCHEMAS, MasterConfig
from posttrain.errors import UserError

REWARD_ENV = "rewards"  # the env section (and task name) the reward functions serve
Dataset = Union[str, os.PathLike, Sequence[dict], Any]  # a JSONL path, a list of dicts or a datasets.Dataset
Config = Union[None, str, os.PathLike, dict, MasterConfig]
# An object with `on_step_end(step, metrics) -> bool` or such a function; True stops the run.
Callback = Any
RewardFuncs = Union[None, Callable, str, Sequence[Union[Callable, str]]]


@dataclass
class TrainResult:
    """What a trainer's `train()` ran and left.

    Attributes:
        metrics: the last logged step's metrics (`train/...`, `validation/...`, `timing/...`).
        history: every logged step's metrics, `{step: {name: value}}` (step 0: the validation
            before training); the run's metrics.jsonl, merged by step.
        log_dir: `logger.log_dir` (metrics.jsonl, TensorBoard, config.yaml, report.png).
        checkpoint: the latest `step_N` checkpoint (a model for `policy.model_name`, `posttrain
            eval` or `posttrain convert`), or None when checkpointing is off.
        config: the config the job ran.
        export_dir: the Hugging Face export the job wrote (`sft.export_dir`, `rm.export_dir`), or None.
    """

    metrics: dict[str, float]
    history: dict[int, dict[str, float]]
    log_dir: Path
    checkpoint: Optional[Path] = None
    config: Optional[MasterConfig] = field(default=None, repr=False)
    export_dir: Optional[Path] = None

    def model_dir(self) -> Path:
        """A Hugging Face directory of the trained model: the job's export, else the latest
        checkpoint converted once (cached, as `policy.model_name=<step_N>` converts it)."""
        if self.export_dir is not None and (self.export_dir / "config.json").is_file():
            return self.export_dir
        if self.checkpoint is None:
            raise UserError("the run left no model to load: checkpointing.enabled=false and no export_dir; "
                            "enable checkpointing (the default) to load the trained model")
        from posttrain.models.policy.checkpoint import converted_checkpoint

        return converted_checkpoint(self.checkpoint)

    def load_model(self) -> tuple[Any, Any]:
        """`(model, tokenizer)` of the trained model as transformers loads them: an
        `AutoModelForCausalLM`, or an `AutoModelForSequenceClassification` for a reward model (CPU,
        float32, eval mode)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        path = self.model_dir()
        architectures = AutoConfig.from_pretrained(path).architectures or []
        reward = any(a.endswith("ForSequenceClassification") for a in architectures)
        model_class = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
        return model_class.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


class Trainer:
    """The base of `GRPO`, `SFT`, `DPO`, `RewardModel` and `Distill`: a validated config for
    `posttrain <command>`, run by `train()`.

    Subclasses set `command` (the CLI command and config schema) and `section` (the config section
    of the run's schedule, whose steps the callbacks see; not the SFT warm start's), and build
    `self.config` with `load_trainer_config`.
    """

    command: str = ""
    section: str = ""
    export_key: Optional[str] = None  # `<section>.export_dir` for the trainers that export

    def __init__(self, config: MasterConfig, callbacks: Optional[Sequence[Callback]] = None):
        self.config = config
        self.callbacks = list(callbacks or [])
        for callback in self.callbacks:
            if not callable(getattr(callback, "on_step_end", callback)):
                raise UserError(f"callbacks: {callback!r} is neither a function nor an object with on_step_end(step, metrics)")
        self.result: Optional[TrainResult] = None
        self._loaded: Optional[tuple[Any, Any]] = None

    def train(self) -> TrainResult:
        """Run the job (preflight checks, warm starts, training; resumes from the latest
        checkpoint like the CLI) and return its metrics and paths."""
        from posttrain.algorithms.loop import step_callbacks
        from posttrain.cli import run_job
        from posttrain.utils.logger import METRICS_FILE, read_metrics_jsonl

        with step_callbacks(self.callbacks, self.section):
            run_job(self.command, self.config)
        log_dir = Path(self.config.logger.log_dir)
        history = read_metrics_jsonl(log_dir / METRICS_FILE) if (log_dir / METRICS_FILE).exists() else {}
        export = getattr(getattr(self.config, self.section), "export_dir", None)
        self.result = TrainResult(metrics=history[max(history)] if history else {}, history=history, log_dir=log_dir,
                                  checkpoint=self.latest_checkpoint(), config=self.config,
                                  export_dir=Path(export) if export else None)
        self._loaded = None
        return self.result

    def latest_checkpoint(self) -> Optional[Path]:
        """The latest `step_N` under `checkpointing.checkpoint_dir`, or None."""
        from posttrain.models.paths import latest_step_dir

        ckpt = self.config.checkpointing
        return latest_step_dir(Path(ckpt.checkpoint_dir)) if ckpt.enabled else None

    def _trained(self) -> tuple[Any, Any]:
        if self.result is None:
            raise UserError(f"{type(self).__name__}.model and .tokenizer are the trained model: call train() first")
        if self._loaded is None:
            self._loaded = self.result.load_model()
        return self._loaded

    def evaluate(self, dataset: Optional[Dataset] = None, num_generations_per_prompt: int = 1,
                 reward_funcs: RewardFuncs = None, reward_weights: Optional[Sequence[float]] = None) -> dict[str, float]:
        """`posttrain eval` of the latest checkpoint (the export without one; before any:
        `policy.model_name`) on `dataset` (default None: the run's validation rows), scored by the
        run's environments or `reward_funcs`; greedy for `num_generations_per_prompt` 1 (default),
        else sampled with pass@k. Logs under `<logger.log_dir>/eval` (`eval_results.jsonl`);
        returns the metrics."""
        from posttrain.cli import run_job

        checkpoint = self.latest_checkpoint()
        export = getattr(getattr(self.config, self.section), "export_dir", None)
        model = str(checkpoint) if checkpoint else (export if export and Path(export, "config.json").is_file() else None)
        return run_job("eval", evaluate_config(
            self.config, model=model, dataset=dataset, reward_funcs=reward_funcs, reward_weights=reward_weights,
            num_generations_per_prompt=num_generations_per_prompt, **self.eval_sizes()))

    def eval_sizes(self) -> dict[str, int]:
        """`evaluate`'s `max_samples`, `batch_size`, `max_rollout_turns` and `seed`: the run's
        validation settings (its section's `max_val_samples`, `val_batch_size`, ...)."""
        s = getattr(self.config, self.section)
        return {"max_samples": s.max_val_samples, "batch_size": s.val_batch_size,
                "max_rollout_turns": getattr(s, "max_rollout_turns", 1), "seed": s.seed}

    @property
    def model(self) -> Any:
        """The trained model as a transformers model (`TrainResult.load_model`), after `train()`."""
        return self._trained()[0]

    @property
    def tokenizer(self) -> Any:
        """The trained model's tokenizer, after `train()`."""
        return self._trained()[1]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(config=<{len(config_to_yaml(self.config).splitlines())} lines>, "
                f"model={self.config.policy.model_name!r})")


# ----------------------------------------------------------------------------------- the config
def override(key: str, value: Any) -> str:
    """`key=value` with the value as JSON (which YAML reads back exactly)."""
    return f"{key}={json.dumps(value, default=str)}"


def config_overrides(config: Config) -> list[str]:
    """A dict config's keys as overrides of the embedded default (sections merge key by key)."""
    if not isinstance(config, dict):
        return []
    return [override(str(key), value) for key, value in config.items()]


def load_trainer_config(command: str, config: Config, overrides: Sequence[str]) -> MasterConfig:
    """The config `config` names for `posttrain <command>` with `overrides` applied, validated (a
    `ConfigError` names the key): a config object of the command's schema, a YAML path, a dict of
    keys over the embedded default (its keys come first in `overrides`), or None for the default."""
    schema = SCHEMAS[command]
    if isinstance(config, MasterConfig):
        if not isinstance(config, schema):
            raise UserError(f"config is a {type(config).__name__}; {command} needs a {schema.__name__}")
        import tempfile

        # Through the loader, so overrides and their errors work as for a YAML file.
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="posttrain-config-", delete=False) as f:
            f.write(config_to_yaml(config))
        try:
            return load_config(command, f.name, list(overrides))
        finally:
            os.unlink(f.name)
    if config is None or isinstance(config, dict):
        return load_config(command, None, list(overrides))
    if isinstance(config, (str, os.PathLike)):
        return load_config(command, config, list(overrides))
    raise UserError(f"config must be a {schema.__name__}, a YAML path or a dict, got {type(config).__name__}")


def model_overrides(base: MasterConfig, model: Optional[str], model_key: str = "policy.model_name",
                    warm_key: str = "sft_warmup") -> list[str]:
    """`model` as `model_key`; the config's SFT warm start (`warm_key`) is dropped unless it trains
    that same model (it would replace it)."""
    if model is None:
        return []
    if not isinstance(model, (str, os.PathLike)):
        raise UserError(f"model must be a name or a path (a hub id, a local HF directory, a step_N checkpoint or a "
                        f"preset such as 'tiny'), got {type(model).__name__}; save a transformers model with "
                        "save_pretrained and pass its directory")
    found = [override(model_key, str(model))]
    warm = getattr(base, warm_key, None)
    if warm is not None and warm.policy.model_name != str(model):
        found.append(f"{warm_key}=null")
    return found


def prompt_data_overrides(base: MasterConfig, train_dataset: Optional[Dataset], eval_dataset: Optional[Dataset],
                          reward_funcs: RewardFuncs = None, reward_weights: Optional[Sequence[float]] = None) -> list[str]:
    """Prompt rows (`{"prompt": text or chat messages, <other columns>}`) as the job's JSONL data,
    and reward functions as its `env.rewards` section (`posttrain.environments.reward_fn_env`)."""
    data_dir = Path(base.logger.log_dir) / "data"
    found = []
    if train_dataset is not None:
        found += ["data.dataset=jsonl", "data.blend=[]",
                  override("data.train_path", str(dataset_jsonl(train_dataset, data_dir, "train"))),
                  override("data.validation_path", None if eval_dataset is None
                           else str(dataset_jsonl(eval_dataset, data_dir, "validation")))]
    elif eval_dataset is not None:
        found.append(override("data.validation_path", str(dataset_jsonl(eval_dataset, data_dir, "validation"))))
    if reward_funcs is not None:
        from posttrain.environments.reward_fn_env import reward_fn_section

        section = reward_fn_section(list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else reward_funcs,
                                    reward_weights)
        found += [override("data.env_name", REWARD_ENV), override(f"env.{REWARD_ENV}", section)]
    elif reward_weights is not None:
        raise UserError("reward_weights needs reward_funcs")
    return found


def rows_data_overrides(base: MasterConfig, train_dataset: Optional[Dataset], eval_dataset: Optional[Dataset],
                        normalize: Callable[[dict, str], dict]) -> list[str]:
    """Rows with TRL's columns (SFT, preference pairs) turned by `normalize(row, where)` into
    posttrain's, as the job's JSONL data."""
    data_dir = Path(base.logger.log_dir) / "data"
    found = []
    if train_dataset is not None:
        rows = [normalize(row, f"train dataset row {i}") for i, row in enumerate(dataset_rows(train_dataset, "train"))]
        found += ["data.dataset=jsonl", "data.blend=[]",
                  override("data.train_path", str(dataset_jsonl(rows, data_dir, "train"))),
                  override("data.validation_path", None)]
    if eval_dataset is not None:
        rows = [normalize(row, f"validation dataset row {i}")
                for i, row in enumerate(dataset_rows(eval_dataset, "validation"))]
        found.append(override("data.validation_path", str(dataset_jsonl(rows, data_dir, "validation"))))
    return found


def evaluate_config(cfg: Any, *, model: Optional[str], dataset: Optional[Dataset] = None,
                    reward_funcs: RewardFuncs = None, reward_weights: Optional[Sequence[float]] = None,
                    num_generations_per_prompt: int = 1, max_samples: int = 500, batch_size: int = 256,
                    max_rollout_turns: int = 1, seed: int = 42) -> Any:
    """The `posttrain eval` config of a training run `cfg`: its policy (with `model`, default None:
    `policy.model_name`), data (or `dataset` as the evaluated rows), environments (with
    `reward_funcs`) and cluster; logs under `<logger.log_dir>/eval`, no checkpoints."""
    from posttrain.config import EvalMasterConfig
    from posttrain.environments.reward_fn_env import reward_fn_section

    data = cfg.data
    if dataset is not None:
        path = str(dataset_jsonl(dataset, Path(cfg.logger.log_dir) / "data", "validation"))
        data = data.model_copy(update={"dataset": "jsonl", "blend": [], "validation_sets": {}, "validation_path": path,
                                       "train_path": data.train_path or path})
    env = cfg.env.model_dump() if hasattr(cfg, "env") else {}
    data_fields = data.model_dump()
    if reward_funcs is not None:
        env[REWARD_ENV] = reward_fn_section(list(reward_funcs) if isinstance(reward_funcs, (list, tuple))
                                            else reward_funcs, reward_weights)
        data_fields["env_name"] = REWARD_ENV
    policy = cfg.policy.model_copy(update={"model_name": model} if model else {})
    return EvalMasterConfig.model_validate({
        "policy": policy.model_dump(), "data": data_fields, "env": env,
        "cluster": cfg.cluster.model_dump(), "checkpointing": {"enabled": False},
        "logger": {**cfg.logger.model_dump(), "log_dir": str(Path(cfg.logger.log_dir) / "eval"),
                   "tensorboard_enabled": False, "report": False},
        "eval": {"num_generations_per_prompt": num_generations_per_prompt, "max_samples": max_samples,
                 "batch_size": batch_size, "max_rollout_turns": max_rollout_turns, "seed": seed},
    })


# ------------------------------------------------------------------------------------ the data
def dataset_rows(dataset: Dataset, split: str) -> list[dict]:
    """The rows of `dataset` (a JSONL path, a list of dicts or a `datasets.Dataset`) as dicts."""
    if isinstance(dataset, (str, os.PathLike)):
        path = Path(dataset)
        if not path.is_file():
            raise UserError(f"{split} dataset {str(path)!r}: no such JSONL file")
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}:{number}: not JSON ({e.msg})") from None
        return rows
    if isinstance(dataset, dict):
        raise UserError(f"{split} dataset must be a list of rows (dicts), a datasets.Dataset or a JSONL path, not a dict")
    return list(dataset)


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


def message_text(value: Any, column: str, where: str) -> str:
    """A response column as text: a string, or TRL's conversational form, a list of messages whose
    last is the assistant's (its content)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], dict) and value[-1].get("role") == "assistant":
        return str(value[-1].get("content", ""))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise UserError(f"{where}, column {column!r}: expected text or a list of messages ending with the assistant's, "
                    f"got {type(value).__name__}")
