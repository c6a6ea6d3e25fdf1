"""Generation: the native PyTorch engine, its Ray workers and the controller-side interface.

- `sampling`: `process_logits` (temperature / top-k / top-p) and counter-based seeded `sample`.
- `decoders`: the engine's decode steps: the model's own forward (any HF causal LM) or
  `LlamaLikeDecoder` (llama-like models, preallocated KV cache).
- `gemma3_decoder`: `Gemma3Decoder` (Gemma 3's layers in that fast path) and `fast_decoder`, a model's fast decoder.
- `engine`: `NativeGenerationEngine` (KV-cache batched decoding of any HF causal LM).
- `worker`: `GenerationWorker`, a Ray actor holding a model and an engine.
- `interface`: the contract of a backend, `GenerationInterface` (abstract) and `RefitVerificationError`.
- `spec`: `GenerationSpec`, what every backend (controller and workers) is built from.
- `backends`: the backends by name (`register_generation_backend`; `policy.generation.backend`).
- `worker_group_generation`: `WorkerGroupGeneration`, seeding and sharding over data-parallel workers.
- `native`: `NativeGeneration` (backend "native"), the controller-side handle of `GenerationWorker`s.
- `vllm_generation`, `vllm_worker`: backend "vllm".
"""

from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.generation.sampling import process_logits, sample

__all__ = ["NativeGenerationEngine", "process_logits", "sample"]
