"""Distillation's teachers in the memory plan (`add_teachers`).

How the teachers run (`on_policy.build_on_policy_run`, `algorithms/distill.py`): each is a
forward-only `Policy` (`make_policy(..., init_optimizer=False)`: no gradients, no optimizer state),
a worker group of its own; all of them are colocated worker groups on one set of bundles of
their own (`teacher_cluster`, the teachers' common `num_workers`), which also hosts, once before
the first step with `distillation.val_at_start`, the generation engine that measures a
teacher's accuracy (`measure_teacher_accuracy`: one engine at a time, then shut down; the plan's
"teacher eval" phase). In a step, the teachers score the student's rows one after the other in
the logprobs phase (`distill_teachers.teachers_topk`), between generation and training.

Where that puts them:

- Ray on GPUs: the teachers' bundles are GPUs apart from the policy's (a cluster of their own),
  and a teacher GPU holds one worker of every teacher (and the accuracy engine): one device,
  "teacher worker (<keys>)";
- Ray on CPU: every worker is a process of its own: a device per teacher, "teacher worker
  (<key>)", and one for the accuracy engine, "teacher generation worker";
- the local backend: every group is a `LocalActor` of this one process: the teachers' rows are on
  the policy worker's device.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from posttrain.plan.formulas import (
    CPU_RUNTIME_BYTES, activation_bytes_per_token_layer, compute_dtype_bytes, micro_batch_tokens, per_rank_params,
    topk_logits_bytes,
)
from posttrain.plan.devices import DevicePlan
from posttrain.plan.engine import add_engine
from posttrain.plan.shape import ModelShape, model_shape


def read_teacher_shapes(cfg: Any, given: Optional[dict[str, ModelShape]] = None) -> dict[str, ModelShape]:
    """Each teacher's shape by key (`teacher`, `teachers.<task>`): `given`'s, else read from the
    section's model like the student's (`model_shape`: its config only, no weights). Every section
    is planned, `teacher` too when `teachers` names every task (then it does not start): an upper bound."""
    from posttrain.config.schema import teacher_sections

    given = given or {}
    return {key: given.get(key) or model_shape(section) for key, section in teacher_sections(cfg).items()}


def add_teachers(cfg: Any, shapes: dict[str, ModelShape], trainer: DevicePlan, devices: list[DevicePlan],
                 counts: list[int], *, device_bytes: Optional[int], row_tokens: int, longest_prompt: Optional[int],
                 in_process: bool) -> None:
    """Add the teachers of `cfg` (a distillation, `shapes` by teacher key) where they run (module
    doc): on `trainer` when `in_process` (the local backend), else as devices of their own appended
    to `devices` / `counts`; and the student's copy of their top-k to `trainer`."""
    from posttrain.config.schema import teacher_sections

    sections, d, phases = teacher_sections(cfg), cfg.distillation, trainer.phases
    on_gpu = cfg.cluster.gpus_per_node > 0
    workers = next(iter(sections.values())).num_workers  # the same for every teacher (`teacher_problem`)
    measures = "teacher eval" in phases
    if in_process:
        holders, engine = dict.fromkeys(sections, trainer), trainer
    elif on_gpu:  # one GPU holds a worker of every teacher and the accuracy engine
        engine = DevicePlan(f"teacher worker ({', '.join(sections)})", phases)
        holders = dict.fromkeys(sections, engine)
        devices.append(engine)
        counts.append(workers)
    else:  # a process per worker
        holders = {key: DevicePlan(f"teacher worker ({key})", phases) for key in sections}
        for holder in holders.values():
            holder.add("runtime (python, torch)", CPU_RUNTIME_BYTES)
            devices.append(holder)
            counts.append(workers)
        engine = DevicePlan("teacher generation worker", phases)
        if measures:
            devices.append(engine)
            counts.append(workers)
            if cfg.policy.generation.backend != "vllm":  # add_engine counts vLLM's own runtime
                engine.add("runtime (python, torch)", CPU_RUNTIME_BYTES, ("teacher eval",))
    k, rows = d.topk_logits_k, d.num_prompts_per_step * d.num_generations_per_prompt
    for key, section in sections.items():
        shape, c = shapes[key], compute_dtype_bytes(section.precision, on_gpu)
        add_teacher(holders[key], key, section, shape, c=c, workers=workers, on_gpu=on_gpu, k=k, rows=rows,
                    row_tokens=row_tokens)
        if measures:  # the accuracy engine loads this teacher in its precision and decodes validation's calls
            scratch = DevicePlan("", ("teacher eval",))
            add_engine(scratch, cfg, shape, c, device_bytes, weights=True,
                       calls={"teacher eval": (d.val_batch_size, 1)}, engines=workers,
                       row_tokens=row_tokens, longest_prompt=longest_prompt)
            for item, nbytes in scratch.rows.items():
                label = item.replace(" (distinct prompts)", "")  # as the student's row, shorter
                engine.add(f"{key} engine: {label}", nbytes["teacher eval"], ("teacher eval",), ("teacher engine", key))
    # The student trains on the rows with the teachers' top-k (float32 values, int64 indices): on
    # a GPU a micro-batch's share at a time, on CPU its rank's rows in its process.
    p = cfg.policy
    if on_gpu:
        received = 12 * k * micro_batch_tokens(p, True, row_tokens) // p.context_parallel_size
    else:
        received = 12 * k * math.ceil(rows / (p.num_workers // (p.tensor_parallel_size * p.context_parallel_size))) \
            * row_tokens
    trainer.add("top-k from the teachers (received)", received, ("training",))


def add_teacher(holder: DevicePlan, key: str, section: Any, shape: ModelShape, *, c: int, workers: int, on_gpu: bool,
                k: int, rows: int, row_tokens: int) -> None:
    """One teacher's rows (`key`, its `PolicyConfig` `section`) on `holder`, `c` its compute dtype's bytes.

    - Parameters: loaded in float32 whatever `precision` (which picks the compute dtype,
      `ModelLoading._load_model`), sharded as the policy's (`per_rank_params`), resident in every phase.
    - FSDP2 (more than one worker) all-gathers in the compute dtype: two decoder layers' TP shards
      in the logprobs phase, and the root unit (embeddings, LM head), which a forward without a
      backward leaves gathered (`ModelLoading._reshard`), from the first step on. One worker below
      float32 instead: autocast caches a compute-dtype copy of every float32 weight for the
      forward's duration (under no_grad too: measured, 128 MiB of float32 weights +64 MiB in bf16).
    - The top-k forward of one micro-batch (`get_topk_logits`, the teacher's own `logprob_batch_size`
      or token budget): one layer's activations and the full logits' head (`topk_logits_bytes`).
    - On CPU, its answer for its rank's rows (`[rows, row tokens, k]` float32 and int64) in its
      process; on a GPU that is host memory, not counted.

    The forward's rows are the teacher's turn (`DevicePlan.turns`): teachers sharing a device
    score one after the other, so a phase counts the largest teacher's."""
    tp, sp = section.tensor_parallel_size, section.sequence_parallel
    turn = ("teacher forward", key)
    holder.add(f"{key} parameters (fp32)", 4 * per_rank_params(shape, workers, tp))
    if workers > 1:
        holder.add(f"{key} FSDP root (gathered)", c * shape.embedding_params,
                   tuple(p for p in holder.phases if p != "teacher eval"))
        holder.add(f"{key} FSDP gathered layers",
                   2 * c * (shape.num_params - shape.embedding_params) / shape.num_layers / tp, ("logprobs",), turn)
    elif c < 4:
        holder.add(f"{key} autocast weight copies", c * shape.num_params, ("logprobs",), turn)
    tokens = micro_batch_tokens(section, False, row_tokens)
    holder.add(f"{key} top-k forward", tokens * activation_bytes_per_token_layer(shape, c, tp, sp)
               + topk_logits_bytes(shape, tokens, c, k), ("logprobs",), turn)
    if not on_gpu:
        holder.add(f"{key} top-k output", 12 * k * math.ceil(rows / (workers // tp)) * row_tokens, ("logprobs",), turn)
