"""What a local Ray cluster (one this process starts: no `cluster.ray_address`) can hold, known
from the config and this machine before Ray starts: a job asking for more CPUs than the cores is
refused by preflight in a second, not by Ray's placement after its start."""

from __future__ import annotations

from typing import Any, Optional

from posttrain.config.schema import resolve_backend, teacher_sections
from posttrain.distributed.actors import available_cpus


def ray_cpu_request(cfg: Any) -> list[tuple[str, float]]:
    """The CPUs each Ray worker group of `cfg` reserves, as `(key that sizes it, CPUs)`: the policy's
    bundles (which also host colocated generation), generation's own, a distillation teacher's."""
    per_worker = cfg.cluster.cpus_per_worker or 1.0
    if hasattr(cfg, "eval"):  # posttrain eval: one generation worker
        return [("posttrain eval", per_worker)]
    groups = [(f"policy.num_workers={cfg.policy.num_workers}", cfg.policy.num_workers * per_worker)]
    gen = cfg.policy.generation
    if (hasattr(cfg, "grpo") or hasattr(cfg, "distillation")) and not gen.colocated.enabled:
        workers = gen.colocated.num_workers or 1
        groups.append((f"policy.generation.colocated.num_workers={workers}", workers * per_worker))
    teachers = teacher_sections(cfg)
    if teachers:  # they all share one set of bundles (`on_policy.build_on_policy_run`)
        key, teacher = next(iter(teachers.items()))
        groups.append((f"{key}.num_workers={teacher.num_workers}", teacher.num_workers * per_worker))
    return groups


def local_ray_cpus() -> int:
    """Logical CPUs of a local Ray cluster started by `start_backend`: the cores this process may
    use. Passed to Ray explicitly, so the preflight (`local_resources_problem`) and Ray agree."""
    return available_cpus()


def local_resources_problem(cfg: Any) -> Optional[str]:
    """Why a local Ray cluster (no `cluster.ray_address`) cannot hold `cfg`'s worker groups, or None.
    Known from the config and this machine alone: refused before Ray starts."""
    c = cfg.cluster
    if c.ray_address is not None or c.autoscaling or c.gpus_per_node > 0 or resolve_backend(cfg) != "ray":
        return None
    groups = ray_cpu_request(cfg)
    asked, cores = sum(cpus for _, cpus in groups), local_ray_cpus()
    if asked <= cores:
        return None
    parts = " + ".join(f"{key} ({cpus:g})" for key, cpus in groups)
    return (f"{parts} with cluster.cpus_per_worker={c.cpus_per_worker or 1:g} ask a local Ray cluster for {asked:g} "
            f"CPUs, but this machine has {cores} for it: lower the worker counts or cluster.cpus_per_worker, or join "
            "a bigger cluster with cluster.ray_address")
