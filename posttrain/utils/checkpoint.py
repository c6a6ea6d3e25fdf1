"""Checkpoint directories: atomic finalisation, top-k retention, resume lookup.

Layout (`checkpointing.checkpoint_dir`):

    step_N/
      training_info.json   {"step": N, "metrics": {...}, ...caller's training info}
      config.yaml          written by the caller (posttrain.config)
      policy/              written by the policy's own save_checkpoint
      dataloader.json, rng.pt, ...   whatever else the caller saves

Protocol (after NeMo-RL's `CheckpointManager`, nemo_rl/utils/checkpoint.py):

    path = manager.begin(step)              # empty tmp_step_N/
    policy.save_checkpoint(path / "policy") # the caller fills it
    manager.finalize(step, path, metrics={"validation/accuracy": 0.8}, training_info={...})

`finalize` writes `training_info.json` last and then renames `tmp_step_N` to `step_N` (one atomic
rename), so a `step_N` directory is complete by construction. A crash before the rename leaves
only a `tmp_step_N`, which `latest()` ignores and removes. Re-saving an existing step swaps it
through `old_step_N`, and a crash inside the swap is repaired on the next start.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional

from posttrain.config.schema import CheckpointingConfig
from posttrain.utils.metric_names import metric_value

log = logging.getLogger(__name__)

TRAINING_INFO_FILE = "training_info.json"
_STEP_DIR_RE = re.compile(r"^step_(\d+)$")
_TMP_DIR_RE = re.compile(r"^tmp_step_(\d+)$")
_OLD_DIR_RE = re.compile(r"^old_step_(\d+)$")


def load_training_info(path: str | os.PathLike) -> dict[str, Any]:
    """Read `<path>/training_info.json` of a checkpoint directory."""
    info_path = Path(path) / TRAINING_INFO_FILE
    if not info_path.is_file():
        raise FileNotFoundError(f"{info_path} not found: {path} is not a finalized checkpoint directory")
    try:
        return json.loads(info_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{info_path}: invalid JSON ({e})") from None


def publish_dir(tmp: Path, final: Path, old: Optional[Path] = None) -> Path:
    """Rename the finished directory `tmp` to `final`, atomically.

    An existing `final` is swapped out through `old` (default `<final>.old`) and then removed, so
    at every moment `final` is either the previous complete version or the new one.
    """
    tmp, final = Path(tmp), Path(final)
    if final.exists():
        old = Path(old) if old is not None else final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    return final


def _fsync_dir(path: Path) -> None:
    # Make a rename durable; not every platform / filesystem lets a directory be opened.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def complete_checkpoints(checkpoint_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """The complete checkpoints (`step_N` with its training info) of `checkpoint_dir` as
    `(step, path)`, oldest first; reads only (no clean-up of crash leftovers)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    found = []
    for path in checkpoint_dir.iterdir():
        match = _STEP_DIR_RE.match(path.name)
        if match and (path / TRAINING_INFO_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


class CheckpointManager:
    """Create, finalize, prune and find checkpoints under `cfg.checkpoint_dir`.

    Args:
        cfg: `CheckpointingConfig`: `checkpoint_dir` (default `checkpoints/run`), `save_period`
            (default 50), `keep_top_k` (default 3; None keeps all), `metric_name` (default
            `validation/accuracy`, which stands for the run's accuracy, greedy or sampled: see
            `posttrain.utils.metric_names`; None ranks by recency), `higher_is_better` (default True).
            Retention: the best `keep_top_k` by `metric_name` (ties favour the newer
            checkpoint; checkpoints without the metric rank last), plus always the latest.
    """

    def __init__(self, cfg: CheckpointingConfig):
        self.cfg = cfg
        self.checkpoint_dir = Path(cfg.checkpoint_dir)
        self._in_progress: set[Path] = set()
        self.recover()

    # ----------------------------------------------------------------------------- saving
    def should_save(self, step: int, is_last_step: bool = False) -> bool:
        """Whether `step` is a save step: enabled and every `save_period` steps, or the last one."""
        return self.cfg.enabled and (step % self.cfg.save_period == 0 or is_last_step)

    def begin(self, step: int) -> Path:
        """Create and return an empty `tmp_step_<step>/` for the caller to fill."""
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        tmp_path = self.checkpoint_dir / f"tmp_step_{step}"
        if tmp_path.exists():  # left by a crashed save of the same step
            shutil.rmtree(tmp_path)
        tmp_path.mkdir()
        self._in_progress.add(tmp_path)
        return tmp_path

    def finalize(
        self,
        step: int,
        tmp_path: str | os.PathLike,
        metrics: Optional[Mapping[str, float]] = None,
        training_info: Optional[Mapping[str, Any]] = None,
    ) -> Path:
        """Write `training_info.json`, atomically publish `tmp_path` as `step_<step>/`, then prune.

        Args:
            step: the step the checkpoint belongs to.
            tmp_path: the directory `begin(step)` returned.
            metrics: flat metrics of this step; `cfg.metric_name` among them ranks the checkpoint.
            training_info: extra resume state (e.g. `consumed_samples`, `epoch`), stored as is.
        Returns:
            the final `step_<step>` directory.
        """
        tmp_path = Path(tmp_path)
        if not tmp_path.is_dir():
            raise FileNotFoundError(f"{tmp_path} does not exist: call begin({step}) first")
        info = {**dict(training_info or {}), "step": step, "metrics": dict(metrics or {})}
        info_path = tmp_path / TRAINING_INFO_FILE
        with open(info_path, "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2, default=float, allow_nan=True)
            f.flush()
            os.fsync(f.fileno())

        final_path = self.checkpoint_dir / f"step_{step}"
        old_path = self.checkpoint_dir / f"old_step_{step}"
        # `recover` repairs a crash mid-swap by moving old_step_N back when step_N is missing.
        publish_dir(tmp_path, final_path, old_path)
        _fsync_dir(self.checkpoint_dir)
        self._in_progress.discard(tmp_path)
        self.prune()
        return final_path

    # --------------------------------------------------------------------------- finding
    def recover(self) -> None:
        """Remove leftovers of crashed saves (not those of a save in progress in this process)."""
        if not self.checkpoint_dir.is_dir():
            return
        for path in self.checkpoint_dir.iterdir():
            old = _OLD_DIR_RE.match(path.name)
            if old:
                final_path = self.checkpoint_dir / f"step_{old.group(1)}"
                if final_path.exists():
                    shutil.rmtree(path)
                else:  # crashed mid-swap: the old checkpoint is still the valid one
                    os.rename(path, final_path)
            elif _TMP_DIR_RE.match(path.name) and path not in self._in_progress:
                log.info("removing incomplete checkpoint %s", path)
                shutil.rmtree(path)

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as `(step, path)`, oldest first."""
        return complete_checkpoints(self.checkpoint_dir)

    def latest(self) -> Optional[Path]:
        """The complete checkpoint with the highest step, or None. Cleans crash leftovers first."""
        self.recover()
        found = self.checkpoints()
        return found[-1][1] if found else None

    def _metric(self, path: Path) -> Optional[float]:
        if self.cfg.metric_name is None:
            return None
        try:
            value = float(metric_value(load_training_info(path).get("metrics", {}), self.cfg.metric_name))
        except (FileNotFoundError, ValueError, TypeError, AttributeError):
            return None
        return value if math.isfinite(value) else None

    def ranked(self) -> list[Path]:
        """Complete checkpoints, best first: by `metric_name` (direction per `higher_is_better`),
        ties and checkpoints without the metric ordered newest first, the latter after the rest."""
        sign = 1.0 if self.cfg.higher_is_better else -1.0

        def key(item: tuple[int, Path]) -> tuple[bool, float, int]:
            step, path = item
            value = self._metric(path)
            return (value is not None, sign * value if value is not None else 0.0, step)

        return [path for _, path in sorted(self.checkpoints(), key=key, reverse=True)]

    def best(self) -> Optional[Path]:
        """The best checkpoint by `metric_name` (the latest when none has the metric), or None."""
        ranked = self.ranked()
        return ranked[0] if ranked else None

    def prune(self) -> list[Path]:
        """Delete checkpoints outside the best `keep_top_k`, never the latest; returns the deleted."""
        if self.cfg.keep_top_k is None:
            return []
        found = self.checkpoints()
        if not found:
            return []
        keep = set(self.ranked()[: self.cfg.keep_top_k]) | {found[-1][1]}
        deleted = [path for _, path in found if path not in keep]
        for path in deleted:
            log.info("removing checkpoint %s (outside keep_top_k=%d)", path, self.cfg.keep_top_k)
            shutil.rmtree(path)
        return deleted

    @staticmethod
    def load_training_info(path: str | os.PathLike) -> dict[str, Any]:
        """Read `<path>/training_info.json` (see the module-level function)."""
        return load_training_info(path)
