"""Router replay with vLLM (`router_replay.from_vllm`, `moe_layer_indices`): vLLM's per-request
routed experts become the native engine's `ROUTED_EXPERTS` layout (exact values), the CPU recorder
(`vllm_routing.py`) files each forward's experts by request and position, and the vLLM worker
returns them with its outputs (a fake `LLM` stands in for vLLM, which this environment lacks)."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from posttrain.config import load_config
from posttrain.distributed.batch import Batch
from posttrain.models import router_replay
from posttrain.models.generation import vllm_routing
from posttrain.models.generation.vllm_worker import VllmGenerationWorker


def test_from_vllm_puts_each_fed_tokens_experts_at_its_output_column():
    # Two requests, 3 decoder layers of which 0 and 2 route, top-2: prompt 2 + 3 generated (4 fed),
    # prompt 3 + 1 generated (3 fed). Values: 100 * request + 10 * token + layer, expert pair (v, v + 1).
    def experts(request: int, fed: int) -> np.ndarray:
        values = np.array([[100 * request + 10 * t + layer for layer in range(3)] for t in range(fed)], dtype=np.uint16)
        return np.stack([values, values + 1], axis=-1)

    out = router_replay.from_vllm([experts(0, 4), experts(1, 3)], torch.tensor([2, 3]), torch.tensor([3, 1]),
                                  width=6, moe_layers=[0, 2])
    assert out.dtype == torch.int16 and out.shape == (2, 6, 2, 2)
    assert out[0, :4].tolist() == [[[10 * t, 10 * t + 1], [10 * t + 2, 10 * t + 3]] for t in range(4)]
    assert out[1, :3].tolist() == [[[100 + 10 * t, 101 + 10 * t], [102 + 10 * t, 103 + 10 * t]] for t in range(3)]
    assert (out[0, 4:] == -1).all() and (out[1, 3:] == -1).all()  # the last generated token and padding
    with pytest.raises(ValueError, match=r"shape \(3, 3, 2\) for a request of 4 fed tokens"):
        router_replay.from_vllm([experts(0, 3)], torch.tensor([2]), torch.tensor([3]), width=6, moe_layers=[0])
    with pytest.raises(ValueError, match="shape None"):
        router_replay.from_vllm([None], torch.tensor([2]), torch.tensor([3]), width=6, moe_layers=[0])


def test_moe_layer_indices():
    assert router_replay.moe_layer_indices({"num_hidden_layers": 3}) == [0, 1, 2]  # Mixtral
    assert router_replay.moe_layer_indices(
        {"num_hidden_layers": 6, "mlp_only_layers": [3], "decoder_sparse_step": 2}) == [1, 5]  # Qwen3-MoE
    assert router_replay.moe_layer_indices(
        {"num_hidden_layers": 5, "first_k_dense_replace": 1, "moe_layer_freq": 1}) == [1, 2, 3, 4]  # DeepSeek-V3


class FakeLLM:
    """vLLM's `LLM` for prompts of token ids: each request generates 2 tokens; `collective_rpc`
    (`vllm_routing.take_routing`) reports every fed token t of layer l routed to experts (t, l),
    under the engine's own request ids."""

    def __init__(self) -> None:
        self.fed: dict[str, int] = {}

    def generate(self, prompts, sampling, use_tqdm=False):
        results = []
        for i, prompt in enumerate(prompts):
            self.fed[f"{i}-1a2b3c4d"] = len(prompt["prompt_token_ids"]) + 1
            completion = SimpleNamespace(token_ids=[5, 6], logprobs=[{5: SimpleNamespace(logprob=-1.0)},
                                                                    {6: SimpleNamespace(logprob=-2.0)}],
                                         finish_reason="length")
            results.append(SimpleNamespace(request_id=str(i), outputs=[completion]))
        return results

    def collective_rpc(self, method, args=()):
        assert method is vllm_routing.take_routing and args == (2,)
        taken, self.fed = self.fed, {}
        return [{request: np.array([[[t, layer] for layer in range(2)] for t in range(fed)], dtype=np.int16)
                 for request, fed in taken.items()}]


def test_the_vllm_worker_returns_the_routed_experts_with_its_outputs(monkeypatch):
    from posttrain.config.schema import GenerationConfig

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kwargs: kwargs))
    worker = VllmGenerationWorker.__new__(VllmGenerationWorker)  # no engine: the fake stands in
    worker.llm, worker._asleep, worker.image_token_id, worker.max_model_len = FakeLLM(), [], None, 64
    worker.config, worker.tokenizer = GenerationConfig(max_new_tokens=2), SimpleNamespace(pad_token_id=0)
    worker.moe_layers, worker.num_layers, worker.device = [0, 1], 2, torch.device("cpu")
    out = worker.generate(Batch(input_ids=torch.tensor([[7, 8, 9], [7, 0, 0]]), input_lengths=torch.tensor([3, 1])))
    routed = out[router_replay.ROUTED_EXPERTS]
    assert out["output_ids"].tolist() == [[7, 8, 9, 5, 6], [7, 5, 6, 0, 0]]
    assert routed.shape == (2, 5, 2, 2)
    assert routed[0, :4, 0].tolist() == [[t, 0] for t in range(4)] and routed[1, :2, 1].tolist() == [[0, 1], [1, 1]]
    assert (routed[0, 4:] == -1).all() and (routed[1, 2:] == -1).all()


def test_vllm_routing_files_each_forwards_experts_by_request_and_position():
    # Forward 1: request a's prompt (positions 0-2) and b's (0-1); forward 2: one decode token each,
    # b first (the runner reorders its batch). Layers 0 and 2 of 3 route; expert ids = 10 * token + layer.
    records: dict = {}
    step = {layer: np.array([[10 * t + layer, 0] for t in range(5)], dtype=np.int32) for layer in (0, 2)}
    positions = torch.tensor([0, 1, 2, 0, 1, 9])  # the runner's buffer: rewritten by its next step
    vllm_routing.file_step(records, step, ["a-1", "b-1"], np.array([0, 3, 5]), positions)
    positions.fill_(7)
    step = {layer: np.array([[50 + layer, 1], [60 + layer, 1]], dtype=np.int32) for layer in (0, 2)}
    vllm_routing.file_step(records, step, ["b-1", "a-1"], np.array([0, 1, 2]), torch.tensor([2, 3]))
    worker = SimpleNamespace(model_runner=SimpleNamespace(**{vllm_routing.ATTRIBUTE: {"records": records}}))
    taken = vllm_routing.take_routing(worker, num_layers=3)
    assert taken["a-1"].dtype == np.int16 and taken["a-1"].shape == (4, 3, 2)
    assert taken["a-1"][:, 0].tolist() == [[0, 0], [10, 0], [20, 0], [60, 1]]
    assert taken["a-1"][:, 2].tolist() == [[2, 0], [12, 0], [22, 0], [62, 1]]
    assert (taken["a-1"][:, 1] == -1).all()  # a dense layer
    assert taken["b-1"][:, 0].tolist() == [[30, 0], [40, 0], [50, 1]]
    assert worker.model_runner._posttrain_routing["records"] == {}  # taken once


def test_router_replay_with_vllm_is_accepted():
    cfg = load_config("grpo", overrides=["sft_warmup=null", "policy.model_name=tiny-qwen3_moe",
                                         "policy.moe_router_replay=true", "policy.generation.backend=vllm"])
    assert cfg.policy.moe_router_replay
