"""A memory plan before launch: what each GPU (or CPU worker process) holds in each phase of a
run, from the model's config alone (no weights are loaded), and whether that fits.

    posttrain plan --config my.yaml policy.num_workers=8      # prints the tables, exit 2 if it cannot fit

`model_shape` (`shape.py`) reads the model's config (config.json of `policy.model_name`, or the
config of a built-in preset) and counts the parameters by building the model on torch's meta
device (exact for any architecture, no memory). Everything else is arithmetic on that shape and
the config (`formulas.py`): `memory_plan` (`jobs.py`, with `engine.py` and `teachers.py`) returns a job's `Plan` (`devices.py`: rows of bytes per
device and phase: generation, refit, logprobs, training, validation, teacher eval, evaluation, as
the job has them; a distillation's teachers where they run, `teachers.py`), `run_plan` adds the SFT warm starts that run before it as jobs of their own, and
`fit_problem` (`fit.py`) checks the run's peak against the device memory and names the config keys
that would make it fit. The printed plan ends with the peak and the job and phase that set it.

Beside the memory, a time plan (docs/plan-time.md): `timing.step_time` predicts the seconds of
each phase of an on-policy step (generation, refit, logprobs, training; validation apart) and
tokens/s per GPU from FLOPs, bytes and collective volumes against the GPU type's published peaks
(`gpus.py`, `cluster.gpu_type`) and a few efficiency constants (`timing.EFFICIENCY`); the mean
prompt and response lengths come from `lengths.py`; `time_plan.py` prints it and runs
`posttrain plan --search` (the cheapest cluster shape within a target step time).

What is and is not counted: allocator bytes of tensors (what `torch.cuda.max_memory_allocated`
reports) plus, on CPU, the interpreter with torch and transformers imported (`CPU_RUNTIME_BYTES`);
not the CUDA context (about 0.5-1 GiB per process, outside torch's allocator), fragmentation,
or temporary buffers of the optimizer step. The check keeps `HEADROOM` of the device free for those.
"""

from posttrain.plan.fit import (
    HEADROOM, candidate_fixes, check_memory, detect_device_bytes, fit_problem, fits, format_job, format_plan, run_plan,
)
from posttrain.plan.formulas import (
    CPU_RUNTIME_BYTES, DTYPE_BYTES, FUSED_LOGPROB_TILE_BYTES, PROMPTS_TOKENIZED, GiB, MiB,
    activation_bytes_per_token_layer, compute_dtype_bytes, head_bytes, kv_cache_bytes, logprob_activation_bytes,
    longest_prompt_tokens, longest_row_tokens, micro_batch_tokens, optimizer_state_bytes, per_rank_params,
    pipeline_rank, ring_attention_block_bytes, topk_logits_bytes, training_activation_bytes,
)
from posttrain.plan.devices import PHASES, DevicePlan, Plan, WarmStart
from posttrain.plan.engine import engine_rows, native_engine_bytes
from posttrain.plan.jobs import job_name, job_phases, memory_plan, validates
from posttrain.plan.shape import ModelShape, model_shape, shape_for, shape_from_hf_config
from posttrain.plan.teachers import add_teachers, read_teacher_shapes

__all__ = [
    "CPU_RUNTIME_BYTES", "DTYPE_BYTES", "FUSED_LOGPROB_TILE_BYTES", "HEADROOM", "PHASES", "PROMPTS_TOKENIZED",
    "DevicePlan", "GiB", "MiB", "ModelShape", "Plan", "WarmStart", "activation_bytes_per_token_layer", "add_teachers",
    "candidate_fixes", "check_memory", "compute_dtype_bytes", "detect_device_bytes", "engine_rows", "fit_problem",
    "fits", "format_job", "format_plan", "head_bytes", "job_name", "job_phases", "kv_cache_bytes",
    "logprob_activation_bytes", "longest_prompt_tokens", "longest_row_tokens", "memory_plan", "micro_batch_tokens",
    "model_shape", "native_engine_bytes", "optimizer_state_bytes", "per_rank_params", "pipeline_rank",
    "read_teacher_shapes",
    "ring_attention_block_bytes", "run_plan", "shape_for", "shape_from_hf_config", "topk_logits_bytes",
    "training_activation_bytes", "validates",
]
