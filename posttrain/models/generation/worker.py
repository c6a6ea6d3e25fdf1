"""`GenerationWorker`: a Ray actor holding a model and a `NativeGenerationEngine`.

Created through `WorkerGroup` by the controller-side `NativeGeneration` (native.py). Each worker
generates for its data-parallel shard and receives packed refits (`posttrain.models.refit`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from posttrain.config.schema import SpeculativeConfig
from posttrain.distributed import actors
from posttrain.distributed.batch import Batch
from posttrain.distributed.worker_group import DistributedWorker
from posttrain.errors import UserError
from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.generation.low_precision import apply_generation_precision, requantize
from posttrain.models.generation.spec import GenerationSpec
from posttrain.models.generation.speculative import Drafter, make_drafter
from posttrain.models.hf import load_causal_lm, load_policy_lm, load_tokenizer, pick_dtype
from posttrain.cpu_precision import float32_matmuls_where_bfloat16_is_slow
from posttrain.models.refit import RefitMetadata, check_metadata_matches, load_bucket, state_dict_checksum
from posttrain.utils.phase_memory import MeasuresPhases, measured_phase

# Keys of `params` that may override the generation config for one `generate` call.
SAMPLING_PARAMS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "stop_strings")


def merge_stop_strings(global_stops: Optional[Sequence[str]], row_stops: Optional[list]) -> Optional[list]:
    """Per-row stop strings: the config's list plus each row's own (NeMo-RL merges them the same way)."""
    if row_stops is None:
        return list(global_stops) if global_stops else None
    return [list(global_stops or []) + list(row or []) for row in row_stops]


def build_drafter(
    speculative: SpeculativeConfig, tokenizer, *, dtype: torch.dtype, device: torch.device, tiny_arch: str = "llama",
) -> Optional[Drafter]:
    """The drafter of `policy.generation.speculative` for an engine whose policy uses `tokenizer`;
    method=draft_model loads the draft model (`dtype`, `device`) after checking that its tokenizer
    is the policy's (UserError otherwise)."""
    draft_engine = None
    if speculative.method == "draft_model":
        name = speculative.draft_model
        check_same_tokenizer(tokenizer, load_tokenizer(name, tiny_arch), name)
        draft = load_causal_lm(name, dtype=dtype, device=device, tiny_arch=tiny_arch)
        draft_engine = NativeGenerationEngine(draft, pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    return make_drafter(
        speculative.method, num_draft_tokens=speculative.num_draft_tokens, ngram_size=speculative.ngram_size,
        ngram_min_size=speculative.ngram_min_size, draft_engine=draft_engine, draft_layers=speculative.draft_layers,
    )


def check_same_tokenizer(policy_tokenizer, draft_tokenizer, draft_name: str) -> None:
    """A draft model's token ids must mean the policy's tokens: the two vocabularies must be equal."""
    ours, theirs = policy_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: (item[1], item[0]))[:1]
        raise UserError(
            f"policy.generation.speculative.draft_model={draft_name!r} has another tokenizer than the policy "
            f"({len(theirs)} tokens against {len(ours)}; e.g. {differ[0][0]!r} is id {differ[0][1]} in only one): "
            "a draft model must share the policy's tokenizer"
        )


class GenerationWorker(MeasuresPhases, DistributedWorker):
    """One data-parallel generation replica.

    Args:
        spec: the model to load, `policy.generation` settings and `seed` (`GenerationSpec`); the
            torch RNG of rank r is seeded with `spec.seed + r`, used only by rows that arrive
            without a `seeds` entry.
    """

    def __init__(self, spec: GenerationSpec) -> None:
        super().__init__()
        torch.manual_seed(spec.seed + self.rank)
        self.config = spec.config
        self.tokenizer = load_tokenizer(spec.tokenizer_name or spec.model_name, spec.tiny_arch)
        dtype = pick_dtype(spec.engine_precision, self.device)
        self.model = load_policy_lm(spec.model_name, dtype=dtype, device=self.device, tiny_arch=spec.tiny_arch,
                                    rope_scaling=spec.rope_scaling)
        # int8 / fp8: the linear layers compute with a quantized copy, rebuilt after every refit.
        apply_generation_precision(self.model, self.config.precision, self.device)
        float32_matmuls_where_bfloat16_is_slow(self.model, dtype, self.device)
        self.drafter = build_drafter(self.config.speculative, self.tokenizer, dtype=dtype, device=self.device,
                                     tiny_arch=spec.tiny_arch)
        self.engine = NativeGenerationEngine(
            self.model, self.tokenizer,
            pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id,
            speculative=self.drafter, batch_invariant=spec.batch_invariant, record_routing=spec.record_routing,
            share_prompt_prefix=self.config.share_prompt_prefix,
        )
        self.refit_metadata: Optional[RefitMetadata] = None
        self.weights_version = 0  # the checkpoint loaded from model_name

    def special_token_ids(self) -> dict[str, Optional[int]]:
        """`{"pad_token_id": ..., "eos_token_id": ...}` of the worker's tokenizer."""
        return {"pad_token_id": self.tokenizer.pad_token_id, "eos_token_id": self.tokenizer.eos_token_id}

    @measured_phase("generation")
    def generate(self, batch: Batch, greedy: bool = False, params: Optional[dict[str, Any]] = None) -> Batch:
        """Generate for `batch` (`input_ids`, `input_lengths`, optional `seeds [B]`, `start_steps [B]`
        (`NativeGenerationEngine.generate`: continue a turn's generation), per-row `stop_strings` and, for a
        vision-language model, `pixel_values` (a list, one entry per row)), `generation.batch_size` rows decoded at
        once (continuous batching: `NativeGenerationEngine.generate`'s `max_running_rows`).

        `params` overrides keys of the generation config for this call (e.g. the validation
        temperature); allowed keys: `SAMPLING_PARAMS`.
        """
        unknown = sorted(set(params or {}) - set(SAMPLING_PARAMS))
        if unknown:
            raise KeyError(f"generate: unknown sampling params {unknown}; allowed: {list(SAMPLING_PARAMS)}")
        for key in ("input_ids", "input_lengths"):
            if key not in batch:
                raise KeyError(f"generate: batch lacks {key!r} (has {sorted(batch)})")
        options = {key: getattr(self.config, key) for key in SAMPLING_PARAMS}
        options.update(params or {})
        global_stops = options.pop("stop_strings")

        out = self.engine.generate(
            batch["input_ids"].to(self.device),
            batch["input_lengths"].to(self.device),
            greedy=greedy,
            stop_strings=merge_stop_strings(global_stops, batch.get("stop_strings")),
            seeds=batch.get("seeds"),
            start_steps=batch.get("start_steps"),
            pixel_values=batch.get("pixel_values"),  # a vision-language model's images (models/vision_inputs.py)
            max_running_rows=self.config.batch_size,  # continuous batching beyond it
            **options,
        )
        return Batch({key: value.cpu() for key, value in out.items()})

    # ------------------------------------------------------------------ memory
    def _models(self) -> list[torch.nn.Module]:
        """The policy's model and, with speculative method=draft_model, the draft model."""
        draft_engine = getattr(self.drafter, "draft_engine", None)
        return [self.model] + ([draft_engine.model] if draft_engine is not None else [])

    def prepare_for_generation(self) -> bool:
        """Put the weights on the worker's device (after `finish_generation(offload=True)`)."""
        for model in self._models():
            model.to(self.device)
        return True

    def finish_generation(self, offload: bool = False) -> bool:
        """With `offload` (colocated with training on a GPU), move the weights to CPU and free the
        GPU cache for the policy; a no-op on CPU."""
        if offload and self.device.type == "cuda":
            for model in self._models():
                model.to("cpu")
            torch.cuda.empty_cache()
        return True

    # ------------------------------------------------------------------ refit receiver
    def prepare_refit_info(self, metadata: RefitMetadata) -> bool:
        """Store the packed-buffer layout (once); fails if it names tensors the model lacks."""
        check_metadata_matches(self.model, metadata)
        self.refit_metadata = metadata
        return True

    def _metadata(self) -> RefitMetadata:
        if self.refit_metadata is None:
            raise RuntimeError("refit before prepare_refit_info: call Generation.prepare_refit_info first")
        return self.refit_metadata

    @measured_phase("refit")
    def load_bucket(self, buffer: np.ndarray | Any, bucket: int) -> bool:
        """Copy one packed bucket into the model; `buffer` is an array (zero-copy from Ray's object
        store) or a ref to one."""
        load_bucket(self.model, actors.get(buffer) if actors.is_ref(buffer) else buffer, self._metadata(), bucket)
        return True

    def finish_refit(self, version: int) -> bool:
        """Every bucket is in: requantize a low-precision engine's layers, and record `version` as
        the held weights version."""
        requantize(self.model)
        self.weights_version = version
        return True

    def init_broadcast_group(self, host: str, port: int, world_size: int, rank: int) -> bool:
        """Split refit: join policy rank 0's broadcast group as `rank`."""
        from posttrain.distributed.collective import new_standalone_group

        self._broadcast_group = new_standalone_group(host, port, rank, world_size, self.device)
        return True

    @measured_phase("refit")
    def load_broadcast(self) -> bool:
        """Broadcast refit: receive every bucket from the broadcast group's rank 0 into one buffer,
        loading each before the next arrives (one bucket held at a time)."""
        metadata = self._metadata()
        receive = torch.empty(metadata.max_bucket_bytes, dtype=torch.uint8, device=self.device)
        for bucket, size in enumerate(metadata.bucket_sizes):
            buffer = receive[:size]
            self._broadcast_group.broadcast(buffer, src=0)
            load_bucket(self.model, buffer, metadata, bucket)
        return True

    @measured_phase("refit")
    @torch.no_grad()
    def share_weights(self, weights: dict[str, torch.Tensor], version: int) -> int:
        """Refit from a policy in this process (the local backend): each tensor of `weights` of
        the model's dtype and device becomes the model's own (shared storage: the policy's
        optimizer steps update it in place, so later refits move no bytes); the others are copied.
        Returns the number of bytes copied."""
        own = self.model.state_dict()
        unknown = sorted(set(weights) - set(own))
        if unknown:
            raise KeyError(f"refit: model has no tensors named {unknown[:5]}")
        copied = 0
        for name, source in weights.items():
            target = own[name]
            if target.data_ptr() == source.data_ptr():
                continue  # shared since an earlier refit
            if source.dtype == target.dtype and source.device == target.device and source.shape == target.shape:
                module_name, _, leaf = name.rpartition(".")
                module = self.model.get_submodule(module_name)
                if leaf in module._parameters:
                    module._parameters[leaf].data = source
                else:
                    module._buffers[leaf] = source
            else:
                target.copy_(source)
                copied += source.numel() * source.element_size()
        requantize(self.model)  # from the shared weights, which the optimizer changed in place
        self.weights_version = version
        return copied

    def get_weights_version(self) -> int:
        return self.weights_version

    def get_weight_dtypes(self) -> dict[str, torch.dtype]:
        return {name: t.dtype for name, t in self.model.state_dict().items()}

    def get_weights_checksum(self) -> str:
        """`refit.state_dict_checksum` of the model's weights (bit-exact comparison across actors)."""
        return state_dict_checksum(self.model.state_dict())

    def get_state_dict(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the weights (for tests and `verify_refit`)."""
        return {name: t.detach().cpu().clone() for name, t in self.model.state_dict().items()}
