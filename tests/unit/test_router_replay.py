"""Router replay (`models/router_replay.py`): the gate weights of replayed experts as each router's
own code computes them (exact values), replaying a forward's own choices changes nothing, forced
choices reach the experts while the router keeps its gradient, and the native engine records every
fed token's experts where the trainer's forward of the same rows routes them."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from posttrain.config.schema import PolicyConfig
from posttrain.models import router_replay
from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.tiny import make_tiny_model

SMALL = dict(hidden_size=8, num_experts_per_tok=2)


@pytest.mark.parametrize("router, expected", [
    (Qwen3MoeTopKRouter(Qwen3MoeConfig(num_experts=4, norm_topk_prob=False, **SMALL)), [0.1, 0.4]),
    (Qwen3MoeTopKRouter(Qwen3MoeConfig(num_experts=4, norm_topk_prob=True, **SMALL)), [0.2, 0.8]),
    (MixtralTopKRouter(MixtralConfig(num_local_experts=4, **SMALL)), [0.2, 0.8]),
], ids=["qwen3_moe", "qwen3_moe_normalised", "mixtral"])
def test_softmax_routers_weights_of_replayed_experts(router, expected):
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log()  # softmax probabilities 0.1 .. 0.4
    weights = router_replay.replayed_weights(router, logits, torch.tensor([[0, 3]]), torch.float32)
    torch.testing.assert_close(weights, torch.tensor([expected]))


def test_sigmoid_router_weights_of_replayed_experts():
    config = DeepseekV3Config(n_routed_experts=4, n_group=1, topk_group=1, norm_topk_prob=True,
                              routed_scaling_factor=2.0, **SMALL)
    router = DeepseekV3TopkRouter(config)
    logits = torch.tensor([[0.0, 5.0, -5.0, math.log(3)]])  # sigmoid 0.5 and 0.75 at experts 0 and 3
    weights = router_replay.replayed_weights(router, logits, torch.tensor([[0, 3]]), torch.float32)
    torch.testing.assert_close(weights, torch.tensor([[0.4 * 2.0, 0.6 * 2.0]]))


def forward_routing(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and `[B, S, layers, k]` chosen experts of a plain forward."""
    with router_replay.RoutingRecorder(model) as recorder:
        logits = model(input_ids=ids, attention_mask=mask).logits
        routed = recorder.take()
    return logits, routed.reshape(*ids.shape, *routed.shape[1:])


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_replay_of_own_choices_changes_nothing_and_forced_choices_keep_the_router_gradient(arch):
    model, _ = make_tiny_model("tiny", arch)
    ids = torch.randint(7, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    logits, routed = forward_routing(model, ids, mask)
    with torch.no_grad(), router_replay.replaying(model, routed.flatten(0, 1)):
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, logits)
    forced = torch.full_like(routed, -1)
    forced[:, 2:] = torch.tensor([0, 1])  # every token from position 2 on goes to experts 0 and 1
    with router_replay.replaying(model, forced.flatten(0, 1)):
        replayed, seen = forward_routing(model, ids, mask)
    assert torch.equal(seen[:, :2], routed[:, :2])  # -1: the router's own choice
    assert torch.equal(seen[:, 2:].sort(-1).values, forced[:, 2:].long())
    # Positions 0-1 see only unchanged tokens (causal); the experts' matmuls over other row counts round apart.
    torch.testing.assert_close(replayed[:, :2], logits[:, :2], rtol=0, atol=1e-6)
    assert not torch.allclose(replayed[:, 2:], logits[:, 2:], atol=1e-3)
    replayed.sum().backward()
    router = next(m for m in model.modules() if type(m).__name__.endswith("Router"))
    assert router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("max_running_rows", [None, 2], ids=["one-batch", "two-at-a-time"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_native_engine_records_the_experts_the_trainer_routes_to(arch, max_running_rows):
    """Prompts of three lengths (two rows share one: their prefill is shared), 5 greedy tokens: every
    fed token's record equals a plain forward's choice on the output rows; the last token of each
    row (never fed) and the padding stay -1. qwen3_moe decodes with the llama-like decoder (two rows at
    a time: continuous batching, the last two prefilled into the running batch), deepseek_v3 with the
    model's forward (two rows at a time: in two pieces)."""
    model, tokenizer = make_tiny_model("tiny", arch)
    engine = NativeGenerationEngine(model, tokenizer, pad_token_id=0, eos_token_id=None, record_routing=True)
    prompts = torch.randint(7, 100, (4, 7), generator=torch.Generator().manual_seed(1))
    prompts[3] = prompts[1]
    lengths = torch.tensor([7, 4, 6, 4])
    out = engine.generate(prompts, lengths, max_new_tokens=5, greedy=True, max_running_rows=max_running_rows)
    recorded = out[router_replay.ROUTED_EXPERTS]
    ids, total = out["output_ids"], out["unpadded_sequence_lengths"]
    assert recorded.dtype == torch.int16 and recorded.shape[:2] == ids.shape
    ids, total = ids.clone(), total.clone()  # out of the engine's inference mode
    mask = (torch.arange(ids.shape[1])[None] < total[:, None]).long()
    with torch.no_grad():
        _, routed = forward_routing(model, ids, mask)
    for row in range(ids.shape[0]):
        fed = int(total[row]) - 1
        assert torch.equal(recorded[row, :fed].long().sort(-1).values, routed[row, :fed].sort(-1).values), row
        assert (recorded[row, fed:] == -1).all(), row


def test_router_replay_refusals():
    base = dict(model_name="tiny-qwen3_moe", moe_router_replay=True)
    assert PolicyConfig.model_validate(base).moe_router_replay
    for extra, message in ((dict(sequence_packing=dict(enabled=True)), "sequence_packing"),
                           (dict(batch_invariant=True), "batch_invariant")):
        with pytest.raises(ValueError, match=message):
            PolicyConfig.model_validate(dict(base, **extra))
    with pytest.raises(ValueError, match="speculative"):
        NativeGenerationEngine(make_tiny_model("tiny", "qwen3_moe")[0], pad_token_id=0, eos_token_id=None,
                               record_routing=True, batch_invariant=True)


def test_the_reference_routes_itself_unless_moe_router_replay_reference(monkeypatch):
    """One policy worker in this thread (the local backend's way), before any update (the reference
    weights are the policy's): the policy's logprobs follow the batch's recorded experts; the
    reference's ignore them by default (its own routing: the same logprobs as without a record)
    and follow them with `policy.moe_router_replay_reference=true`."""
    from posttrain.distributed import actors
    from posttrain.distributed.batch import Batch
    from posttrain.models.policy.worker import PolicyWorker

    monkeypatch.setattr(actors._identity, "values", {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, raising=False)
    worker = PolicyWorker(dict(model_name="tiny-qwen3_moe", train_global_batch_size=2, train_micro_batch_size=2,
                               moe_router_replay=True), init_reference_model=True)
    ids = torch.randint(7, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    forced = torch.full((2, 8, 2, 2), -1, dtype=torch.int16)  # 2 MoE layers, top-2
    forced[:, 3:] = torch.tensor([2, 3], dtype=torch.int16)
    plain = Batch(input_ids=ids, input_lengths=torch.tensor([8, 8]))
    replayed = Batch(plain, **{router_replay.ROUTED_EXPERTS: forced})

    own_routes = worker.get_logprobs(plain)["logprobs"]
    forced_routes = worker.get_logprobs(replayed)["logprobs"]
    assert (forced_routes[:, 4:] - own_routes[:, 4:]).abs().max() > 1e-3  # the record changes the policy's
    assert torch.equal(worker.get_reference_logprobs(replayed)["logprobs"], own_routes)
    worker.cfg.moe_router_replay_reference = True
    assert torch.equal(worker.get_reference_logprobs(replayed)["logprobs"], forced_routes)
    with pytest.raises(ValueError, match="moe_router_replay_reference=true needs policy.moe_router_replay=true"):
        PolicyConfig.model_validate(dict(model_name="tiny-qwen3_moe", moe_router_replay_reference=True))
