"""The config a job runs with, as its set-up makes it: warm starts' exports in place of the models
they train, a training checkpoint given as a model replaced by its Hugging Face copy, the LR decay
horizon filled from the run length. `planned_run_config` finds it from files alone (nothing trained,
converted or started), so a resume is checked against the config beside its checkpoints before
anything starts (`posttrain.preflight.check_run_dirs`); the jobs build theirs with the same
functions (`posttrain.job.start_run`, the algorithms' warm starts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional


def with_schedule_horizon(cfg, max_num_steps: int):
    """Fill `policy.scheduler.total_steps` (decay horizon) from the run length when unset."""
    if cfg.policy.scheduler.total_steps is not None:
        return cfg
    cfg = cfg.model_copy(deep=True)
    cfg.policy.scheduler.total_steps = max_num_steps
    return cfg


def with_model_dir(cfg, section: str, model_dir: Path):
    """A copy of `cfg` whose `<section>` (`policy`, `teacher`) loads `model_dir`, and its tokenizer
    too unless `<section>.tokenizer_name` is set."""
    cfg = cfg.model_copy(deep=True)
    policy = getattr(cfg, section)
    policy.tokenizer_name = policy.tokenizer_name or str(model_dir)
    policy.model_name = str(model_dir)
    return cfg


def with_checkpoint_model(cfg, section: str = "policy", convert: bool = True):
    """A `<section>.model_name` (default `policy`) naming a training checkpoint (`step_N`) becomes
    its cached HF copy (tokenizer too, unless `<section>.tokenizer_name` is set), so every job
    accepts checkpoints. `convert=False`: only where that copy is (nothing converted)."""
    from posttrain.models.paths import checkpoint_policy_dir, converted_checkpoint_dir

    name = getattr(cfg, section).model_name
    checkpoint = checkpoint_policy_dir(Path(name).expanduser())
    if checkpoint is None:
        return cfg
    if not convert:
        return with_model_dir(cfg, section, converted_checkpoint_dir(checkpoint))
    from posttrain.models.policy.checkpoint import converted_checkpoint

    hf_dir = converted_checkpoint(checkpoint)
    print(f"[posttrain] {section}.model_name: checkpoint {name} as Hugging Face model {hf_dir}", flush=True)
    return with_model_dir(cfg, section, hf_dir)


# A job's nested SFT warm starts -> the section of the job that continues from each one's export.
WARM_STARTS = {"sft_warmup": "policy", "teacher_warmup": "teacher"}


def warm_start_dirs(cfg: Any, key: str) -> tuple[Path, Optional[Path]]:
    """Where the warm start `cfg.<key>` logs and checkpoints: `<logger.log_dir>/<key>` and
    `<checkpointing.checkpoint_dir>/<key>` (None, no checkpoints, when the run does not checkpoint)."""
    checkpoints = Path(cfg.checkpointing.checkpoint_dir) / key if cfg.checkpointing.enabled else None
    return Path(cfg.logger.log_dir) / key, checkpoints


def warm_start_export_dir(warm: Any) -> Path:
    """Where the SFT warm start `warm` (an `SFTMasterConfig`) exports its weights, trained or not yet:
    `$POSTTRAIN_CACHE/sft_warmup/<hash of the config>`, without its `logger`, `checkpointing` and
    `cluster` sections (they change where and how it is logged, not what is trained), so reruns,
    resumed runs and the presets that share a warm start share one export."""
    import hashlib

    from posttrain.config.loader import config_to_yaml
    from posttrain.utils.cache import cache_dir

    weights_cfg = warm.model_copy(update={"logger": None, "checkpointing": None, "cluster": None})
    return cache_dir() / "sft_warmup" / hashlib.sha1(config_to_yaml(weights_cfg).encode()).hexdigest()[:12]


def warm_start_stamp(export_dir: Path) -> dict[str, str]:
    """The cache-entry stamp of the warm start exported to `export_dir` (its name is the config's hash)."""
    return {"kind": "sft-warm-start", "config": export_dir.name}


def warm_start_ready(warm: Any) -> bool:
    """Whether the warm start `warm` has a complete export in the cache (`posttrain.utils.cache`)."""
    from posttrain.utils.cache import entry_problem

    export = warm_start_export_dir(warm)
    return entry_problem(export, warm_start_stamp(export)) is None


def warm_start_job(warm: Any, log_dir: Path, checkpoint_dir: Optional[Path] = None):
    """The SFT job a warm start runs: `warm` logging under `log_dir` and checkpointing under
    `checkpoint_dir` (None: no checkpoints)."""
    job = warm.model_copy(deep=True)
    job.logger.log_dir = str(log_dir)
    if checkpoint_dir is None:
        job.checkpointing.enabled = False
    else:
        job.checkpointing.checkpoint_dir = str(checkpoint_dir)
    return job


def with_warm_starts(cfg, run_warm_start: Optional[Callable[..., Path]] = None):
    """`cfg` continuing from its SFT warm starts (`WARM_STARTS`: `policy` from `sft_warmup`'s export,
    `teacher` from `teacher_warmup`'s), and a teacher given as a training checkpoint from its HF copy.

    `run_warm_start(warm, log_dir, checkpoint_dir)` runs (or reuses) a warm start and returns its
    export; None (default): nothing is run or converted, the config only names where they will
    be (what `planned_run_config` needs)."""
    convert = run_warm_start is not None
    for key, section in WARM_STARTS.items():
        warm = getattr(cfg, key, None)
        if warm is not None:
            export = run_warm_start(warm, *warm_start_dirs(cfg, key)) if convert else warm_start_export_dir(warm)
            cfg = with_model_dir(cfg, section, export)
        elif section != "policy" and getattr(cfg, section, None) is not None:  # start_run converts the policy's
            cfg = with_checkpoint_model(cfg, section, convert=convert)
    return cfg


def planned_run_config(cfg, max_num_steps: Optional[int]):
    """The config `cfg`'s job runs with and saves beside its checkpoints (`with_warm_starts`, then
    what `start_run` does for `max_num_steps`), found from files alone: no warm start runs, no
    checkpoint converts. What a resume is checked against before anything starts."""
    cfg = with_warm_starts(cfg)
    if max_num_steps is not None:
        cfg = with_schedule_horizon(cfg, max_num_steps)
    return with_checkpoint_model(cfg, convert=False)
