"""`ModelLoading`: how a `PolicyWorker` builds its model and spreads it over the ranks.

The model is read on the CPU in float32 (a causal LM, a sequence classifier with one label for
a reward model, or a token classifier with one label for a value model); with several workers
only rank 0 reads the weights and the others build the skeleton on the meta device and receive
their shards (`sharded_load.py`); from local safetensors, under pipeline parallelism every rank
reads its stages' tensors, under expert parallelism every tensor but the routed experts and then
its own experts. It is then sharded: tensor parallel within each TP group and FSDP2 over the
data-parallel ranks (`parallel.py`), or FSDP2 over data x context-parallel ranks
(`context_parallel.py`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import AutoConfig

from posttrain.config.schema import PolicyConfig
from posttrain.models.hf import apply_rope_scaling, load_policy_lm, parse_tiny_name
from posttrain.models.parallel_sizes import num_routed_experts
from posttrain.models.policy import context_parallel, expert_parallel, parallel, pipeline, sharded_load
from posttrain.models.policy.checkpoint import MODEL_CLASSES
from posttrain.utils.model_build import MODEL_BUILD_LOCK


def is_mixture_of_experts(policy: PolicyConfig) -> bool:
    """Whether `policy.model_name` is a mixture of experts, from its name (tiny presets) or config.json."""
    from posttrain.models.paths import model_config_dict
    from posttrain.models.presets import MOE_ARCHS

    tiny = parse_tiny_name(policy.model_name, policy.tiny_arch)
    if tiny is not None:
        return tiny[1] in MOE_ARCHS
    return num_routed_experts(model_config_dict(policy.model_name) or {}) is not None


class ModelLoading:
    """Mixin of `PolicyWorker`: reads `self.cfg`, `self.model_type`, `self.loads_sharded`,
    `self.tokenizer`, `self.rank`, `self.world_size`, `self.tp_size`, `self.cp_size`,
    `self.ep_size`, `self.pp_size`, `self.compute_dtype`, `self.device`, `self.is_fsdp`, `self.model` and
    `self.load_host_memory`; `_shard_model` sets `self.dp_group`, `self.cp_group`, `self.metrics_group`,
    `self.expert_params` and `self.expert_replica_group` (expert parallelism), and with pipeline
    parallelism `self.pp_group`, `self.pipeline_chunks` and `self.pipeline_stages`. Under expert
    parallelism from local safetensors, `_load_model` sets `self.expert_reader` (each rank's experts
    are read when `_shard_model` splits them)."""

    expert_reader: Optional[sharded_load.ExpertSliceReader] = None

    def _load_model(self, model_path: str) -> torch.nn.Module:
        # Loaded on the CPU in float32: FSDP moves only this rank's shard to the device. With
        # several workers only rank 0 reads the weights; the others receive their shards (sharded_load.py).
        rope_scaling = self.cfg.rope_scaling
        if self.model_type == "lm":
            # Pipeline stages: every rank reads only its own stages' tensors (`_shard_model`).
            self.stage_weights = (sharded_load.safetensors_files(model_path) if self.cfg.pipeline_parallel_size > 1
                                  else None)
            # Expert parallelism: every rank reads the tensors outside the routed experts, and its own experts only.
            files = (sharded_load.safetensors_files(model_path) if self.ep_size > 1 and not self.is_vision else None)
            if (self.loads_sharded and self.rank != 0) or self.stage_weights is not None or files is not None:
                model = sharded_load.empty_causal_lm(model_path, self.cfg.tiny_arch, self.cfg.attn_implementation,
                                                     rope_scaling=rope_scaling)
                if files is not None:
                    self.expert_reader = sharded_load.ExpertSliceReader(files, model.config.model_type)
                    sharded_load.fill_from_safetensors(model, files, skip=expert_parallel.expert_weight_names(model),
                                                       names=self.expert_reader.names)
                return model
            return load_policy_lm(model_path, dtype=torch.float32, device="cpu", tiny_arch=self.cfg.tiny_arch,
                                  attn_implementation=self.cfg.attn_implementation, rope_scaling=rope_scaling)
        config = apply_rope_scaling(AutoConfig.from_pretrained(model_path, num_labels=1), rope_scaling)
        if config.pad_token_id is None:  # needed to find each row's last token
            config.pad_token_id = self.tokenizer.pad_token_id
        if self.model_type == "value":
            # The token head as the reward model's sequence head (no bias, no dropout): a reward
            # model's weights load into it exactly, and training and scoring forwards agree.
            config.classifier_dropout, config.token_classification_bias = 0.0, False
        from transformers.utils import logging as hf_logging

        # transformers prints a coloured LOAD REPORT table listing lm_head as UNEXPECTED and the
        # score head as MISSING: expected for a new reward head, alarming to read. Say it plainly.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            with torch.random.fork_rng(devices=[]), MODEL_BUILD_LOCK:
                torch.manual_seed(0)  # the new score head: same initial values on every rank and run
                model, info = MODEL_CLASSES[self.model_type].from_pretrained(
                    model_path, config=config, dtype=torch.float32, output_loading_info=True
                )
        finally:
            hf_logging.set_verbosity(verbosity)
        if self.rank == 0:
            role = "value model" if self.model_type == "value" else "reward model"
            print(reward_head_load_note(model_path, info["missing_keys"], info["unexpected_keys"], role), flush=True)
        return model

    def _shard_model(self) -> None:
        """Tensor parallel over each TP group, FSDP2 over the data-parallel ranks (`parallel.py`)."""
        if self.pp_size > 1:  # this rank's stages only, each sharded over its dp sub-mesh (pipeline.py)
            mesh = pipeline.build_mesh(self.device.type, self.world_size, self.pp_size, self.tp_size)
            self.dp_group, self.pp_group, self.metrics_group = mesh["dp_group"], mesh["pp_group"], mesh["metrics_group"]
            files = self.stage_weights
            self.pipeline_chunks, self.pipeline_stages = pipeline.split_and_shard(
                self.model, self.cfg, mesh, mixed_precision=parallel.mixed_precision_policy(self.compute_dtype),
                cpu_offload=self.cfg.fsdp_cpu_offload and self.device.type != "cpu",
                fill_stages=None if files is None else lambda model: sharded_load.fill_from_safetensors(model, files))
            self._gather_layout()
            if self.rank == 0:
                reads = ("reads only its stages' tensors" if files is not None else
                         "reads the whole checkpoint (not local safetensors) and keeps its stages")
                print(f"[posttrain] pipeline parallel x{self.pp_size} ({self.cfg.pipeline_schedule}, "
                      f"{self.cfg.pipeline_stages_per_worker} stage(s) per worker): every worker {reads}", flush=True)
            return
        if self.cp_size > 1:
            dp_mesh, self.dp_group, self.cp_group, tp_mesh = context_parallel.build_mesh(
                self.device.type, self.world_size, self.cp_size, self.tp_size)
        else:
            dp_mesh, tp_mesh = parallel.build_mesh(self.device.type, self.world_size, self.tp_size)
            if tp_mesh is not None:
                self.dp_group = dp_mesh.get_group()
        self.metrics_group = self.dp_group
        ep_mesh = None
        if self.ep_size > 1:  # experts split over neighbouring ranks, replicated over `edp` (expert_parallel.py)
            ep_mesh = expert_parallel.build_mesh(self.device.type, self.world_size, self.ep_size)
            self.expert_replica_group = ep_mesh["edp"].get_group()
            ep_mesh = ep_mesh["ep"]
        self.expert_params = parallel.shard_model(
            self.model, dp_mesh, tp_mesh, ep_mesh=ep_mesh, expert_reader=self.expert_reader,
            sequence_parallel=self.cfg.sequence_parallel,
            activation_checkpointing=self.cfg.activation_checkpointing,
            weights_on_rank0_only=self.loads_sharded,
            mixed_precision=parallel.mixed_precision_policy(self.compute_dtype),
            cpu_offload=self.cfg.fsdp_cpu_offload and self.device.type != "cpu",
        )
        if self.ep_size > 1 and self.rank == 0:
            reads = ("reads the tensors outside the routed experts and only its own experts' slices"
                     if self.expert_reader is not None else
                     "reads the whole checkpoint (not local safetensors) and keeps its experts")
            print(f"[posttrain] expert parallel x{self.ep_size}: every worker {reads}", flush=True)
        if self.cfg.fsdp_cpu_offload and self.device.type == "cpu" and self.rank == 0:
            # FSDP2's CPUOffloadPolicy needs an accelerator to offload from.
            print("[posttrain] policy.fsdp_cpu_offload: nothing to offload on CPU workers (weights already live in "
                  "host memory)", flush=True)

    def _reshard(self) -> None:
        """Drop FSDP's gathered copies so the next forward re-gathers from the sharded weights.

        Needed before changing weights outside the optimizer (reference swap, checkpoint load):
        the root unit keeps its gathered parameters after a no-grad forward.
        """
        if self.is_fsdp:  # pipeline stages are FSDP roots of their own, outside self.model
            for module in [*self.model.modules(), *self.pipeline_chunks]:
                if isinstance(module, FSDPModule):
                    module.reshard()

    def get_load_host_memory(self) -> dict[str, int]:
        """Resident set of this worker's process (bytes) just before the model load, its peak during
        the load (reading, sharding, receiving shards) and after it: what loading cost this rank."""
        return dict(self.load_host_memory)


def reward_head_load_note(model_path: str, missing: list[str], unexpected: list[str], role: str = "reward model") -> str:
    """One plain line about loading a causal LM as a reward model (or a value model, `role`): a new
    score head and the language-model head left out are expected; anything else missing or unused
    is named."""
    new_head = sorted(k for k in missing if k.startswith("score."))
    dropped = sorted(k for k in unexpected if k.startswith("lm_head."))
    other_missing = sorted(set(missing) - set(new_head))
    other_unused = sorted(set(unexpected) - set(dropped))
    if not other_missing and not other_unused:
        if not new_head:
            return f"[posttrain] {role} loaded from {model_path} (with its trained score head)"
        return (f"[posttrain] {role} from {model_path}: new score head ({', '.join(new_head)}) initialised; "
                f"the language-model head is not used")
    return (f"[posttrain] WARNING: {role} from {model_path}: weights not in the checkpoint: "
            f"{other_missing[:5] or 'none'}; checkpoint weights not used: {other_unused[:5] or 'none'}")
