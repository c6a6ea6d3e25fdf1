"""`posttrain plan`'s time side: the step's time plan of a config (`time_report`), and `--search`:
the cheapest cluster shape that fits memory within a target step time (`search_shapes`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from posttrain.errors import UserError
from posttrain.plan.devices import Plan
from posttrain.plan.formulas import GiB
from posttrain.plan.gpus import GPU_SPECS, DeviceSpec, device_spec
from posttrain.plan.jobs import ON_POLICY_SECTIONS, job_name
from posttrain.plan.lengths import plan_lengths
from posttrain.plan.shape import ModelShape, model_shape
from posttrain.plan.timing import Lengths, StepTime, format_step_time, layout_of, step_time

# GPU counts --search tries, and the sizes of each parallel dimension.
SEARCH_GPUS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SEARCH_SIZES = (1, 2, 4, 8)
# A vLLM engine needs room for its KV cache beside its weights: at most this share of its memory on weights.
ENGINE_WEIGHTS_SHARE = 0.8
# vLLM's share of a GPU of its own in the shapes tried: its default 0.9 leaves nothing of the 10%
# the memory plan keeps free (fit.HEADROOM) once a refit bucket arrives.
SPLIT_GPU_MEMORY_UTILIZATION = 0.8


def has_time_plan(cfg: Any) -> bool:
    """The time plan covers on-policy steps (GRPO, PPO's policy side, distillation's student)."""
    return job_name(cfg) in ON_POLICY_SECTIONS.values()


def time_report(cfg: Any, plan: Plan, prompt: Optional[float], response: Optional[float],
                metrics: Optional[str], shape: Optional[ModelShape] = None) -> tuple[str, Optional[Lengths]]:
    """The printed time plan of `cfg` and the lengths it rests on (empty, None for a job without
    on-policy steps)."""
    if not has_time_plan(cfg):
        if prompt is not None or response is not None or metrics is not None:
            raise UserError(f"the time plan covers on-policy jobs (grpo, ppo, distillation), not {job_name(cfg)}")
        return "", None
    lengths = plan_lengths(cfg, prompt, response, metrics, plan.longest_prompt)
    shape = shape or model_shape(cfg.policy)
    spec = device_spec(cfg)
    times = step_time(cfg, shape, spec, lengths, plan.device_bytes)
    text = format_step_time(times, spec, layout_of(cfg), lengths)
    if cfg.cluster.gpus_per_node > 0 and cfg.cluster.gpu_type == "auto":
        text += f"\n  GPU type: cluster.gpu_type=auto planned {spec.name} (set it to plan another: {', '.join(GPU_SPECS)})"
    return text, lengths


@dataclass
class Candidate:
    """One cluster shape tried by --search and what came of it."""

    gpus: int
    colocated: bool
    overrides: dict[str, Any]
    step: Optional[StepTime] = None
    problem: str = ""

    @property
    def gpu_seconds(self) -> float:
        return self.gpus * self.step.step_s if self.step else math.inf

    def describe(self) -> str:
        keys = ("policy.tensor_parallel_size", "policy.pipeline_parallel_size", "policy.expert_parallel_size",
                "policy.generation.vllm_cfg.tensor_parallel_size")
        names = ("TP", "PP", "EP", "gen TP")
        dims = " ".join(f"{n}{self.overrides[k]}" for k, n in zip(keys, names) if self.overrides.get(k, 1) > 1)
        where = "colocated" if self.colocated else \
            f"{self.overrides['policy.num_workers']} train + {self.overrides['policy.generation.colocated.num_workers']} generate"
        return f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}, {where}" + (f", {dims}" if dims else "") + \
            f", DP{self.overrides.get('dp', 1)}"


def reshaped(cfg: Any, overrides: dict[str, Any]) -> Any:
    """A copy of `cfg` with `overrides` (dotted keys) set, validated as a whole (the schema's own
    checks refuse the combinations posttrain cannot run, e.g. expert with tensor parallelism);
    raises pydantic's ValidationError for those."""
    data = cfg.model_dump()
    for key, value in overrides.items():
        if key == "dp":
            continue
        *path, leaf = key.split(".")
        node = data
        for part in path:
            node = node[part]
        node[leaf] = value
    return type(cfg).model_validate(data)


def shapes_to_try(cfg: Any, shape: ModelShape) -> list[Candidate]:
    """Every cluster shape --search weighs: a GPU count, colocated or half the GPUs generating,
    tensor / pipeline / expert parallel sizes that divide the model and the workers, and the
    engines' tensor parallel size."""
    from posttrain.config.schema.policy import COLOCATED_GPU_MEMORY_UTILIZATION

    gpn = cfg.cluster.gpus_per_node
    vllm = cfg.policy.generation.backend == "vllm"
    dims = (shape.num_heads, shape.num_kv_heads, shape.intermediate_size)
    out = []
    for gpus in SEARCH_GPUS:
        for colocated in (True, False):
            train = gpus if colocated else gpus // 2
            if train < 1 or (not colocated and gpus < 2):
                continue
            nodes = math.ceil(gpus / gpn)
            for tp in SEARCH_SIZES:
                for pp in SEARCH_SIZES if not shape.num_experts else (1,):
                    for ep in SEARCH_SIZES if shape.num_experts else (1,):
                        for gen_tp in SEARCH_SIZES if vllm else (1,):
                            if tp > gpn or gen_tp > gpn or train % (tp * pp) or train % ep or gpn % gen_tp \
                                    or (gpus - train if not colocated else train) % gen_tp \
                                    or any(d % tp for d in dims) or (ep > 1 and shape.num_experts % ep) \
                                    or (pp > 1 and shape.num_layers < 2 * pp):
                                continue
                            overrides = {
                                "cluster.num_nodes": nodes, "policy.num_workers": train,
                                "policy.tensor_parallel_size": tp, "policy.pipeline_parallel_size": pp,
                                "policy.expert_parallel_size": ep,
                                "policy.generation.colocated.enabled": colocated,
                                "policy.generation.colocated.num_workers": None if colocated else gpus - train,
                                "dp": train // (tp * pp),
                            }
                            if vllm:
                                overrides["policy.generation.vllm_cfg.tensor_parallel_size"] = gen_tp
                                overrides["policy.generation.vllm_cfg.gpu_memory_utilization"] = \
                                    COLOCATED_GPU_MEMORY_UTILIZATION if colocated else SPLIT_GPU_MEMORY_UTILIZATION
                            out.append(Candidate(gpus, colocated, overrides))
    return out


def weigh(cfg: Any, shape: ModelShape, spec: DeviceSpec, lengths: Lengths, candidate: Candidate,
          longest_prompt: Optional[int]) -> Candidate:
    """Plan `candidate`'s memory and time; `problem` says why it cannot run."""
    from posttrain.plan.fit import usable_bytes
    from posttrain.plan.jobs import memory_plan

    from pydantic import ValidationError

    try:
        changed = reshaped(cfg, candidate.overrides)
    except ValidationError as e:
        candidate.problem = "posttrain cannot run it: " + str(e.errors()[0]["msg"]).removeprefix("Value error, ")
        return candidate
    device_bytes = int(spec.memory_gb * 1e9)
    plan = memory_plan(changed, shape, device_bytes, longest_prompt)
    if plan.node_peak() > usable_bytes(plan):
        candidate.problem = f"needs {plan.node_peak() / GiB:.0f} GiB per GPU in {plan.peak_phase()}"
        return candidate
    gen = changed.policy.generation
    if gen.backend == "vllm":
        weights = shape.num_params * 2 / gen.vllm_cfg.tensor_parallel_size
        room = ENGINE_WEIGHTS_SHARE * gen.vllm_cfg.gpu_memory_utilization * device_bytes
        if weights > room:
            candidate.problem = f"vLLM engine weights {weights / GiB:.0f} GiB per GPU leave no KV cache"
            return candidate
    candidate.step = step_time(changed, shape, spec, lengths, device_bytes)
    return candidate


def search_shapes(cfg: Any, shape: ModelShape, lengths: Lengths, target_s: Optional[float],
                  longest_prompt: Optional[int] = None) -> tuple[Optional[Candidate], list[str]]:
    """The cheapest shape (fewest GPU-seconds per step) that fits memory within `target_s`, and one
    line for each GPU count and placement it beat, saying why."""
    if cfg.cluster.gpus_per_node <= 0:
        raise UserError("--search plans GPU clusters: set cluster.gpus_per_node (and cluster.gpu_type)")
    spec = device_spec(cfg)
    weighed = [weigh(cfg, shape, spec, lengths, c, longest_prompt) for c in shapes_to_try(cfg, shape)]
    groups: dict[tuple[int, bool], list[Candidate]] = {}
    for c in weighed:
        groups.setdefault((c.gpus, c.colocated), []).append(c)
    best_of = {}
    for key, members in groups.items():
        running = [c for c in members if c.step]
        best_of[key] = min(running, key=lambda c: c.step.step_s) if running else members[0]
    meeting = [c for c in best_of.values() if c.step and (target_s is None or c.step.step_s <= target_s)]
    best = min(meeting, key=lambda c: (c.gpu_seconds, c.gpus)) if meeting else None
    lines = []
    for (gpus, colocated), c in sorted(best_of.items()):
        if c is best:
            continue
        placement = ("GPU" if gpus == 1 else "GPUs") + (" colocated" if colocated else " split")
        if not c.step:
            smallest = min(groups[(gpus, colocated)], key=lambda m: float(m.problem.split()[1]) if
                           m.problem.startswith("needs") else math.inf)
            lines.append(f"{gpus} {placement}: no layout fits ({smallest.problem})" if smallest.problem.startswith(
                "needs") else f"{gpus} {placement}: no layout runs ({smallest.problem})")
        elif target_s is not None and c.step.step_s > target_s:
            lines.append(f"{gpus} {placement}: fastest layout ({c.describe()}) {c.step.step_s:.1f} s a step > "
                         f"target {target_s:g} s")
        else:
            lines.append(f"{gpus} {placement}: fits in {c.step.step_s:.1f} s ({c.describe()}) but costs "
                         f"{c.gpu_seconds / 3600:.2f} GPU-hours a step against {best.gpu_seconds / 3600:.2f}")
    return best, lines


def print_search(cfg: Any, plan: Plan, lengths: Optional[Lengths], target_s: Optional[float]) -> int:
    """`posttrain plan --search`: the proposal and why not the others; exit 2 when nothing meets the target."""
    if lengths is None:
        raise UserError(f"--search plans on-policy jobs (grpo, ppo, distillation), not {job_name(cfg)}")
    shape = model_shape(cfg.policy)
    best, lines = search_shapes(cfg, shape, lengths, target_s, plan.longest_prompt)
    spec = device_spec(cfg)
    target = f"within {target_s:g} s a step" if target_s is not None else "(no --target-step-s: the fewest GPU-seconds)"
    print(f"Cluster shapes for {cfg.policy.model_name} on {spec.name} {target}, "
          f"mean prompt {lengths.prompt:.0f} + response {lengths.response:.0f} tokens:")
    if best is None:
        print("no shape tried fits memory" + (" and meets the target" if target_s is not None else ""))
    else:
        keys = " ".join(f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
                        for k, v in best.overrides.items() if k != "dp")
        print(f"proposed: {best.describe()}: step {best.step.step_s:.1f} s, "
              f"{best.step.tokens_per_s_per_device:,.0f} tokens/s per GPU, {best.gpu_seconds / 3600:.2f} GPU-hours a step")
        print(f"  overrides: {keys} cluster.gpus_per_node={cfg.cluster.gpus_per_node}")
    print("not chosen:")
    for line in lines:
        print("  " + line)
    return 0 if best is not None else 2
