"""Baselines the benchmarks measure posttrain against; not part of the library.

- `HFGenerateBaseline`: Hugging Face `model.generate` on the same inputs as the native engine.
- `naive_put_state_dict` / `naive_load_state_dict`: refit by one `ray.put` / `ray.get` per tensor,
  the per-tensor transfer that packed refit replaces.
"""

from __future__ import annotations

from typing import Mapping, Optional

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch

from posttrain.models.generation.engine import right_to_left_padding


class HFGenerateBaseline:
    """Hugging Face `model.generate` with the same inputs, as `benchmarks/generation_vs_hf.py` runs it.

    Returns the generated token ids `[B, T]` (left-padded prompts are stripped); no logprobs.
    """

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int, eos_token_id: Optional[int | list[int]]):
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        input_lengths: torch.Tensor,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: Optional[int] = None,
        greedy: bool = False,
    ) -> torch.Tensor:
        ids, attention_mask, _ = right_to_left_padding(input_ids, input_lengths, self.pad_token_id)
        sampling = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": top_k or 0}
        out = self.model.generate(
            input_ids=ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_id,
            **sampling,
        )
        return out[:, ids.shape[1] :]


def naive_put_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict:
    """One `ray.put` per tensor: the per-tensor transfer that packing replaces (benchmark only)."""
    import ray

    return {name: ray.put(t.detach().cpu()) for name, t in state_dict.items()}


@torch.no_grad()
def naive_load_state_dict(model: torch.nn.Module, refs: Mapping[str, object]) -> None:
    """One `ray.get` per tensor, then copy into the model (benchmark only)."""
    import ray

    own = model.state_dict()
    for name, ref in refs.items():
        own[name].copy_(ray.get(ref))
