"""What every job starts with, in one place: seeding, the run directories, Ray, and the factories
of clusters, worker groups, data and environments. Algorithms (`posttrain.algorithms`) and
evaluation (`posttrain.evals`) both build on it; it imports neither."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from posttrain.config.loader import save_config
from posttrain.config.schema import MasterConfig, PolicyConfig
from posttrain.utils import startup, startup_gc

log = logging.getLogger("posttrain")


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def worker_threads(cfg: MasterConfig) -> int:
    """The torch threads each worker of `cfg` computes with: the local backend's workers run in this
    process, taking turns, with `cluster.cpus_per_worker` or every core; a Ray worker gets its
    bundle's CPUs (`cluster.cpus_per_worker`, default 1; see `WorkerGroup`)."""
    from posttrain.config.schema import resolve_backend

    if resolve_backend(cfg) == "local":
        from posttrain.distributed.actors import available_cpus

        return max(1, int(cfg.cluster.cpus_per_worker or available_cpus()))
    return max(1, int(cfg.cluster.cpus_per_worker or 1))


def warn_if_threads_spin() -> None:
    """Say once when torch was loaded before posttrain could set how OpenMP threads wait
    (`posttrain/__init__.py`): then this process's threads spin for milliseconds, and a busy machine
    slows it several-fold."""
    import posttrain

    if posttrain.OMP_WAIT_POLICY_SET_TOO_LATE and not getattr(warn_if_threads_spin, "said", False):
        warn_if_threads_spin.said = True
        log.warning(
            "torch was imported before posttrain, so its OpenMP threads spin while they wait: beside other CPU "
            "work each step can be several times slower. Import posttrain first, or set OMP_WAIT_POLICY=PASSIVE "
            "and GOMP_SPINCOUNT=10000 in the environment."
        )


def start_backend(cfg: MasterConfig) -> None:
    """Start Ray (`cluster.backend` resolving to ray), or give this process's math the cores the
    local backend's workers may use."""
    from posttrain.config.schema import resolve_backend

    startup_gc.imports_done(freeze=False)  # the CLI's came first and froze; this may be a user's program
    warn_if_threads_spin()
    if resolve_backend(cfg) == "local":
        from posttrain.utils.cpu_share import share_cores, stop_sharing

        threads = worker_threads(cfg)
        torch.set_num_threads(threads)
        if cfg.cluster.cpus_per_worker is None:  # every core; fewer while others keep some busy, if asked
            share_cores(threads, adapt=cfg.cluster.adapt_threads_to_load)
        else:  # the count the user set
            stop_sharing()
        return
    from posttrain.distributed.ray_utils import init_ray

    from posttrain.distributed.local_resources import local_ray_cpus

    init_ray(address=cfg.cluster.ray_address, num_cpus=None if cfg.cluster.ray_address else local_ray_cpus())


def start_run(cfg: MasterConfig, *, seed: int, max_num_steps: Optional[int] = None):
    """The prologue of every job: seed, LR-decay horizon, log dir + saved config, Ray, tokenizer.

    Returns the (possibly completed) config and the tokenizer.
    """
    from posttrain.config.schema import resolve_backend
    from posttrain.models.hf import load_tokenizer
    from posttrain.run_config import with_checkpoint_model, with_schedule_horizon

    set_seed(seed)
    line = precision_line(cfg)
    if line:
        print(line, flush=True)
    if max_num_steps is not None:
        cfg = with_schedule_horizon(cfg, max_num_steps)
    ray = resolve_backend(cfg) == "ray"
    with startup.phase("backend", "starting Ray" if ray else "preparing the run directories"):
        cfg = with_checkpoint_model(cfg)
        prepare_run_dirs(cfg)
        start_backend(cfg)
    tokenizer_name = cfg.policy.tokenizer_name or cfg.policy.model_name
    with startup.doing(f"loading the tokenizer {tokenizer_name}"):  # part of the data phase (build_splits)
        return cfg, load_tokenizer(tokenizer_name)


def precision_line(cfg: MasterConfig) -> Optional[str]:
    """The start-up line that says what a CPU run computes in and why, when the CPU decided it
    (`policy.precision=auto`) or cannot do what was asked fast (bfloat16 without bfloat16 matmul
    instructions); None on GPUs and for float32."""
    from posttrain.cpu_precision import auto_cpu_precision, bfloat16_matmul_support

    precision = cfg.policy.precision
    if cfg.cluster.gpus_per_node > 0 or precision not in ("auto", "bfloat16"):
        return None
    if precision == "auto":
        return "[posttrain] policy.precision=auto: {}, since {}".format(*auto_cpu_precision())
    fast, why = bfloat16_matmul_support()
    if not fast:
        return (f"[posttrain] policy.precision=bfloat16: {why}, so linear layers multiply in float32 (PyTorch's "
                "bfloat16 GEMM is scalar code there, ~45x slower) and round to bfloat16; "
                "policy.precision=auto trains in float32 here")
    return None


def prepare_run_dirs(cfg: MasterConfig) -> None:
    """Lock the log and checkpoint dirs for this run and check a resume's config against the saved
    one (`posttrain.utils.run_dirs`). A training job saves its resolved config once it has trained
    a step (`TrainingLoop`); `posttrain eval`, which trains nothing, saves it now."""
    from posttrain.utils.run_dirs import lock_run_dirs, prepare_checkpoint_dir

    lock_run_dirs(cfg)
    prepare_checkpoint_dir(cfg)
    log_dir = Path(cfg.logger.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    if hasattr(cfg, "eval"):
        save_config(cfg, log_dir / "config.yaml")


def make_cluster(cfg: MasterConfig, num_workers: int, *, colocated_groups: int = 1, name: str = "policy"):
    """A `VirtualCluster` of `num_workers` bundles: `cluster.gpus_per_node` per node with GPUs,
    else spread evenly over `cluster.num_nodes` (CPU bundles of `cluster.cpus_per_worker`, plus
    `cluster.bundle_resources[name]` when `name` is "policy" or "generation"). With the local
    backend (`resolve_backend`), a `LocalCluster`: this process (the config check allows one worker)."""
    from posttrain.config.schema import resolve_backend

    c = cfg.cluster
    if resolve_backend(cfg) == "local":
        from posttrain.distributed.actors import LocalCluster

        return LocalCluster(cpus=c.cpus_per_worker, use_gpus=c.gpus_per_node > 0, name=name)
    from posttrain.distributed import cluster_reuse
    from posttrain.distributed.cluster import VirtualCluster

    use_gpus = c.gpus_per_node > 0
    per_node = min(num_workers, c.gpus_per_node) if use_gpus else -(-num_workers // c.num_nodes)
    nodes = max(1, -(-num_workers // per_node))
    if nodes > c.num_nodes:
        raise ValueError(
            f"{name} needs {num_workers} workers but cluster.num_nodes={c.num_nodes} x "
            f"{per_node} per node is too few"
        )
    # What makes two jobs' clusters interchangeable (`cluster_reuse.py`): every argument but the wait.
    shape = dict(bundles_per_node=[per_node] * nodes, use_gpus=use_gpus, cpus_per_bundle=c.cpus_per_worker or 1.0,
                 max_colocated_worker_groups=colocated_groups, name=name,
                 bundle_resources=c.bundle_resources.get(name), autoscaling=c.autoscaling)
    cluster = cluster_reuse.take(cluster_reuse.shape_key(shape), lambda: VirtualCluster(
        **shape, placement_timeout_s=c.placement_timeout_s,
        # Idle processes are only worth keeping when a later job may take the cluster over.
        reuse_worker_processes=cluster_reuse.reusing(),
    ))
    cluster.placement_timeout_s = c.placement_timeout_s  # a taken-over cluster waits as this run says
    return cluster


def make_generation(cfg: MasterConfig, cluster, *, seed: int = 0, model: Any = None, **placement):
    """Generation workers on `cluster` with `policy.generation` settings, of the backend
    `policy.generation.backend` names (`native`, `vllm` or a user's class; see
    `posttrain.models.generation.backends`), built from one `GenerationSpec`.

    `model` (default None: `cfg.policy`) is what the engines load (distillation passes its
    `teacher`); `placement` (`bundle_indices`, `name`) goes to the backend class."""
    from posttrain.models.generation.backends import generation_backend_class
    from posttrain.models.generation.spec import GenerationSpec

    backend = generation_backend_class(cfg.policy.generation.backend)
    return backend(cluster, GenerationSpec.from_config(cfg, model=model, seed=seed), **placement)


def make_policy(cfg: MasterConfig, cluster, policy_cfg: Optional[PolicyConfig] = None, **options):
    """A `Policy` worker group for `policy_cfg` (default `cfg.policy`) on `cluster`, with the run's
    `cluster.worker_timeout_s`, `cluster.heartbeat_timeout_s` and `cluster.progress_timeout_*`; `options` go to `Policy`
    (`init_reference_model`, `init_optimizer`, `model_type`, `name`). The one place every algorithm
    makes its policy (and a teacher) from."""
    from posttrain.distributed.progress import ProgressLimits
    from posttrain.models.policy.policy import Policy

    options.setdefault("init_reference_model", False)
    return Policy(cluster, policy_cfg or cfg.policy, worker_timeout_s=cfg.cluster.worker_timeout_s,
                  heartbeat_timeout_s=cfg.cluster.heartbeat_timeout_s,
                  progress_limits=ProgressLimits.from_config(cfg.cluster), **options)


def start_concurrently(*makers: Callable[[], Any], description: str = "starting the workers") -> list[Any]:
    """Call each maker (a worker-group constructor) in its own thread; return their results in order.
    `description` is the start-up phase's (`workers_description`).

    Starting a worker group is mostly its actors importing torch and transformers (~5 s each
    here), so the policy and generation groups start in the time of one. If any maker fails, the
    groups that did start are shut down and the first error is raised.
    """
    from concurrent.futures import ThreadPoolExecutor

    with startup.phase("workers", description):
        with ThreadPoolExecutor(max_workers=len(makers), thread_name_prefix="posttrain-start") as pool:
            futures = [pool.submit(make) for make in makers]
            errors = [f.exception() for f in futures]  # waits for every maker, failed or not
        if any(errors):
            for future, error in zip(futures, errors):
                if error is None:
                    future.result().shutdown()
            raise next(e for e in errors if e is not None)
    return [f.result() for f in futures]


def workers_description(cfg: MasterConfig, *, reference: bool = False, generation: bool = False,
                        teacher: Union[PolicyConfig, dict[str, PolicyConfig], None] = None,
                        policy: bool = True) -> str:
    """How the start-up line names the worker groups a job starts: "starting 2 policy workers
    (gpt2, with a reference model) and vllm generation workers", or with the local backend, where
    the models load in this process, "loading the policy model gpt2 and the native generation engine"."""
    from posttrain.config.schema import resolve_backend

    local = resolve_backend(cfg) == "local"

    def group(role: str, n: int, model: str, with_reference: bool = False) -> str:
        if local:
            return f"the {role} model {model}" + (" and its reference copy" if with_reference else "")
        reference_model = ", with a reference model" if with_reference else ""
        return f"{n} {role} worker{'s' if n != 1 else ''} ({model}{reference_model})"

    parts = [group("policy", cfg.policy.num_workers, cfg.policy.model_name, reference)] if policy else []
    teachers = teacher if isinstance(teacher, dict) else {"teacher": teacher} if teacher is not None else {}
    for key, section in teachers.items():
        parts.append(group(key, section.num_workers, section.model_name))
    if generation:
        backend, model = cfg.policy.generation.backend, "" if policy else f" ({cfg.policy.model_name})"
        parts.append(f"the {backend} generation engine{model}" if local else f"{backend} generation workers{model}")
    listed = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
    return ("loading " if local else "starting ") + listed


def build_datums(
    cfg: MasterConfig, builder, tokenizer, split: str, limit: Optional[int] = None, load: Optional[Callable] = None,
    lazy: bool = False,
) -> Sequence[Any]:
    """Load `split` of `cfg.data` (at most `limit` records) and turn each record into a datum with
    `builder` (`build_prompt_message_log`, `build_sft_example`, `build_preference_example`, ...).

    `load(data_cfg, split)` reads the records (default `posttrain.data.datasets.load_records`;
    preference pairs use `load_preference_records`). `lazy`: a `LazyDatums`, each datum built when
    first read (default False: a list, all built now).
    """
    if load is None:
        from posttrain.data.datasets import load_records
        from posttrain.environments.registry import env_rows_maker

        def load(data_cfg, split):  # data.dataset=env: the environments make the rows
            return load_records(data_cfg, split, env_rows_maker(getattr(cfg, "env", None)))

    def build(record: dict, index: int) -> Any:
        return builder(record, tokenizer, cfg.policy.max_total_sequence_length,
                       use_chat_template=cfg.data.use_chat_template, system_prompt=cfg.data.system_prompt, idx=index)

    with startup.doing(f"reading the {split} data" if lazy else f"reading and tokenizing the {split} data"):
        records = limit_per_source(load(cfg.data, split), limit)
        if hasattr(cfg, "env"):
            from posttrain.environments.row_fields import add_env_fields

            add_env_fields(cfg, records)
        if lazy:
            from posttrain.data.dataloader import LazyDatums

            return LazyDatums(records, build)
        return [build(r, i) for i, r in enumerate(records)]


def build_splits(
    cfg: MasterConfig, builder, tokenizer, max_val_samples: Optional[int], load: Optional[Callable] = None
) -> tuple[list[dict], list[dict]]:
    """The training datums and at most `max_val_samples` validation datums (`build_datums`); says
    once when there is no validation data, as the run then trains without validation.

    The training split is built lazily (`LazyDatums`: a run reads the prompts it draws, so start-up
    does not wait for every prompt of a large data set to be templated and tokenised); validation,
    read whole at every validation, is built now."""
    train = build_datums(cfg, builder, tokenizer, "train", load=load, lazy=True)
    val = build_datums(cfg, builder, tokenizer, "validation", max_val_samples, load=load)
    if not val:
        print("[posttrain] no validation data (data.validation_path is unset or empty): running without validation",
              flush=True)
    startup.mark("data")
    return train, val


def build_validation_sets(cfg: MasterConfig, builder, tokenizer, limit: Optional[int]) -> dict[str, list]:
    """The datums of each of `data.validation_sets` by name: its validation split, at most `limit`
    records per source (`build_datums`)."""
    from posttrain.config.schema import validation_set

    return {name: build_datums(cfg.model_copy(update={"data": validation_set(cfg.data, name)}), builder, tokenizer,
                               "validation", limit)
            for name in cfg.data.validation_sets}


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


def make_envs(cfg, tasks):
    """Task name -> environment actor (`EnvironmentActors`, a dict that can also restart a dead
    actor). `tasks` are task names, `Sample`s or `(task_name, env_name)` pairs
    (`dataloader.routes`); a sample's `env_name` says which `env.<name>` section serves its task (a
    built-in, a registered environment, or a user's class by `env.<name>.class_path`). Tasks served
    by the same section share one actor (a Ray actor, or a thread of this process with the local
    backend); a step that takes longer than `cluster.worker_timeout_s`, whose actor stops beating
    (`cluster.heartbeat_timeout_s`) or that makes no progress (`cluster.progress_timeout_*`) fails as hung."""
    from posttrain.config.schema import resolve_backend
    from posttrain.distributed.heartbeat import STACKS_POLL_S, period_for
    from posttrain.distributed.progress import ProgressLimits
    from posttrain.environments.registry import EnvironmentActors, create_env, resolve_env

    env_of_task = {}
    for item in tasks:
        if isinstance(item, str):
            task, env = item, item
        elif isinstance(item, tuple):
            task, env = item
        else:
            task, env = item.task_name, item.env_name
        env_of_task[task] = env
    names = sorted(set(env_of_task.values()))
    actors, recipes = {}, {}
    # Ray actors beat (and answer requests for their stacks) when heartbeats or progress bounds watch them.
    c, limits = cfg.cluster, ProgressLimits.from_config(cfg.cluster)
    watched = resolve_backend(cfg) == "ray" and (c.heartbeat_timeout_s > 0 or limits.enabled)
    beat_period_s = (period_for(c.heartbeat_timeout_s) if c.heartbeat_timeout_s > 0 else STACKS_POLL_S) if watched else 0.0
    with startup.phase("environments", f"starting the environments ({', '.join(names)})"):
        for env_name in names:
            cls, env_cfg = resolve_env(env_name, cfg.env.section(env_name))
            recipes[env_name] = (cls, env_cfg, resolve_backend(cfg))
            actors[env_name] = create_env(env_name, env_cfg, cls=cls, backend=recipes[env_name][2],
                                          beat_period_s=beat_period_s)
    return EnvironmentActors(actors, env_of_task, recipes, step_timeout_s=c.worker_timeout_s,
                             heartbeat_timeout_s=c.heartbeat_timeout_s, progress_limits=limits, beat_period_s=beat_period_s)
