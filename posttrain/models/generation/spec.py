"""`GenerationSpec`: what every generation backend, its controller and its workers alike, is built
from (`backend_class(cluster, spec)`, `Worker(spec=spec)`), so no backend repeats the list of
constructor arguments. It sits apart from the abstract interface (`interface.py`) and needs only
the config schema."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from posttrain.config.schema import GenerationConfig
from posttrain.distributed.progress import ProgressLimits


@dataclass(frozen=True)
class GenerationSpec:
    """What every generation backend is built from; the controller passes it on to its workers.

    Args:
        model_name: the model the engines load (a preset, local directory or hub id), which is
            weights version 0.
        generation: `policy.generation` (`GenerationConfig` or a dict of its keys; kept as a dict,
            which crosses into vLLM's own environment unchanged).
        tokenizer_name: default None: `model_name`.
        tiny_arch: arch of a built-in preset (default "llama").
        precision: `policy.precision` (default "auto": bfloat16 on a capable GPU, else float32); the
            engine's own is `engine_precision` (`policy.generation.precision` may differ).
        max_model_len: longest prompt + generation (default None: the backend's own default; the
            jobs pass `policy.max_total_sequence_length`). vLLM sizes its engine by it.
        seed: seeds rows that arrive without `seeds` (default 0); drawn by the controller before
            sharding, so the same batch gives the same samples for any number of workers.
        worker_timeout_s: longest wait for a worker call, start-up included (default 1800.0).
        rope_scaling: the model's RoPE scaling (`policy.rope_scaling`, e.g. YaRN; default None: the
            model's own), so the engines' positions match the trainer's.
        heartbeat_timeout_s: a worker silent for this long has stopped answering (default 0.0:
            no heartbeats; `WorkerGroup`).
        progress_limits: the bounds of the workers' calls' phases (`progress.ProgressLimits`;
            default None: none; `cluster.progress_timeout_*`).
        batch_invariant: the native engine generates each row alone (`policy.batch_invariant`;
            default False).
        record_routing: the engine (native, or vLLM on GPUs) returns each token's chosen experts for
            router replay (`policy.moe_router_replay`, models/router_replay.py; default False).
    """

    model_name: str
    generation: dict[str, Any] = field(default_factory=dict)
    tokenizer_name: Optional[str] = None
    tiny_arch: str = "llama"
    precision: str = "auto"
    max_model_len: Optional[int] = None
    seed: int = 0
    worker_timeout_s: float = 1800.0
    rope_scaling: Optional[dict[str, Any]] = None
    heartbeat_timeout_s: float = 0.0
    progress_limits: Any = None
    batch_invariant: bool = False
    record_routing: bool = False

    def __post_init__(self) -> None:
        generation = self.generation
        if isinstance(generation, GenerationConfig):
            generation = generation.model_dump()
        # Validated here, in the controller: a bad key fails before any worker starts.
        object.__setattr__(self, "generation", GenerationConfig(**generation).model_dump())

    @property
    def config(self) -> GenerationConfig:
        """`generation` as a `GenerationConfig`."""
        return GenerationConfig(**self.generation)

    @property
    def engine_precision(self) -> str:
        """The `policy.precision`-style name of the dtype the engine loads the model in:
        `policy.generation.precision` when it is `float32` or `bfloat16`, else `precision` (the
        trainer's; with int8 and fp8 the layers left unquantized keep it)."""
        generation = self.generation["precision"]
        return generation if generation in ("float32", "bfloat16") else self.precision

    @classmethod
    def from_config(cls, cfg: Any, *, model: Any = None, seed: int = 0) -> "GenerationSpec":
        """The spec of a job's generation: `cfg.policy.generation`, the run's
        `policy.max_total_sequence_length`, `cluster.worker_timeout_s` and
        `cluster.heartbeat_timeout_s`, and the model of `model` (default None: `cfg.policy`;
        anything with `model_name`, `tokenizer_name`, `tiny_arch`, `precision` and `rope_scaling`,
        such as distillation's `teacher`)."""
        model = cfg.policy if model is None else model
        return cls(
            model_name=model.model_name, generation=cfg.policy.generation, tokenizer_name=model.tokenizer_name,
            tiny_arch=model.tiny_arch, precision=model.precision,
            max_model_len=cfg.policy.max_total_sequence_length, seed=seed,
            worker_timeout_s=cfg.cluster.worker_timeout_s, heartbeat_timeout_s=cfg.cluster.heartbeat_timeout_s,
            progress_limits=ProgressLimits.from_config(cfg.cluster), rope_scaling=getattr(model, "rope_scaling", None), batch_invariant=cfg.policy.batch_invariant,
            record_routing=cfg.policy.moe_router_replay and model is cfg.policy,
        )
