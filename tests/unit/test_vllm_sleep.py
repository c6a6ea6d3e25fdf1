"""vLLM sleeps while the policy trains and wakes in stages: weights, then the refit, then the KV
cache (`VllmGenerationWorker`, against vLLM's `LLM.sleep(level)` / `LLM.wake_up(tags)`), checked
with a fake engine that records its calls: no vLLM needed."""

from __future__ import annotations

import numpy as np
import torch

from posttrain.models.generation.vllm_worker import VllmGenerationWorker


class FakeLLM:
    """Records the calls of vLLM's `LLM` API that the worker's memory phases make."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tuple(tags) if tags is not None else None))

    def collective_rpc(self, method: str, args=()) -> list[int]:
        self.calls.append(("collective_rpc", method))
        return [1]

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))


def fake_worker(device: str = "cuda") -> VllmGenerationWorker:
    worker = VllmGenerationWorker.__new__(VllmGenerationWorker)  # no engine: the fake stands in
    worker.llm, worker.device = FakeLLM(), torch.device(device)
    worker.refit_metadata, worker.weights_version, worker._asleep = object(), 0, []
    return worker


def test_sleep_then_refit_wakes_weights_first_and_the_kv_cache_at_generation():
    worker = fake_worker()
    worker.prepare_for_generation()  # awake from the start: nothing to wake
    worker.finish_generation(offload=True)  # the policy trains
    worker.finish_generation(offload=True)  # idempotent
    worker.load_bucket(np.zeros(8, dtype=np.uint8), 0)
    worker.load_bucket(np.zeros(8, dtype=np.uint8), 1)
    worker.finish_refit(1)
    worker.prepare_for_generation()
    assert worker.llm.calls == [
        ("sleep", 1),
        ("wake_up", ("weights",)),  # the refit's stage: the KV cache stays asleep while weights load
        ("collective_rpc", "posttrain_load_bucket"),
        ("collective_rpc", "posttrain_load_bucket"),
        ("reset_prefix_cache",),
        ("wake_up", ("kv_cache",)),  # generation begins
    ]


def test_an_ipc_refit_wakes_the_weights_only():
    worker = fake_worker()
    worker.finish_generation(offload=True)
    worker.load_bucket_ipc({"gpu-0": []}, 0)
    assert worker.llm.calls == [("sleep", 1), ("wake_up", ("weights",)), ("collective_rpc", "posttrain_load_ipc")]
    assert worker._asleep == ["kv_cache"]


def test_without_a_refit_generation_wakes_weights_then_kv_cache():
    worker = fake_worker()
    worker.finish_generation(offload=True)
    worker.prepare_for_generation()
    worker.prepare_for_generation()
    assert worker.llm.calls == [("sleep", 1), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]


def test_on_cpu_or_without_offload_the_engine_never_sleeps():
    for worker, offload in ((fake_worker("cpu"), True), (fake_worker("cuda"), False)):
        worker.finish_generation(offload=offload)
        worker.prepare_for_generation()
        assert worker.llm.calls == []
