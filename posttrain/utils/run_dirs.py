"""Safe run directories: one run per log / checkpoint directory, and resumes that match their run.

Two runs writing the same `logger.log_dir` or `checkpointing.checkpoint_dir` would interleave
metrics and overwrite each other's checkpoints without a word. So a run holds a lock file,
`<dir>/.posttrain.lock`, naming it (host, pid, process start time, command, when it took the
lock). A second run on the same directory is refused with that holder named; a lock whose
process is gone (same host, pid dead or reused by another process) is stale and taken over, so a
run killed with `kill -9` never blocks its own rerun. A lock from another host cannot be checked
and is refused, with the file to delete named.

Resuming checks the saved config (`<checkpoint_dir>/config.yaml`, written once a run has trained
a step, so runs that train nothing or fail at start-up leave it alone) against the new one: changes
that would corrupt the run (another model, other data, other batch shapes, see
`CORRUPTING_KEYS`) are refused listing the differing keys; anything else (more steps, logging,
learning rate, ...) is allowed and listed in the log.
"""

from __future__ import annotations

import atexit
import datetime as dt
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from posttrain.errors import UserError

LOCK_FILE = ".posttrain.lock"
SAVED_CONFIG_FILE = "config.yaml"

# Keys whose change makes a checkpoint mean something else: the weights belong to another model,
# the data loader position to other data, the optimizer state to another optimizer. A key
# matches itself and everything below it (`data` covers `data.train_path`).
CORRUPTING_KEYS = (
    "policy.model_name",
    "policy.tokenizer_name",
    "policy.tiny_arch",
    "policy.lora",
    "policy.optimizer.name",
    "policy.train_global_batch_size",
    "policy.max_total_sequence_length",
    "data",
    "grpo.num_prompts_per_step",
    "grpo.num_generations_per_prompt",
    "grpo.seed",
    "sft.seed",
    "dpo.seed",
    "rm.seed",
)
# ... except these, which only change what is measured (validation) or where it is written.
HARMLESS_EXCEPTIONS = ("data.validation_path", "data.num_validation")


class RunDirLocked(UserError):
    """Another live run holds the directory."""


class ResumeConfigError(UserError):
    """The new config differs from the checkpoint's in keys that would corrupt the run."""


# ------------------------------------------------------------------------------------- locks
def _process_start_time(pid: int) -> Optional[float]:
    """Start time of `pid` (seconds since the epoch), None when no such process exists."""
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # no such process (or psutil missing: fall back to a plain liveness probe)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # alive, someone else's
            return -1.0
        return -1.0


def _holder_record() -> dict[str, Any]:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "process_start_time": _process_start_time(pid),
        "locked_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }


def _describe(holder: Mapping[str, Any]) -> str:
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started "
            f"{holder.get('locked_at', '?')}, command: {holder.get('command', '?')}")


def holder_is_alive(holder: Mapping[str, Any]) -> Optional[bool]:
    """Whether the lock's process still runs: True / False on this host, None on another host."""
    if holder.get("host") != socket.gethostname():
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    started = _process_start_time(pid)
    if started is None:
        return False
    recorded = holder.get("process_start_time")
    if isinstance(recorded, (int, float)) and recorded > 0 and started > 0 and abs(started - recorded) > 1.0:
        return False  # the pid was reused by a newer process
    return True


_held: dict[Path, str] = {}  # lock file -> token of this process's lock on it
_held_guard = threading.Lock()


def acquire_dir_lock(directory: str | os.PathLike) -> Path:
    """Take `<directory>/.posttrain.lock` for this process (created with the directory).

    Re-entrant within a process (a second job of the same process on the same directory, e.g. in
    a notebook, reuses it). A stale lock (its process is gone) is replaced with a note.

    Raises:
        RunDirLocked: another live process, or a process on another host, holds it.
    """
    directory = Path(directory).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / LOCK_FILE
    with _held_guard:
        if lock in _held:
            return lock
        record = _holder_record()
        token = uuid.uuid4().hex
        record["token"] = token
        for _ in range(20):  # create, or replace a stale lock and retry; a racing run may win
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read_lock(lock)
                if holder is None and _age_s(lock) < 2.0:  # another run is writing it right now
                    time.sleep(0.1)
                    continue
                if holder is not None and holder.get("host") == record["host"] and holder.get("pid") == record["pid"]:
                    break  # this very process left it (an earlier job that did not release): take it back
                alive = holder_is_alive(holder) if holder is not None else False
                if alive is None:
                    raise RunDirLocked(
                        f"{directory} is in use by another run ({_describe(holder)}), on another host, so posttrain "
                        f"cannot tell whether it still runs; if it does not, delete {lock}, or use another "
                        f"logger.log_dir / checkpointing.checkpoint_dir"
                    ) from None
                if alive:
                    raise RunDirLocked(
                        f"{directory} is in use by another run ({_describe(holder)}); wait for it to finish, stop "
                        f"it, or use another logger.log_dir / checkpointing.checkpoint_dir"
                    ) from None
                print(f"[posttrain] taking over the stale lock of {directory} (its run is gone: "
                      f"{_describe(holder or {})})", flush=True)
                _replace_if_unchanged(lock, holder)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            break
        else:
            raise RunDirLocked(f"{directory}: could not take its lock {lock} (another run keeps taking it)")
        # Written for the re-entrant and take-back cases too, so the file names this process's token.
        _write_atomically(lock, record)
        _held[lock] = token
    return lock


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _read_lock(lock: Path) -> Optional[dict[str, Any]]:
    try:
        data = json.loads(lock.read_text())
    except (OSError, ValueError):
        return None  # half-written or unreadable: treated as stale
    return data if isinstance(data, dict) else None


def _replace_if_unchanged(lock: Path, seen: Optional[Mapping[str, Any]]) -> None:
    """Remove a stale lock, unless another run replaced it since we read it."""
    if _read_lock(lock) == seen:
        try:
            lock.unlink()
        except FileNotFoundError:
            pass


def _write_atomically(path: Path, record: Mapping[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def release_dir_lock(lock: Path) -> None:
    """Remove a lock this process holds (a lock another run took over meanwhile is left alone)."""
    with _held_guard:
        token = _held.pop(lock, None)
    if token is None:
        return
    holder = _read_lock(lock)
    if holder is not None and holder.get("token") == token:
        try:
            lock.unlink()
        except FileNotFoundError:
            pass


def release_all_locks() -> None:
    """Release every lock of this process (called at exit, and when a job ends)."""
    for lock in list(_held):
        release_dir_lock(lock)


atexit.register(release_all_locks)


def _writes_checkpoints(cfg) -> bool:
    """Training jobs with `checkpointing.enabled` (`posttrain eval` only reads models)."""
    return cfg.checkpointing.enabled and not hasattr(cfg, "eval")


def run_directories(cfg) -> list[Path]:
    """The directories a job writes: `logger.log_dir`, plus `checkpointing.checkpoint_dir` when a
    training job checkpoints."""
    dirs = [Path(cfg.logger.log_dir)]
    if _writes_checkpoints(cfg):
        dirs.append(Path(cfg.checkpointing.checkpoint_dir))
    unique: list[Path] = []
    for d in dirs:
        if d.expanduser().resolve() not in [u.expanduser().resolve() for u in unique]:
            unique.append(d)
    return unique


def lock_run_dirs(cfg, existing_only: bool = False) -> list[Path]:
    """Lock every directory of `run_directories(cfg)`; on a refusal, release the ones taken.

    `existing_only`: only those that exist (the check before a job starts, which creates no
    directory for a job that preflight may still refuse; `start_run` locks the rest)."""
    taken: list[Path] = []
    try:
        for directory in run_directories(cfg):
            if not existing_only or Path(directory).expanduser().is_dir():
                taken.append(acquire_dir_lock(directory))
    except BaseException:
        for lock in taken:
            release_dir_lock(lock)
        raise
    return taken


def release_run_dirs(cfg) -> None:
    """Release the locks `lock_run_dirs(cfg)` took (when a job ends; exit releases them too)."""
    for directory in run_directories(cfg):
        release_dir_lock(Path(directory).expanduser().resolve() / LOCK_FILE)


# (checkpoint dir, config) pairs checked before their job started (`prepare_checkpoint_dir(ahead=True)`).
_checked_ahead: set[tuple[Path, str]] = set()


def _resume_key(cfg) -> tuple[Path, str]:
    return (Path(cfg.checkpointing.checkpoint_dir).expanduser().resolve(),
            json.dumps(cfg.model_dump(mode="json"), sort_keys=True, default=str))


def prepare_checkpoint_dir(cfg, ahead: bool = False) -> None:
    """Check a resume against the saved config (`check_resume_config`) when checkpointing is on.

    `ahead=True`: the check before the job starts (`posttrain.preflight.check_run_dirs`, on the
    config the job will run with); the job's own check of that same config (`start_run`) then
    passes without saying its notes twice. A job run on its own is checked by `start_run`."""
    if not _writes_checkpoints(cfg):
        return
    key = _resume_key(cfg)
    if not ahead and key in _checked_ahead:
        _checked_ahead.discard(key)
        return
    from posttrain.utils.checkpoint import CheckpointManager

    checkpoint_dir = Path(cfg.checkpointing.checkpoint_dir)
    check_resume_config(cfg, checkpoint_dir, CheckpointManager(cfg.checkpointing).latest() is not None)
    if ahead:
        _checked_ahead.add(key)


def forget_checks_ahead() -> None:
    """Forget the checks made ahead (when a job ends: a later job in this process is checked anew)."""
    _checked_ahead.clear()


def latest_checkpoint_step(cfg) -> Optional[int]:
    """The step of the checkpoint a training job of `cfg` resumes from, None when it starts afresh."""
    if not _writes_checkpoints(cfg):
        return None
    from posttrain.utils.checkpoint import CheckpointManager, load_training_info

    latest = CheckpointManager(cfg.checkpointing).latest()
    return None if latest is None else int(load_training_info(latest)["step"])


# ------------------------------------------------------------------------ config on resume
def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; lists and scalars are leaves."""
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


def _matches(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def compare_configs(saved: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """`(corrupting, harmless)` lines `key: old -> new` for the keys whose values differ.

    `saved` and `new` are config dicts (`model_dump(mode="json")`); a key present on one side
    only shows as `<unset>` on the other.
    """
    old, cur = flatten(saved), flatten(new)
    corrupting, harmless = [], []
    for key in sorted(set(old) | set(cur)):
        a, b = old.get(key, "<unset>"), cur.get(key, "<unset>")
        if a == b:
            continue
        line = f"{key}: {a!r} -> {b!r}"
        if _matches(key, CORRUPTING_KEYS) and not _matches(key, HARMLESS_EXCEPTIONS):
            corrupting.append(line)
        else:
            harmless.append(line)
    return corrupting, harmless


def check_resume_config(cfg, checkpoint_dir: Path, has_checkpoint: bool) -> None:
    """Compare `cfg` with the config saved beside the checkpoints; saves nothing (the run saves
    its config once it has trained a step: `save_run_config`).

    Raises `ResumeConfigError` when a corrupting key differs and a checkpoint would be resumed
    (unless `checkpointing.allow_resume_config_changes`); prints the harmless differences.
    """
    import yaml

    saved_path = checkpoint_dir / SAVED_CONFIG_FILE
    if has_checkpoint and saved_path.is_file():
        try:
            saved = yaml.safe_load(saved_path.read_text()) or {}
        except yaml.YAMLError as error:
            raise UserError(f"{saved_path}: unreadable saved config ({error}); move it away to resume anyway") from None
        corrupting, harmless = compare_configs(saved, cfg.model_dump(mode="json"))
        if corrupting and not cfg.checkpointing.allow_resume_config_changes:
            raise ResumeConfigError(
                f"{checkpoint_dir} holds checkpoints of a run with another config; resuming would mix them: "
                + "; ".join(corrupting)
                + ". Use another checkpointing.checkpoint_dir to start afresh, restore these values, or set "
                "checkpointing.allow_resume_config_changes=true to resume anyway"
            )
        for line in corrupting:
            print(f"[posttrain] WARNING: resuming with a changed config (allowed by "
                  f"checkpointing.allow_resume_config_changes): {line}", flush=True)
        if harmless:
            print("[posttrain] resuming with config changes: " + "; ".join(harmless), flush=True)


def save_run_config(cfg) -> None:
    """Save `cfg` as `<logger.log_dir>/config.yaml` and, when the job checkpoints, as
    `<checkpointing.checkpoint_dir>/config.yaml` (what the next resume is checked against).

    A training job calls this once it has trained its first step, so a run that trains nothing
    (already complete) or fails before its first step (a backend that would not start) leaves the
    config of the run that wrote the checkpoints in place."""
    from posttrain.config.loader import save_config

    for directory in run_directories(cfg):
        save_config(cfg, Path(directory) / SAVED_CONFIG_FILE)


def already_done_message(resumed_step: int, last_step: int, steps_key: str) -> Optional[str]:
    """What to say when the checkpoint is already at or past the run's last step (else None)."""
    if resumed_step < last_step:
        return None
    fresh = "or set another logger.log_dir and checkpointing.checkpoint_dir to train a new run"
    if resumed_step == last_step:
        return (f"[posttrain] the checkpoint is at step {resumed_step}, the last step ({steps_key}={last_step} or "
                f"the epoch limit): this run is complete, nothing to train; raise {steps_key} to train further, "
                f"{fresh}")
    return (f"[posttrain] the checkpoint is at step {resumed_step}, past this run's last step {last_step} "
            f"({steps_key} or the epoch limit): nothing to train, and the checkpoint is kept as it is; raise "
            f"{steps_key} above {resumed_step} to train further, {fresh}")
