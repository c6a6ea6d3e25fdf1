"""The entropy bonus (`loss_fn.entropy_coef`) and its adaptive coefficient (`loss_fn.adaptive_entropy`):
the sampled estimate's value and gradient against the exact entropy, the loss's gradient by hand,
the controller's steps, and its state through a checkpoint and a resume."""

import json

import pytest
import torch

from posttrain.algorithms import adaptive_entropy
from posttrain.algorithms.loop import TrainingLoop
from posttrain.algorithms.loss import ClippedPGLoss
from posttrain.algorithms.pg_terms import entropy_surrogate
from posttrain.config import load_config
from posttrain.config.schema import LossConfig
from posttrain.utils.metrics import valid_counts
from test_training_loop import FakeLoader  # the loop's loader stand-in


def test_the_estimate_averaged_over_the_policy_is_the_entropy_and_its_gradient():
    """Sum_y pi(y) * surrogate(y): value H(pi) and gradient dH/dtheta exactly (tokens drawn from pi)."""
    theta = torch.tensor([0.3, -1.2, 2.0, 0.5], requires_grad=True)
    logp = torch.log_softmax(theta, -1)
    exact = -(logp.exp() * logp).sum()
    (exact_grad,) = torch.autograd.grad(exact, theta, retain_graph=True)
    estimate = (logp.exp().detach() * entropy_surrogate(logp, logp.detach())).sum()
    (estimate_grad,) = torch.autograd.grad(estimate, theta)
    assert estimate.item() == pytest.approx(exact.item(), rel=1e-6)
    assert estimate_grad.tolist() == pytest.approx(exact_grad.tolist(), rel=1e-5, abs=1e-7)


def test_tokens_from_another_generator_are_importance_weighted():
    logp, gen = torch.tensor([-0.5, -2.0], requires_grad=True), torch.tensor([-1.0, -1.5])
    value = entropy_surrogate(logp, gen)
    value.sum().backward()
    rho = (logp.detach() - gen).exp()
    assert value.tolist() == pytest.approx((-rho * logp.detach()).tolist())
    assert logp.grad.tolist() == pytest.approx((-rho * logp.detach()).tolist())


def bonus_batch():
    logprobs = torch.tensor([[0.0, -0.5, -2.0, -1.0], [0.0, -0.2, -3.0, 0.0]], requires_grad=True)
    batch = {"token_mask": torch.tensor([[0.0, 1, 1, 1], [0.0, 1, 1, 0]]), "sample_mask": torch.ones(2),
             "advantages": torch.tensor([[0.0, 1, 1, 1], [0.0, -1, -1, 0]]),
             "generation_logprobs": torch.tensor([[0.0, -0.7, -2.0, -1.0], [0.0, -0.2, -2.5, 0.0]])}
    return logprobs, batch


@pytest.mark.parametrize("preset", ["grpo", "dapo"])
def test_loss_subtracts_coef_times_the_token_mean_entropy(preset):
    """loss = policy loss - c * mean_t(-rho_t logp_t) over the step's 5 tokens, for either aggregation;
    d/dlogp_t of the bonus term is c * rho_t * logp_t / 5."""
    c = 0.1
    results = {}
    for coef in (0.0, c):
        logprobs, batch = bonus_batch()
        loss, metrics = ClippedPGLoss(LossConfig(preset=preset, entropy_coef=coef))(logprobs, batch,
                                                                                     *valid_counts(batch))
        loss.backward()
        results[coef] = (loss.item(), logprobs.grad.clone(), metrics)
    logp = torch.tensor([[-0.5, -2.0, -1.0], [-0.2, -3.0, 0.0]])
    gen = torch.tensor([[-0.7, -2.0, -1.0], [-0.2, -2.5, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    rho = (logp - gen).exp() * mask
    entropy = (-rho * logp).sum().item() / 5
    assert results[c][2]["approx_entropy"] == pytest.approx(entropy, rel=1e-6)  # the logged entropy
    assert results[c][0] == pytest.approx(results[0.0][0] - c * entropy, rel=1e-6)
    extra = (results[c][1] - results[0.0][1])[:, 1:]
    assert extra.flatten().tolist() == pytest.approx((c * rho * logp / 5).flatten().tolist(), rel=1e-5, abs=1e-8)


ADAPTIVE = LossConfig(entropy_coef=0.01, adaptive_entropy=True, entropy_target=0.2, entropy_coef_delta=0.005,
                      entropy_coef_max=0.012)


def test_adaptive_coefficient_steps_toward_the_target():
    """TRL's controller: nothing before a measurement; +delta (capped) at or below the target and
    applied; -delta above it and not applied."""
    state: dict = {}
    applied = [adaptive_entropy.applied_coefficient(ADAPTIVE, state)]
    for entropy in (0.1, 0.3, 0.2, 0.5, 0.5, 0.5, 0.05):
        adaptive_entropy.update(ADAPTIVE, state, entropy)
        applied.append(adaptive_entropy.applied_coefficient(ADAPTIVE, state))
    #        none   0.1->0.012(cap) 0.3->0.007 off  0.2->0.012  0.5->0.007 0.002 0(min)  0.05->0.005
    assert applied == pytest.approx([0.0, 0.012, 0.0, 0.012, 0.0, 0.0, 0.0, 0.005])
    assert json.loads(json.dumps(state)) == state  # a checkpoint's JSON holds it as it is
    fixed = LossConfig(entropy_coef=0.03)
    adaptive_entropy.update(fixed, state, 0.0)
    assert adaptive_entropy.applied_coefficient(fixed, {}) == 0.03


def test_bad_entropy_keys_fail_in_one_line():
    with pytest.raises(ValueError, match="loss_fn.entropy_coef_min=0.5 is greater than loss_fn.entropy_coef_max=0.1"):
        LossConfig(entropy_coef_min=0.5, entropy_coef_max=0.1)
    with pytest.raises(ValueError, match="loss_fn.entropy_coef is a key of the clipped_pg loss"):
        LossConfig(name="my_module:MyLoss", entropy_coef=0.1)


class FakePolicy:
    def save_checkpoint(self, path, save_optimizer=True):
        path.mkdir(parents=True)

    def load_checkpoint(self, path):
        pass


def test_adaptive_state_is_checkpointed_and_resumed(tmp_path):
    """Three steps with a checkpoint at step 2, then a new loop resumes from it: the coefficient goes
    on from the checkpoint's state, as in a run that never stopped."""
    entropies = {1: 0.1, 2: 0.1, 3: 0.3, 4: 0.1}

    def loop_for(steps):
        cfg = load_config("sft", overrides=[
            f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
            "logger.tensorboard_enabled=false", "logger.progress_bar=false", "logger.report=false",
            f"sft.max_num_steps={steps}", "sft.val_period=0", "sft.val_at_start=false", "sft.val_at_end=false",
            "checkpointing.save_period=2"])
        return TrainingLoop(cfg, cfg.sft, name="SFT", section="sft", policy=FakePolicy(), loader=FakeLoader())

    loss_fn = ClippedPGLoss(ADAPTIVE)
    applied = {}

    def step_fn(loop):
        def step(step, timer):
            metrics = adaptive_entropy.train_with_entropy_bonus(
                ADAPTIVE, loop.state, loss_fn, lambda: {"approx_entropy": entropies[step]})
            applied[step] = metrics["entropy_coef"]
            return {}
        return step

    first = loop_for(2)
    first.run(step_fn(first), lambda: {})
    first.close()
    assert first.state == {"adaptive_entropy": {"coef": 0.012, "last_entropy": 0.1}}

    resumed = loop_for(4)
    assert resumed.resume() and resumed.state == first.state
    resumed.run(step_fn(resumed), lambda: {})
    resumed.close()
    assert applied == pytest.approx({1: 0.0, 2: 0.012, 3: 0.012, 4: 0.0})
    assert resumed.state["adaptive_entropy"] == pytest.approx({"coef": 0.012, "last_entropy": 0.1})
