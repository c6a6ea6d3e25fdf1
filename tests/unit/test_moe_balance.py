"""Expert load metrics and the auxiliary-loss-free bias update (models/moe_balance.py), on hand-built
loads and a hand-built routing of the tiny DeepSeek-V3 preset; the preflight's refusals of MoE options."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from posttrain.config.schema import PolicyConfig
from posttrain.errors import UserError
from posttrain.models import moe_balance, tiny
from posttrain.preflight import check_router_balancing


def test_load_metrics_of_known_loads():
    # Layer 0 balanced (max/mean 1, entropy 1); layer 1 all on one expert (max/mean 4 = E, entropy 0).
    metrics = moe_balance.load_metrics(torch.tensor([[4.0, 4, 4, 4], [8, 0, 0, 0]]))
    assert metrics == {"moe/expert_load_max_over_mean": 2.5, "moe/expert_load_entropy": 0.5}
    skewed = moe_balance.load_metrics(torch.tensor([[6.0, 2, 0, 0]]))
    assert skewed["moe/expert_load_max_over_mean"] == 3.0  # 6 / mean 2
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(4)
    assert skewed["moe/expert_load_entropy"] == pytest.approx(expected, abs=1e-12)
    # A layer that routed nothing is left out; nothing at all gives no metrics.
    assert moe_balance.load_metrics(torch.tensor([[6.0, 2, 0, 0], [0, 0, 0, 0]])) == skewed
    assert moe_balance.load_metrics(torch.zeros(2, 4)) == {}


def test_top_k_indices_of_a_router_that_returns_logits_only():
    logits = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.2, 0.3]])
    indices = moe_balance._top_k_indices(logits, SimpleNamespace(index=0), top_k=2)
    assert indices.tolist() == [[1, 2], [0, 2]]
    chosen = torch.tensor([[2, 0], [1, 0]])  # a (logits, weights, indices) router: its own choice is read
    assert moe_balance._top_k_indices((logits, logits[:, :2], chosen), SimpleNamespace(index=0), 2) is chosen


@pytest.fixture()
def pinned_deepseek():
    """The tiny DeepSeek-V3 with its one MoE router pinned: zero weights make every score
    sigmoid(0) = 0.5, and the bias makes group 2 (experts 4-7: top-2 sum 1.3 against 1.0) the chosen
    group and experts 5 and 4 its top 2, for every token."""
    model, _ = tiny.make_tiny_model("tiny", "deepseek_v3", seed=0)
    (router,) = moe_balance.routers(model)
    with torch.no_grad():
        router.weight.zero_()
        router.e_score_correction_bias.copy_(torch.tensor([0, 0, 0, 0, 0.1, 0.2, 0, 0]))
    return model.eval(), router


def test_recorded_loads_of_a_pinned_routing_count_real_tokens_only(pinned_deepseek):
    model, _ = pinned_deepseek
    assert list(moe_balance.balance_biases(model)) == ["model.layers.1.mlp.gate.e_score_correction_bias"]
    loads = moe_balance.new_loads(model)
    assert loads.counts.shape == (1, 8)  # layer 0 is dense (first_k_dense_replace=1)
    ids = torch.randint(7, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    for _ in range(2):  # two micro-batches of 8 real tokens each
        with torch.no_grad(), moe_balance.record_expert_choices(model, loads):
            model(input_ids=ids, attention_mask=mask)
        loads.add(mask)
    assert loads.counts.tolist() == [[0, 0, 0, 0, 16, 16, 0, 0]]
    assert moe_balance.load_metrics(loads.counts) == pytest.approx(
        {"moe/expert_load_max_over_mean": 4.0, "moe/expert_load_entropy": math.log(2) / math.log(8)}, abs=1e-12)
    with moe_balance.record_expert_choices(model, None):  # off: nothing hooked
        assert not any(router._forward_hooks for router in moe_balance.routers(model))
    assert moe_balance.new_loads(tiny.make_tiny_model("tiny", "llama")[0]) is None


def test_bias_update_moves_overloaded_experts_down_and_underloaded_up(pinned_deepseek):
    model, router = pinned_deepseek
    before = router.e_score_correction_bias.clone()
    counts = torch.tensor([[0.0, 0, 0, 0, 16, 16, 0, 0]])  # mean 4: experts 4 and 5 overloaded
    assert moe_balance.update_balance_biases(model, counts, rate=0.001) == 1
    step = torch.tensor([0.001, 0.001, 0.001, 0.001, -0.001, -0.001, 0.001, 0.001])
    assert torch.equal(router.e_score_correction_bias, before + step)
    # An expert exactly at the mean keeps its bias; a layer that routed nothing is left alone.
    moe_balance.update_balance_biases(model, torch.tensor([[3.0, 1, 2, 2, 2, 2, 2, 2]]), rate=0.5)
    assert torch.equal(router.e_score_correction_bias, before + step + torch.tensor([-0.5, 0.5, 0, 0, 0, 0, 0, 0]))
    assert moe_balance.update_balance_biases(model, torch.zeros(1, 8), rate=0.5) == 0


def test_repeated_updates_spread_a_pinned_routing_over_the_experts(pinned_deepseek):
    """The loop DeepSeek-V3 runs: record the loads, move the bias, route again. The pinned routing
    (all tokens on 2 of 8 experts) spreads out as the bias overtakes the pinning."""
    model, _ = pinned_deepseek
    ids = torch.randint(7, 100, (4, 8), generator=torch.Generator().manual_seed(1))
    router = moe_balance.routers(model)[0]
    with torch.no_grad():  # scores that differ per token, so the balanced choice is not one pair of experts,
        router.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
        router.e_score_correction_bias.mul_(10)  # pinned harder than the scores differ (sigmoid: under 1)
    history = []
    for _ in range(40):
        loads = moe_balance.new_loads(model)
        with torch.no_grad(), moe_balance.record_expert_choices(model, loads):
            model(input_ids=ids)
        loads.add(None)
        history.append(moe_balance.load_metrics(loads.counts)["moe/expert_load_max_over_mean"])
        moe_balance.update_balance_biases(model, loads.counts, rate=0.05)
    assert history[0] == 4.0 and max(history[-10:]) < 1.8  # measured: 4.0 for 6 steps, then 1.25-1.625


def test_preflight_refuses_moe_options_the_model_cannot_take():
    with pytest.raises(UserError, match=r"^policy.moe_router_bias_update_rate=0.001: policy.model_name='tiny-mixtral' "
                                         r"\(mixtral\) has no router balancing bias"):
        check_router_balancing(PolicyConfig(model_name="tiny-mixtral", moe_router_bias_update_rate=0.001))
    with pytest.raises(UserError, match=r"^policy.router_aux_loss_coef=0.01: policy.model_name='tiny' \(deepseek_v3\) "
                                         r"has no load-balancing loss"):
        check_router_balancing(PolicyConfig(tiny_arch="deepseek_v3", router_aux_loss_coef=0.01))
    with pytest.raises(UserError, match=r"^policy.tensor_parallel_size=2: .* multi-head latent attention"):
        check_router_balancing(PolicyConfig(model_name="tiny-deepseek_v3", num_workers=2, tensor_parallel_size=2,
                                            train_global_batch_size=8))
    from posttrain.models.policy import parallel

    with pytest.raises(ValueError, match=r"deepseek_v3's multi-head latent attention has no tensor-parallel plan"):
        parallel.tp_plan(tiny.make_tiny_model("tiny", "deepseek_v3")[0])  # a model given by path, not caught above
    check_router_balancing(PolicyConfig(model_name="tiny-deepseek_v3", moe_router_bias_update_rate=0.001))
    check_router_balancing(PolicyConfig(model_name="tiny-qwen3_moe", router_aux_loss_coef=0.02))


def test_a_training_step_logs_the_loads_moves_the_bias_and_keeps_the_reference_bias(monkeypatch):
    """One worker in this thread, as the local backend runs it (no process group): the step's
    metrics are those of the loads its forward routed, the bias moved by +-rate after the step, and
    reference logprobs still use the initial (zero) bias, which is restored in the live model afterwards."""
    from posttrain.distributed import actors

    monkeypatch.setattr(actors._identity, "values", {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, raising=False)
    from posttrain.algorithms.loss import NLLLoss
    from posttrain.distributed.batch import Batch
    from posttrain.models.policy.worker import PolicyWorker

    worker = PolicyWorker(dict(model_name="tiny-deepseek_v3", train_global_batch_size=4, train_micro_batch_size=2,
                               moe_router_bias_update_rate=0.01), init_reference_model=True)
    ids = torch.randint(7, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([12, 9, 7, 12])
    batch = Batch(input_ids=ids, input_lengths=lengths, sample_mask=torch.ones(4),
                  token_mask=(torch.arange(12)[None] < lengths[:, None]).float())
    reference_before = worker.get_reference_logprobs(batch)["logprobs"]
    loads = moe_balance.new_loads(worker.model)  # what the step's forward routes (its weights as they are now)
    for rows in (slice(0, 2), slice(2, 4)):
        with torch.no_grad(), moe_balance.record_expert_choices(worker.model, loads):
            worker.model(input_ids=ids[rows, :int(lengths[rows].max())])
        loads.add((torch.arange(int(lengths[rows].max()))[None] < lengths[rows, None]).long())
    assert loads.counts.sum() == 2 * 40  # 40 real tokens, top-2

    metrics = worker.train(batch, NLLLoss())
    assert {k: metrics[k] for k in ("moe/expert_load_max_over_mean", "moe/expert_load_entropy")} == pytest.approx(
        moe_balance.load_metrics(loads.counts), abs=1e-12)
    bias = moe_balance.balance_biases(worker.model)["model.layers.1.mlp.gate.e_score_correction_bias"]
    mean = loads.counts[0].mean()
    assert torch.equal(bias, (torch.sign(mean - loads.counts[0]) * 0.01).float())
    assert torch.equal(worker.get_reference_logprobs(batch)["logprobs"], reference_before)
    assert torch.equal(moe_balance.balance_biases(worker.model)[
        "model.layers.1.mlp.gate.e_score_correction_bias"], bias)  # the live bias is back
