"""A custom environment, loss and advantage estimator, plugged into `posttrain grpo` by config
alone (see grpo_custom.yaml beside this file):  posttrain grpo --config grpo_custom.yaml"""

import torch
from pydantic import BaseModel, ConfigDict

from posttrain.algorithms.loss import ClippedPGLoss
from posttrain.environments.interface import Environment, EnvironmentReturn


class ParityConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo in env.parity.* fails at start-up
    partial_credit: float = 0.0  # reward for an answer with the right parity but the wrong value


class ParityEnv(Environment):
    """Reward 1 for the exact answer, `partial_credit` for an answer of the right parity."""

    config_class = ParityConfig

    def __init__(self, cfg: ParityConfig):
        self.cfg = cfg

    def step(self, message_logs, metadata):
        rewards, answers = [], []
        for log, meta in zip(message_logs, metadata):
            words = log[-1]["content"].split()
            answer = words[-1] if words else ""
            truth = str(meta["ground_truth"])
            if answer == truth:
                rewards.append(1.0)
            elif answer.isdigit() and int(answer) % 2 == int(truth) % 2:
                rewards.append(self.cfg.partial_credit)
            else:
                rewards.append(0.0)
            answers.append(answer or None)
        n = len(message_logs)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": ""}] * n, metadata=list(metadata),
            next_stop_strings=[None] * n, rewards=torch.tensor(rewards),
            terminateds=torch.ones(n, dtype=torch.bool), answers=answers,
        )


class ScaledPGLoss(ClippedPGLoss):
    """The clipped policy-gradient loss times a constant, with its own metric."""

    def __init__(self, scale: float = 1.0, **loss_fn_keys):
        super().__init__(**loss_fn_keys)
        self.scale = scale

    def __call__(self, logprobs, batch, global_valid_seqs, global_valid_toks):
        loss, metrics = super().__call__(logprobs, batch, global_valid_seqs, global_valid_toks)
        return self.scale * loss, {**metrics, "loss_scale": self.scale}


def shifted_group_mean(rewards, group_ids, sample_mask=None, shift=0.0):
    """Advantage = reward - mean of its group + shift (no std normalisation)."""
    from posttrain.algorithms.advantages import group_mean

    return rewards - group_mean(rewards, group_ids, sample_mask)[group_ids] + shift
