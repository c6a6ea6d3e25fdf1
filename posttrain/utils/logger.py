"""Metrics logging: JSONL (always), TensorBoard, W&B and MLflow (when enabled), and a progress bar.

Every `Logger.log_metrics(metrics, step)` call appends one JSON object to
`<logger.log_dir>/metrics.jsonl`: `{"step": N, "train/reward": 0.4, ...}` with flat metric names
(`train/...`, `validation/...`, `timing/train/...`; docs/getting-started.md, "Outputs"). Several calls may share a
step (train, timing and validation metrics are logged separately); readers merge lines by step
(`read_metrics_jsonl`). A resumed run passes `resume_step` (the step of the checkpoint it loaded) so
lines and TensorBoard points logged after that checkpoint by the crashed run are dropped first.

The run config is saved by `posttrain.config`, not here.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from posttrain.config.schema import LoggerConfig
from posttrain.utils.metric_names import ACCURACY_NAMES

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def _to_float(key: str, value: Any) -> Optional[float]:
    """A metric value as float (None for NaN / inf, written as JSON null); TypeError if not a number."""
    if hasattr(value, "item") and not isinstance(value, numbers.Real):
        try:
            value = value.item()  # torch / numpy scalars and one-element tensors
        except (ValueError, RuntimeError):
            raise TypeError(f"metric {key!r} must be a single number, got shape {tuple(value.shape)}") from None
    if not isinstance(value, numbers.Real):  # bool counts as a number (0 / 1)
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}: {str(value)[:100]!r}")
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics_jsonl(path: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """Read a metrics file into `{step: {name: value}}`, merging lines that share a step.

    Raises ValueError naming the file and line of a malformed line.
    """
    merged: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = int(record.pop("step"))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"{path}:{line_no}: not a metrics record with a 'step' ({e}): {line[:200]!r}") from None
            merged.setdefault(step, {}).update(record)
    return dict(sorted(merged.items()))


def truncate_metrics_jsonl(path: str | os.PathLike, step: int) -> int:
    """Keep only the lines of `path` with `"step" <= step`; returns how many lines were dropped.

    Written to a temporary file and renamed over the original, so a crash cannot lose lines.
    """
    path = Path(path)
    if not path.exists():
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                keep = int(json.loads(line)["step"]) <= step
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                keep = False  # a torn last line from a crash
            if keep:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
    return dropped


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _require(module: str, key: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"{key}=true but the '{module}' package is not installed; `pip install {module}` or set {key}=false"
        ) from None


class Logger:
    """Fan metrics out to JSONL, TensorBoard, W&B and MLflow.

    Args:
        cfg: `LoggerConfig`: `log_dir` (default `logs/run`), `tensorboard_enabled` (default True),
            `wandb.enabled` / `mlflow.enabled` (default False).
        resume_step: step of the checkpoint a resumed run starts from; metrics the previous run
            logged for later steps are removed (JSONL lines, TensorBoard points). None (default)
            for a fresh run, which appends to an existing file as is.
    """

    def __init__(self, cfg: LoggerConfig, resume_step: Optional[int] = None):
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.log_dir / METRICS_FILE
        if resume_step is not None:
            self.truncate_after(resume_step)
        self._jsonl = open(self.metrics_path, "a", encoding="utf-8")

        self._tensorboard = None
        self._open_tensorboard(resume_step)

        self._wandb_run = None
        if cfg.wandb.enabled:
            wandb = _require("wandb", "logger.wandb.enabled")
            self._wandb_run = wandb.init(
                project=cfg.wandb.project,
                name=cfg.wandb.name,
                mode=cfg.wandb.mode,
                dir=str(self.log_dir),
                resume="allow",
            )

        self._mlflow = None
        if cfg.mlflow.enabled:
            mlflow = _require("mlflow", "logger.mlflow.enabled")
            if cfg.mlflow.tracking_uri:
                mlflow.set_tracking_uri(cfg.mlflow.tracking_uri)
            mlflow.set_experiment(cfg.mlflow.experiment_name)
            mlflow.start_run(run_name=cfg.mlflow.run_name)
            self._mlflow = mlflow

    def _open_tensorboard(self, resume_step: Optional[int]) -> None:
        if not self.cfg.tensorboard_enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        if self._tensorboard is not None:
            self._tensorboard.close()
        # purge_step hides points the crashed run wrote after the checkpoint.
        purge_step = resume_step + 1 if resume_step is not None else None
        self._tensorboard = SummaryWriter(log_dir=str(self.log_dir / "tensorboard"), purge_step=purge_step)

    def truncate_after(self, step: int) -> int:
        """Drop metrics the previous run logged after `step` (a resumed run re-logs them): the
        metrics.jsonl lines with `"step" > step` and, through a purge marker, the TensorBoard
        points. Returns the number of JSONL lines dropped."""
        if getattr(self, "_tensorboard", None) is not None:
            self._open_tensorboard(step)
        reopen = getattr(self, "_jsonl", None) is not None and not self._jsonl.closed
        if reopen:
            self._jsonl.close()
        dropped = truncate_metrics_jsonl(self.metrics_path, step)
        if reopen:
            self._jsonl = open(self.metrics_path, "a", encoding="utf-8")
        if dropped:
            log.info("dropped %d metric lines after step %d from %s", dropped, step, self.metrics_path)
        return dropped

    def log_metrics(self, metrics: Mapping[str, Any], step: int, prefix: str = "",
                    records: Optional[Mapping[str, Any]] = None) -> None:
        """Record `metrics` at `step`; names get `prefix` prepended (e.g. `"timing/train/"`).

        Values must be numbers (python, numpy or single-element torch); NaN / inf are written as
        null in JSONL and skipped by the other backends. `records` (default None) are JSON values
        that are no numbers (e.g. `recovery/failures`, a list of lines), written to the same JSONL
        line only.
        """
        values = {f"{prefix}{key}": _to_float(f"{prefix}{key}", value) for key, value in metrics.items()}
        self._jsonl.write(json.dumps({"step": int(step), **values, **(records or {})}) + "\n")
        self._jsonl.flush()
        finite = {key: value for key, value in values.items() if value is not None}
        if self._tensorboard is not None:
            for key, value in finite.items():
                self._tensorboard.add_scalar(key, value, global_step=step)
            self._tensorboard.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(finite, step=step)
        if self._mlflow is not None:
            # MLflow metric keys may not contain some characters used elsewhere; '/' is allowed.
            self._mlflow.log_metrics(finite, step=step)

    def log_samples(self, samples: Sequence[Mapping[str, Any]], step: int, tag: str = "validation/samples") -> None:
        """Show a few completions: on the console (`format_samples`, short) and, with TensorBoard,
        as a markdown table under `tag` at `step` (TEXT tab; the full texts, up to
        `TABLE_TEXT_CHARS` each). `samples` are `{"prompt", "response", "reward"}` dicts."""
        if not samples:
            return
        write_line(format_samples(samples, f"{tag} at step {step}"))
        if self._tensorboard is not None:
            self._tensorboard.add_text(tag, samples_table(samples), global_step=step)
            self._tensorboard.flush()

    def log_hyperparams(self, config: Mapping[str, Any]) -> None:
        """Record the run config (nested dict, e.g. `cfg.model_dump()`) with each backend."""
        if self._tensorboard is not None:
            text = json.dumps(config, indent=2, default=str)
            self._tensorboard.add_text("config", f"```\n{text}\n```", global_step=0)
            self._tensorboard.flush()
        if self._wandb_run is not None:
            self._wandb_run.config.update(dict(config), allow_val_change=True)
        if self._mlflow is not None:
            # MLflow params are strings of bounded length.
            self._mlflow.log_params({key: str(value)[:500] for key, value in _flatten(config).items()})

    def close(self) -> None:
        """Flush and close every backend. Safe to call twice."""
        if not self._jsonl.closed:
            self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self._mlflow is not None:
            self._mlflow.end_run()
            self._mlflow = None

    def __enter__(self) -> "Logger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------ sample completions
CONSOLE_PROMPT_CHARS = 60  # the end of a prompt (where the question usually is) on the console
CONSOLE_RESPONSE_CHARS = 120  # the start of a response on the console
TABLE_TEXT_CHARS = 2000  # per cell of the TensorBoard table


def _clip(text: str, limit: int, keep_end: bool = False) -> str:
    if len(text) <= limit:
        return text
    return "…" + text[-limit + 1:] if keep_end else text[: limit - 1] + "…"


def format_samples(samples: Sequence[Mapping[str, Any]], title: str) -> str:
    """Console lines: a title, then one line per sample, `reward 1.00 | prompt '…' -> 'response'`
    (texts as Python literals, so newlines stay on one line; long ones clipped)."""
    lines = [f"[posttrain] {title}:"]
    for sample in samples:
        prompt = _clip(str(sample["prompt"]), CONSOLE_PROMPT_CHARS, keep_end=True)
        response = _clip(str(sample["response"]), CONSOLE_RESPONSE_CHARS)
        lines.append(f"  reward {float(sample['reward']):.2f} | {prompt!r} -> {response!r}")
    return "\n".join(lines)


def _cell(text: str) -> str:
    """Text as one markdown table cell: HTML (`<|end|>`) and pipes escaped, newlines as <br>."""
    import html

    text = html.escape(_clip(str(text), TABLE_TEXT_CHARS), quote=False).replace("\\", "\\\\").replace("|", "\\|")
    return text.replace("\r\n", "\n").replace("\n", "<br>")


def samples_table(samples: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table of `{"prompt", "response", "reward"}` rows (TensorBoard renders it)."""
    rows = ["| prompt | response | reward |", "|---|---|---|"]
    rows += [f"| {_cell(s['prompt'])} | {_cell(s['response'])} | {float(s['reward']):.4g} |" for s in samples]
    return "\n".join(rows)


def write_line(text: str) -> None:
    """Print `text` on stdout; above a drawn progress bar when there is one (tqdm clears and redraws
    it), so the bar does not swallow the lines."""
    if "tqdm" in sys.modules:
        from tqdm import tqdm

        tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()
    else:
        print(text, flush=True)


# Postfix label -> metric names (the first one a step reports is shown), in display order.
PROGRESS_METRICS = {
    "reward": ("train/reward",),
    "val_acc": ACCURACY_NAMES,
    "loss": ("train/loss",),
    "step_s": ("timing/train/total_step_time",),
}


class ProgressBar:
    """A tqdm bar over training steps whose postfix shows reward, validation accuracy, loss, step time.

    On a terminal it draws a tqdm bar; when stderr is not a terminal (CI, `nohup`, log files) it
    prints one plain line per step instead, so the log still shows progress. Validation accuracy
    keeps its last value between validations.

    Args:
        total: number of steps of the run.
        enabled: False prints nothing (`logger.progress_bar`). Defaults to True.
        initial: steps already done (resumed run). Defaults to 0.
        desc: label in front of the bar. Defaults to "train".
    """

    def __init__(self, total: int, enabled: bool = True, initial: int = 0, desc: str = "train"):
        self.enabled = enabled
        self.total = total
        self.step = initial
        self.desc = desc
        self._latest: dict[str, float] = {}
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    def postfix(self) -> dict[str, str]:
        """The labels and formatted values currently shown."""
        return {label: f"{self._latest[label]:.4g}" for label in PROGRESS_METRICS if label in self._latest}

    def update(self, metrics: Optional[Mapping[str, Any]] = None, n: int = 1) -> None:
        """Advance by `n` steps and show the known metrics among `metrics`."""
        for label, names in PROGRESS_METRICS.items():
            value = next(((metrics or {})[name] for name in names if (metrics or {}).get(name) is not None), None)
            if value is not None:
                self._latest[label] = float(value)
        self.step += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix(self.postfix(), refresh=False)
            self._bar.update(n)
        else:
            shown = " ".join(f"{label}={value}" for label, value in self.postfix().items())
            print(f"{self.desc} step {self.step}/{self.total} {shown}".rstrip(), file=sys.stderr, flush=True)

    def go_to(self, step: int) -> None:
        """Show `step` steps done (a run that went back to an earlier checkpoint), without a line."""
        if step == self.step:
            return
        self.step = step
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def write(self, line: str) -> None:
        """Print `line` on stdout above the bar (a plain print would land inside the drawn bar)."""
        if self._bar is not None:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
