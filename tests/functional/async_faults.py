"""Environments for the async GRPO tests: ones that misbehave on purpose (loaded by
`env.math.class_path=<this file>:<Class>` in the environment's Ray actor)."""

from __future__ import annotations

import os
import time

from posttrain.environments.math_env import MathEnvironment


class CrashingEnv(MathEnvironment):
    """Raises on its third call (a bug in a user's environment)."""

    calls = 0

    def step(self, message_logs, metadata):
        CrashingEnv.calls += 1
        if CrashingEnv.calls == 3:
            raise RuntimeError("verifier exploded on purpose")
        return super().step(message_logs, metadata)


class StuckEnv(MathEnvironment):
    """Answers its first two calls, then never again (a wedged verifier)."""

    calls = 0

    def step(self, message_logs, metadata):
        StuckEnv.calls += 1
        if StuckEnv.calls > 2:
            time.sleep(3600)
        return super().step(message_logs, metadata)


class StragglerEnv(MathEnvironment):
    """Every fourth call takes `STRAGGLER_SECONDS` (default 4) longer: a straggler, not a hang."""

    calls = 0

    def step(self, message_logs, metadata):
        StragglerEnv.calls += 1
        if StragglerEnv.calls % 4 == 3:
            time.sleep(float(os.environ.get("STRAGGLER_SECONDS", "4")))
        return super().step(message_logs, metadata)


class CoinEnv(MathEnvironment):
    """Reward 1 when the answer starts with a letter before "O": rewards vary within a group even
    for an untrained model, so every step moves the policy."""

    def step(self, message_logs, metadata):
        out = super().step(message_logs, metadata)
        rewards = [float(bool(log[-1]["content"]) and log[-1]["content"][0] < "O") for log in message_logs]
        return out._replace(rewards=out.rewards.new_tensor(rewards))
