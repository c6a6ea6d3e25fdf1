"""Set-up shared by the training loops: seeding, Ray, clusters, data, logging and resume state."""

from __future__ import annotations

import json
import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from posttrain.config.loader import save_config
from posttrain.config.schema import MasterConfig, OfflineLoopConfig
from posttrain.utils.checkpoint import publish_dir

log = logging.getLogger("posttrain")

LOADER_STATE_FILE = "dataloader.json"


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def sample_seeds(base_seed: int, step: int, n: int) -> torch.Tensor:
    """Per-sample sampling seeds that depend only on (seed, step, index).

    Generation is then reproducible across resume, batching and the number of workers.
    """
    return torch.arange(n, dtype=torch.long) + (base_seed * 1_000_003 + step * 65_537) % (2**40)


def with_schedule_horizon(cfg, max_num_steps: int):
    """Fill `policy.scheduler.total_steps` (decay horizon) from the run length when unset."""
    if cfg.policy.scheduler.total_steps is not None:
        return cfg
    cfg = cfg.model_copy(deep=True)
    cfg.policy.scheduler.total_steps = max_num_steps
    return cfg


def start_ray(cfg: MasterConfig) -> None:
    from posttrain.distributed.ray_utils import init_ray

    cluster = cfg.cluster
    init_ray(address=cluster.ray_address)


def make_cluster(cfg: MasterConfig, num_workers: int, *, colocated_groups: int = 1, name: str = "policy"):
    """A `VirtualCluster` of `num_workers` bundles: `cluster.gpus_per_node` per node with GPUs,
    else spread evenly over `cluster.num_nodes` (CPU bundles of `cluster.cpus_per_worker`, plus
    `cluster.bundle_resources[name]` when `name` is "policy" or "generation")."""
    from posttrain.distributed.cluster import VirtualCluster

    c = cfg.cluster
    use_gpus = c.gpus_per_node > 0
    per_node = min(num_workers, c.gpus_per_node) if use_gpus else -(-num_workers // c.num_nodes)
    nodes = max(1, -(-num_workers // per_node))
    if nodes > c.num_nodes:
        raise ValueError(
            f"{name} needs {num_workers} workers but cluster.num_nodes={c.num_nodes} x "
            f"{per_node} per node is too few"
        )
    return VirtualCluster(
        [per_node] * nodes,
        use_gpus=use_gpus,
        cpus_per_bundle=c.cpus_per_worker,
        max_colocated_worker_groups=colocated_groups,
        placement_timeout_s=c.placement_timeout_s,
        name=name,
        bundle_resources=c.bundle_resources.get(name),
        autoscaling=c.autoscaling,
    )


def make_generation(cfg: MasterConfig, cluster, *, seed: int = 0):
    """Generation workers for `policy.model_name` with `policy.generation` settings, on the
    backend it names (`native`, or `vllm` in its isolated environment)."""
    p = cfg.policy
    if p.generation.backend == "vllm":
        from posttrain.models.generation.vllm_generation import VllmGeneration

        return VllmGeneration(
            cluster, p.generation, p.model_name, tokenizer_name=p.tokenizer_name, tiny_arch=p.tiny_arch,
            precision=p.precision, max_model_len=p.max_total_sequence_length, seed=seed,
            worker_timeout_s=cfg.cluster.worker_timeout_s,
        )
    from posttrain.models.generation.interface import Generation

    return Generation(
        cluster, p.generation, p.model_name, tokenizer_name=p.tokenizer_name, tiny_arch=p.tiny_arch,
        precision=p.precision, seed=seed, worker_timeout_s=cfg.cluster.worker_timeout_s,
    )


def start_concurrently(*makers: Callable[[], Any]) -> list[Any]:
    """Call each maker (a worker-group constructor) in its own thread; return their results in order.

    Starting a worker group is mostly its actors importing torch and transformers (~5 s each
    here), so the policy and generation groups start in the time of one. If any maker fails, the
    groups that did start are shut down and the first error is raised.
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(makers), thread_name_prefix="posttrain-start") as pool:
        futures = [pool.submit(make) for make in makers]
        errors = [f.exception() for f in futures]  # waits for every maker, failed or not
    if any(errors):
        for future, error in zip(futures, errors):
            if error is None:
                future.result().shutdown()
        raise next(e for e in errors if e is not None)
    return [f.result() for f in futures]


def start_run(cfg: MasterConfig, *, seed: int, max_num_steps: Optional[int] = None):
    """The prologue of every job: seed, LR-decay horizon, log dir + saved config, Ray, tokenizer.

    Returns the (possibly completed) config and the tokenizer.
    """
    from posttrain.models.hf import load_tokenizer

    set_seed(seed)
    if max_num_steps is not None:
        cfg = with_schedule_horizon(cfg, max_num_steps)
    cfg = with_checkpoint_model(cfg)
    prepare_run_dirs(cfg)
    start_ray(cfg)
    return cfg, load_tokenizer(cfg.policy.tokenizer_name or cfg.policy.model_name)


def with_checkpoint_model(cfg):
    """A `policy.model_name` naming a training checkpoint (`step_N`) becomes its cached HF copy
    (tokenizer too, unless `policy.tokenizer_name` is set), so every job accepts checkpoints."""
    from posttrain.preflight import checkpoint_policy_dir

    checkpoint = checkpoint_policy_dir(Path(cfg.policy.model_name).expanduser())
    if checkpoint is None:
        return cfg
    from posttrain.models.policy.checkpoint import converted_checkpoint

    hf_dir = converted_checkpoint(checkpoint)
    print(f"[posttrain] policy.model_name: checkpoint {cfg.policy.model_name} as Hugging Face model {hf_dir}", flush=True)
    cfg = cfg.model_copy(deep=True)
    cfg.policy.tokenizer_name = cfg.policy.tokenizer_name or str(hf_dir)
    cfg.policy.model_name = str(hf_dir)
    return cfg


@dataclass
class PairRun:
    """What DPO and reward-model training set up alike (see `start_pair_run`)."""

    cfg: Any
    pad_token_id: int
    loader: Any  # ResumableLoader of pair datums, train_global_batch_size / 2 pairs per step
    cluster: Any
    policy: Any
    val_batches: list  # validation pairs as flattened Batches of `val_batch_size` pairs

    def shutdown(self) -> None:
        from posttrain.utils.run_dirs import release_run_dirs

        self.policy.shutdown()
        self.cluster.shutdown()
        release_run_dirs(self.cfg)


def start_pair_run(cfg, section, *, model_type: str = "lm", init_reference_model: bool = False) -> PairRun:
    """Prologue of the preference-pair jobs: Ray, pair data (rows interleave chosen and rejected),
    loader, one policy group. `section` is `cfg.dpo` or `cfg.rm` (seed, steps, validation sizes)."""
    from posttrain.data.dataloader import ResumableLoader
    from posttrain.data.preference import build_preference_example, load_preference_records, pair_batches
    from posttrain.models.policy.policy import Policy

    cfg, tokenizer = start_run(cfg, seed=section.seed, max_num_steps=section.max_num_steps)
    pad = tokenizer.pad_token_id
    train = build_datums(cfg, build_preference_example, tokenizer, "train", load=load_preference_records)
    val = build_datums(
        cfg, build_preference_example, tokenizer, "validation", section.max_val_samples, load=load_preference_records
    )
    loader = ResumableLoader(
        train, cfg.policy.train_global_batch_size // 2, shuffle=cfg.data.shuffle, seed=section.seed
    )
    cluster = make_cluster(cfg, cfg.policy.num_workers)
    policy = Policy(cluster, cfg.policy, init_reference_model=init_reference_model, model_type=model_type,
                    worker_timeout_s=cfg.cluster.worker_timeout_s)
    return PairRun(cfg, pad, loader, cluster, policy, pair_batches(val, section.val_batch_size, pad))


def build_datums(
    cfg: MasterConfig, builder, tokenizer, split: str, limit: Optional[int] = None, load: Optional[Callable] = None
) -> list[dict]:
    """Load `split` of `cfg.data` (at most `limit` records) and turn each record into a datum with
    `builder` (`build_prompt_message_log`, `build_sft_example`, `build_preference_example`, ...).

    `load(data_cfg, split)` reads the records (default `posttrain.data.datasets.load_records`;
    preference pairs use `load_preference_records`).
    """
    if load is None:
        from posttrain.data.datasets import load_records

        def load(data_cfg, split):
            return load_records(data_cfg, split, getattr(cfg, "env", None))

    records = limit_per_source(load(cfg.data, split), limit)
    if hasattr(cfg, "env"):
        add_env_tools(cfg, records)
    return [
        builder(r, tokenizer, cfg.policy.max_total_sequence_length, use_chat_template=cfg.data.use_chat_template,
                system_prompt=cfg.data.system_prompt, idx=i)
        for i, r in enumerate(records)
    ]


def add_env_tools(cfg: MasterConfig, records: list[dict]) -> None:
    """Give records without `tools` of their own the tools their environment offers
    (`Environment.prompt_tools`), so the prompt describes them."""
    from posttrain.environments.registry import resolve_env

    tools_of_env: dict[str, Any] = {}
    for record in records:
        if record.get("tools"):
            continue
        name = record.get("env_name") or record.get("task_name") or cfg.data.env_name
        if name not in tools_of_env:
            try:
                cls, env_cfg = resolve_env(name, cfg.env.section(name))
            except (KeyError, ValueError):  # preflight names the problem
                tools_of_env[name] = None
            else:
                tools_of_env[name] = cls.prompt_tools(env_cfg)
        if tools_of_env[name]:
            record["tools"] = tools_of_env[name]


def limit_per_source(records: list[dict], limit: Optional[int]) -> list[dict]:
    """The first `limit` records, or with several sources (a blend) the first `limit` of each, so
    every task is validated."""
    if limit is None:
        return records
    sources = {r.get("source") for r in records}
    if len(sources) < 2:
        return records[:limit]
    taken: dict[Any, int] = {}
    kept = []
    for record in records:
        source = record.get("source")
        if taken.get(source, 0) < limit:
            taken[source] = taken.get(source, 0) + 1
            kept.append(record)
    return kept


def make_envs(cfg, tasks) -> dict[str, Any]:
    """Task name -> environment actor. `tasks` are task names or datums; a datum's `env_name`
    says which `env.<name>` section serves its task (a built-in, a registered environment, or a
    user's class by `env.<name>.class_path`). Tasks served by the same section share one actor."""
    from posttrain.environments.registry import create_env, resolve_env

    env_of_task = {}
    for item in tasks:
        task = item if isinstance(item, str) else item.get("task_name", cfg.data.env_name)
        env_of_task[task] = task if isinstance(item, str) else item.get("env_name") or task
    actors = {}
    for env_name in sorted(set(env_of_task.values())):
        cls, env_cfg = resolve_env(env_name, cfg.env.section(env_name))
        actors[env_name] = create_env(env_name, env_cfg, cls=cls)
    return {task: actors[env_name] for task, env_name in sorted(env_of_task.items())}


def prepare_run_dirs(cfg: MasterConfig) -> None:
    """Lock the log and checkpoint dirs for this run, check a resume's config against the saved
    one (`posttrain.utils.run_dirs`) and save the resolved config beside the run's logs."""
    from posttrain.utils.run_dirs import lock_run_dirs, prepare_checkpoint_dir

    lock_run_dirs(cfg)
    prepare_checkpoint_dir(cfg)
    log_dir = Path(cfg.logger.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, log_dir / "config.yaml")


def save_loader_state(path: Path, state: dict) -> None:
    (path / LOADER_STATE_FILE).write_text(json.dumps(state))


def load_loader_state(path: Path) -> Optional[dict]:
    f = path / LOADER_STATE_FILE
    return json.loads(f.read_text()) if f.exists() else None


def prefixed(metrics: dict, prefix: str) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in metrics.items()}


def save_training_state(
    checkpointer, policy, loader, step: int, metrics: dict, training_info: Optional[dict] = None
) -> None:
    """Write `step_N/` atomically: policy (weights, optimizer, RNG), loader position, info.

    `metrics` rank the checkpoint for `keep_top_k`; `training_info` is extra resume state.
    """
    tmp = checkpointer.begin(step)
    policy.save_checkpoint(tmp / "policy")
    save_loader_state(tmp, loader.state_dict())
    checkpointer.finalize(step, tmp, metrics, training_info)


def restore_training_state(checkpointer, policy, loader, logger) -> Optional[dict]:
    """Load the latest complete checkpoint, if any; returns its training info."""
    latest = checkpointer.latest()
    if latest is None:
        logger.truncate_after(-1)  # a fresh start: forget metrics of a run that never checkpointed
        return None
    info = checkpointer.load_training_info(latest)
    policy.load_checkpoint(latest / "policy")
    loader.load_state_dict(load_loader_state(latest))
    logger.truncate_after(int(info["step"]))
    print(f"[posttrain] resumed from {latest} (step {info['step']})", flush=True)
    return info


def export_hf_atomic(policy, export_dir: str | Path) -> Path:
    """`policy.export_hf` into `export_dir` via a temporary sibling: a half-written export is never reused."""
    export_dir = Path(export_dir)
    tmp = export_dir.with_name(export_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted export
    policy.export_hf(tmp)
    return publish_dir(tmp, export_dir)  # replaces a previous export of the same run


def train_offline(
    cfg: MasterConfig,
    algo_cfg: OfflineLoopConfig,
    policy,
    loader,
    train_step: Callable[[list, Any], dict[str, float]],
    validate: Callable[[], dict[str, float]],
    desc: str,
) -> dict[str, float]:
    """The loop of the offline trainers (SFT, DPO, RM): one `train_step` per step on a fixed data set.

    Resumes from the latest checkpoint (`checkpointing.enabled`), validates at step 0
    (`val_at_start`), every `val_period` steps and at the end (`val_at_end`), logs metrics, saves
    checkpoints every `checkpointing.save_period` steps and at the last one (ranked by the
    `validation/*` metrics of that step) and shows a progress bar.

    Args:
        cfg: the master config (`logger`, `checkpointing` sections are read).
        algo_cfg: the algorithm's section (`sft`, `dpo`, `rm`): `max_num_steps`, `max_num_epochs`
            (the run stops at whichever comes first), `val_period`, `val_at_start`, `val_at_end`.
        policy: the `Policy` being trained (checkpointed with the loader position).
        loader: the `ResumableLoader` of training datums.
        train_step: `(datums of one step, Timer) -> metrics` (names without the `train/` prefix);
            runs the policy update and times its parts with the timer.
        validate: `() -> metrics` with full names (`validation/...`).
        desc: progress-bar label.

    Returns:
        the metrics of the last step (empty when the run had already finished).
    """
    from posttrain.utils.checkpoint import CheckpointManager
    from posttrain.utils.logger import Logger, ProgressBar
    from posttrain.utils.timer import Timer

    a, ck = algo_cfg, cfg.checkpointing
    last_step = min(a.max_num_steps, loader.steps_for_epochs(a.max_num_epochs))
    logger = Logger(cfg.logger)
    logger.log_hyperparams(cfg.model_dump(mode="json"))
    checkpointer = CheckpointManager(ck)
    try:
        step = 0
        if ck.enabled:
            info = restore_training_state(checkpointer, policy, loader, logger)
            step = int(info["step"]) if info else 0
        if step and step >= last_step:
            from posttrain.utils.run_dirs import already_done_message

            print(already_done_message(step, last_step, f"{desc.lower()}.max_num_steps"), flush=True)
            return {}
        if step == 0 and a.val_at_start:
            val_metrics = validate()
            if val_metrics:  # empty without validation data
                logger.log_metrics(val_metrics, 0)

        bar = ProgressBar(total=last_step, initial=step, enabled=cfg.logger.progress_bar, desc=desc)
        metrics: dict[str, float] = {}
        while step < last_step:
            step += 1
            timer = Timer()
            with timer.time("total_step_time"):
                train_metrics = train_step(loader.next_batch(), timer)
            metrics = prefixed(train_metrics, "train")
            metrics.update(prefixed(timer.get_timing_metrics(), "timing/train"))
            if (a.val_period > 0 and step % a.val_period == 0) or (a.val_at_end and step == last_step):
                metrics.update(validate())
            logger.log_metrics(metrics, step)
            if ck.enabled and (step % ck.save_period == 0 or step == last_step):
                ranking = {k: v for k, v in metrics.items() if k.startswith("validation/")}
                save_training_state(checkpointer, policy, loader, step, ranking)
            bar.update(metrics)
        bar.close()
        return metrics
    finally:
        logger.close()


def reduce_loss_metrics(loss_fn, outputs_and_batches: list[tuple[torch.Tensor, Any]]) -> dict[str, float]:
    """The loss's metrics over several batches, as one training step over all of them would report.

    The loss divides by the global counts it is given, so each batch gets the totals over all
    batches and the per-batch metrics are summed (`_min` / `_max` names: min / max), exactly
    as the policy workers reduce micro-batches.
    """
    seqs = sum(float(b["sample_mask"].sum()) for _, b in outputs_and_batches)
    toks = sum(float((b["token_mask"][:, 1:] * b["sample_mask"][:, None]).sum()) for _, b in outputs_and_batches
               if "token_mask" in b)
    totals: dict[str, float] = {}
    for outputs, batch in outputs_and_batches:
        _, metrics = loss_fn(outputs, batch, torch.tensor(seqs), torch.tensor(toks))
        for name, value in metrics.items():
            reduce = min if name.endswith("_min") else max if name.endswith("_max") else lambda a, b: a + b
            totals[name] = reduce(totals[name], value) if name in totals else value
    return totals


def finish_offline_run(cfg: MasterConfig, metrics: dict[str, float], name: str) -> None:
    """Write `report.png` (when `logger.report`) and print a one-line summary of the run (nothing
    when the run trained no step: `train_offline` said why)."""
    if not metrics:
        return
    log_dir = Path(cfg.logger.log_dir)
    if cfg.logger.report and (log_dir / "metrics.jsonl").exists():
        from posttrain.utils.report import write_report

        write_report(log_dir / "metrics.jsonl", log_dir / "report.png")
    parts = [f"{key.partition('/')[2].replace('_', ' ')} {value:.1%}" if key.endswith("accuracy")
             else f"{key.partition('/')[2].replace('_', ' ')} {value:.4f}"
             for key, value in metrics.items() if key.startswith("validation/")]
    result = "validation " + ", ".join(parts) if parts else "no validation"
    print(f"[posttrain] {name} finished: {result}; logs in {log_dir}", flush=True)
