"""Generation: the native PyTorch engine, its Ray workers and the controller-side interface.

- `sampling`: `process_logits` (temperature / top-k / top-p) and counter-based seeded `sample`.
- `decoders`: the engine's decode steps: the model's own forward (any HF causal LM) or
  `LlamaLikeDecoder` (llama-like models, preallocated KV cache).
- `engine`: `NativeGenerationEngine` (KV-cache batched decoding of any HF causal LM).
- `worker`: `GenerationWorker`, a Ray actor holding a model and an engine.
- `interface`: `GenerationInterface` (ABC) and `Generation`, the controller-side handle that
  shards batches over data-parallel generation workers and receives refits.
"""

from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.generation.sampling import process_logits, sample

__all__ = ["NativeGenerationEngine", "process_logits", "sample"]
