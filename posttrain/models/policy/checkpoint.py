"""Policy checkpoints: sharded `torch.distributed.checkpoint` (DCP) state and Hugging Face export.

A directory written by `PolicyWorker.save_checkpoint(path)` holds

    path/
      model/            DCP: model parameters, HF names, each rank writes its own shards
      optim/            DCP: optimizer state (absent when saved without the optimizer)
      hf/               config.json (+ generation_config.json) and the tokenizer: enough to
                        rebuild the model skeleton and export without the original model dir
      trainer_state.pt  {"step", "scheduler", "model_type"} (rank 0)
      rng/rank_<r>.pt   per-rank RNG states of python, numpy, torch and cuda

It is written to `<path>.tmp` and renamed to `path` by rank 0 after a barrier, so a crash never
leaves a half-written checkpoint under the final name. DCP reshards on load, so a checkpoint
saved with N data-parallel workers loads with M.

`Checkpointing` is the worker's side, a mixin of `PolicyWorker`: `save_checkpoint`,
`load_checkpoint` and `export_hf`, each collective over the policy's ranks.

`convert_to_hf(checkpoint_dir, out_dir)` turns such a directory (or a `step_N` directory holding
one under `policy/`) into a consolidated `save_pretrained` directory (safetensors) that
`AutoModelForCausalLM.from_pretrained` loads; the CLI's `posttrain convert` calls it. Like
NeMo-RL's converter it loads the full model into CPU memory once.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from posttrain.distributed import collective
from posttrain.models.saving import save_pretrained_here
from posttrain.data.image_prompts import processor_for
from posttrain.models.vision_inputs import is_vision_language_config
from posttrain.utils.model_build import MODEL_BUILD_LOCK
from posttrain.utils.checkpoint import publish_dir

# A worker of the local backend saves and loads without a process group, which DCP handles (it
# reads and writes as the only rank) but warns about on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)

MODEL_DIR, OPTIM_DIR, HF_DIR = "model", "optim", "hf"
TRAINER_STATE_FILE = "trainer_state.pt"
RNG_DIR = "rng"
# A policy, a reward model (one score per sequence) and a value model (PPO's critic: one value per token).
MODEL_CLASSES = {"lm": AutoModelForCausalLM, "reward": AutoModelForSequenceClassification,
                 "value": AutoModelForTokenClassification}


# ------------------------------------------------------------------------------------- RNG state
def rng_state() -> dict[str, Any]:
    """RNG states of python, numpy, torch and (when present) every CUDA device of this process."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------ save / load
def tmp_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".tmp")


def save_sharded(
    path: str | os.PathLike,
    *,
    model_state: dict[str, Any],
    optim_state: dict[str, Any] | None,
    trainer_state: dict[str, Any],
    hf_config: Any,
    tokenizer: Any,
) -> Path:
    """Collective: every rank calls it with its own shards. Returns the final `path`.

    Args:
        path: final directory; an existing one is replaced once the new one is complete.
        model_state / optim_state: from `get_state_dict` (DTensor shards under FSDP).
        trainer_state: small picklable dict written by rank 0 (step, scheduler state, ...).
        hf_config / tokenizer: saved by rank 0 with `save_pretrained` into `hf/`.
    """
    final, tmp = Path(path), tmp_path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0  # a local-backend worker has no process group
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        tmp.mkdir(parents=True)
    collective.barrier()
    dcp.save(model_state, checkpoint_id=str(tmp / MODEL_DIR))
    if optim_state is not None:
        dcp.save(optim_state, checkpoint_id=str(tmp / OPTIM_DIR))
    (tmp / RNG_DIR).mkdir(exist_ok=True)
    torch.save(rng_state(), tmp / RNG_DIR / f"rank_{rank}.pt")
    if rank == 0:
        torch.save(trainer_state, tmp / TRAINER_STATE_FILE)
        hf_config.save_pretrained(tmp / HF_DIR)
        tokenizer.save_pretrained(tmp / HF_DIR)
        save_processor(tokenizer, hf_config, tmp / HF_DIR)
    collective.barrier()  # every rank's shards are on disk before the rename publishes them
    if rank == 0:
        publish_dir(tmp, final)
    collective.barrier()
    return final


def has_optimizer_state(path: str | os.PathLike) -> bool:
    """Whether the policy checkpoint at `path` holds optimizer state (not when saved with
    `save_optimizer=False`, i.e. `checkpointing.save_optimizer=false`)."""
    return (Path(path) / OPTIM_DIR / ".metadata").is_file()


def optimizer_state_is_flat(path: str | os.PathLike) -> bool:
    """Whether the optimizer state at `path` was saved flattened (`flatten_optimizer_state_dict`:
    hyperparameters per parameter name, as pipeline stages save it, since each stage's param
    groups list only its own parameters) rather than as whole param groups."""
    keys = dcp.FileSystemReader(str(Path(path) / OPTIM_DIR)).read_metadata().state_dict_metadata
    # Whole groups are stored by index (`param_groups.0.lr`), flattened ones by parameter name.
    return not any(key == "param_groups" or key.split(".")[1:2] == ["0"] for key in keys
                   if key.startswith("param_groups"))


def check_checkpoint_dir(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not (path / MODEL_DIR / ".metadata").is_file():
        hint = f" (did you mean {path / 'policy'}?)" if (path / "policy" / MODEL_DIR).is_dir() else ""
        raise FileNotFoundError(f"{path} is not a policy checkpoint: {path / MODEL_DIR / '.metadata'} is missing{hint}")
    return path


def load_sharded_into(path: str | os.PathLike, state: dict[str, Any], part: str) -> None:
    """Collective: fill `state` (model or optimizer shards, from `get_state_dict`) in place.

    The optimizer's part may lack entries `state` has: a parameter that never had a gradient (a
    vision tower's last norm, which LLaVA's features skip) has no optimizer state in the run that
    saved it, while `get_state_dict` gives a fresh optimizer state for every parameter. Those keep
    their fresh (zero) state, which the optimizer never reads for a parameter without a gradient;
    the model's part must match whole."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    planner = DefaultLoadPlanner(allow_partial_load=part == OPTIM_DIR)
    dcp.load(state, checkpoint_id=str(Path(path) / part), planner=planner)


def load_trainer_state(path: str | os.PathLike, rank: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """`(trainer_state, rng_state or None)`: rng is None when the checkpoint has no file for `rank`
    (it was saved with fewer workers)."""
    path = Path(path)
    trainer_state = torch.load(path / TRAINER_STATE_FILE, weights_only=False)
    rng_file = path / RNG_DIR / f"rank_{rank}.pt"
    rng = torch.load(rng_file, weights_only=False) if rng_file.is_file() else None
    return trainer_state, rng


# ------------------------------------------------------------------------------------ HF export
def save_hf(
    state_dict: Mapping[str, torch.Tensor],
    hf_config: Any,
    tokenizer: Any,
    out_dir: str | os.PathLike,
    model_type: str = "lm",
) -> Path:
    """Write a consolidated HF directory (safetensors, config, tokenizer) from full weights.

    The model skeleton is built on the meta device and the given tensors are assigned into it, so
    no extra copy of the weights is made.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_class = MODEL_CLASSES[model_type]
    if model_type == "lm" and is_vision_language_config(hf_config):
        model_class = AutoModelForImageTextToText
    with torch.device("meta"), MODEL_BUILD_LOCK:
        model = model_class.from_config(hf_config)
    missing, unexpected = model.load_state_dict(dict(state_dict), strict=False, assign=True)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(
            f"weights do not match the {type(model).__name__} of the saved config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    if tied:
        model.tie_weights()
    save_pretrained_here(model, out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
        save_processor(tokenizer, hf_config, out)
    return out


def save_processor(tokenizer: Any, hf_config: Any, out: str | os.PathLike) -> None:
    """A vision-language model's processor (image processor, image-token expansion) beside its
    tokenizer, so that the directory loads as the model did (`hf.load_processor`); nothing for a text model."""
    if is_vision_language_config(hf_config):
        processor_for(tokenizer).save_pretrained(out)


def converted_checkpoint(checkpoint_dir: str | os.PathLike) -> Path:
    """A Hugging Face copy of a `step_N` checkpoint, converted once and cached.

    Lets `policy.model_name` name a training checkpoint everywhere a model is accepted. The cache
    key is the checkpoint's resolved path and modification time, so a re-saved step converts again.
    """
    from posttrain.models.paths import converted_checkpoint_dir

    from posttrain.utils.cache import publish_entry

    path = Path(checkpoint_dir).resolve()
    out = converted_checkpoint_dir(path)
    return publish_entry(out, lambda tmp: convert_to_hf(path, tmp), {"kind": "converted-checkpoint", "checkpoint": str(path)},
                         describe=f"Hugging Face copy of {path}")


def convert_to_hf(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert a policy checkpoint (or a `step_N` dir with one under `policy/`) to HF format.

    Runs in a single process without a process group. A run's checkpoint directory (holding
    `step_N` subdirectories) is refused with a `UserError` naming its latest step.
    """
    from posttrain.errors import UserError
    from posttrain.models.paths import checkpoint_policy_dir, latest_step_dir

    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise UserError(f"checkpoint {str(path)!r} does not exist")
    if checkpoint_policy_dir(path) is None:
        latest = latest_step_dir(path)
        if latest is not None:
            raise UserError(f"{path} is a run's checkpoint directory; convert one of its steps, e.g. --checkpoint {latest}")
        raise UserError(f"{path} is not a training checkpoint (expected a step_N directory with policy/model/.metadata)")
    if not (path / MODEL_DIR).is_dir() and (path / "policy" / MODEL_DIR).is_dir():
        path = path / "policy"
    path = check_checkpoint_dir(path)
    trainer_state = torch.load(path / TRAINER_STATE_FILE, weights_only=False)
    hf_config = AutoConfig.from_pretrained(path / HF_DIR)
    tokenizer = AutoTokenizer.from_pretrained(path / HF_DIR)
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "model.pt"
        dcp_to_torch_save(path / MODEL_DIR, full)
        state_dict = torch.load(full, weights_only=True, mmap=True)
        if trainer_state.get("lora_scaling") is not None:  # trained with LoRA: fold the adapters in
            from posttrain.models.lora import merged_state_dict

            state_dict = merged_state_dict(state_dict, trainer_state["lora_scaling"])
        return save_hf(state_dict, hf_config, tokenizer, out_dir, trainer_state.get("model_type", "lm"))


# -------------------------------------------------------------------------------- the worker's side
class Checkpointing:
    """Mixin of `PolicyWorker`: `save_checkpoint`, `load_checkpoint` and `export_hf` of one rank.

    Reads `self.model`, `self.optimizer`, `self.scheduler` (None without `init_optimizer`),
    `self.step`, `self.model_type`, `self.lora_scaling`, `self.hf_config`, `self.tokenizer` and
    `self.rank`, and calls `self._reshard` (`ModelLoading`) and `self._full_state_dict`
    (`WeightExport`); `load_checkpoint` sets `self.step`.
    """

    def save_checkpoint(self, path: str, save_optimizer: bool = True) -> str:
        """Collective: sharded model (+ optimizer), scheduler, step and RNG state (module doc)."""
        optimizers = (self.optimizer,) if save_optimizer and self.optimizer is not None else ()
        # Pipeline stages hold different parameters: their optimizer state is saved per parameter
        # name (flattened), so that it loads into any other stage split, or none.
        flat = StateDictOptions(flatten_optimizer_state_dict=getattr(self, "pp_size", 1) > 1)
        model_state, optim_state = get_state_dict(self.model, optimizers, options=flat)
        trainer_state = {
            "step": self.step,
            "model_type": self.model_type,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "lora_scaling": self.lora_scaling,  # `posttrain convert` merges the adapters with it
        }
        final = save_sharded(
            path,
            model_state=model_state,
            optim_state=optim_state if optimizers else None,
            trainer_state=trainer_state,
            hf_config=self.hf_config,
            tokenizer=self.tokenizer,
        )
        return str(final)

    def load_checkpoint(self, path: str, load_optimizer: bool = True) -> None:
        """Collective: restore what `save_checkpoint` wrote (any number of saving workers)."""
        path = check_checkpoint_dir(path)
        self._reshard()
        has_optim = has_optimizer_state(path)
        if load_optimizer and self.optimizer is not None and has_optim:
            flat = StateDictOptions(flatten_optimizer_state_dict=optimizer_state_is_flat(path))
            model_state, optim_state = get_state_dict(self.model, (self.optimizer,), options=flat)
            load_sharded_into(path, model_state, MODEL_DIR)
            load_sharded_into(path, optim_state, OPTIM_DIR)
            set_state_dict(self.model, (self.optimizer,), model_state_dict=model_state, optim_state_dict=optim_state,
                           options=flat)
        else:
            model_state = get_model_state_dict(self.model)
            load_sharded_into(path, model_state, MODEL_DIR)
            set_model_state_dict(self.model, model_state)
        trainer_state, rng = load_trainer_state(path, self.rank)
        if load_optimizer and self.scheduler is not None and trainer_state.get("scheduler") is not None:
            self.scheduler.load_state_dict(trainer_state["scheduler"])
            for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr
        self.step = int(trainer_state["step"])
        if rng is not None:
            set_rng_state(rng)

    def export_hf(self, out_dir: str) -> Optional[str]:
        """Collective: consolidated HF directory (safetensors + config + tokenizer), written by rank 0."""
        state = self._full_state_dict()
        out = None
        if self.rank == 0:
            out = str(save_hf(state, self.hf_config, self.tokenizer, out_dir, self.model_type))
        collective.barrier()
        return out
