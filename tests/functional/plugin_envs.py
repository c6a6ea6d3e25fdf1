"""Environments the functional tests plug in the way users do, by `env.math.class_path=<this
file>:<Class>` (each runs in the environment's Ray actor): rewards with variance for an
untrained model, and ones that misbehave on purpose."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import torch

from posttrain.environments.interface import EnvironmentReturn
from posttrain.environments.math_env import MathEnvConfig, MathEnvironment


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


class StragglerConfig(MathEnvConfig):
    release_when: str = ""  # the file whose creation ends the straggler's wait


class StragglerEnv(MathEnvironment):
    """The third call answers only once the file `release_when` exists: a straggler, not a hang.

    The test creates the file once the collector has dropped the straggler's batch, so the call
    misses its batch's deadline however fast or slow the machine is, and the next batch's call,
    queued behind it, answers as soon as the drop is seen."""

    config_class = StragglerConfig
    calls = 0

    def step(self, message_logs, metadata):
        StragglerEnv.calls += 1
        if StragglerEnv.calls == 3:
            while not os.path.exists(self.cfg.release_when):
                time.sleep(0.05)
        return super().step(message_logs, metadata)


class HoldAfterCheckpointEnv(MathEnvironment):
    """The math environment, except that once the file `HOLD_AFTER` names exists (a checkpoint's
    last file), its next call waits for as long as the file `HOLD` exists. A test that kills a run
    after that checkpoint then knows where the run is, however slow the machine: no later step
    can finish before the kill. Without the two variables it is the math environment."""

    def step(self, message_logs, metadata):
        hold, after = os.environ.get("HOLD"), os.environ.get("HOLD_AFTER")
        if hold and after and os.path.exists(after):
            while os.path.exists(hold):
                time.sleep(0.1)
        return super().step(message_logs, metadata)


class KillPlanConfig(MathEnvConfig):
    # "N:TARGET[:SIGNAL];...": at call N, send SIGNAL (a name: SEGV, STOP; default KILL) to the
    # process whose id the file TARGET holds, or to "self"; "N:hang": call N never returns; "N:touch:FILE":
    # call N creates FILE (a flag another plugin reads, e.g. `plugin_losses.StallOnceLoss`).
    kill_plan: str = ""
    kill_counter: str = ""  # the file that counts the calls, across restarts of this environment


class KillPlanEnv(MathEnvironment):
    """The math environment, except that it kills, stops or hangs at the calls its `kill_plan`
    names (calls counted in the file `kill_counter`, so they go on counting when it is
    restarted): it signals a worker of the run (a generation or policy worker, idle while the
    environment steps; the test wrote its process id to a file) or itself, in the middle of the
    call, or waits forever (a wedged verifier: alive, beating, making no progress). The run is
    then at a known point whatever the machine's speed."""

    config_class = KillPlanConfig

    def step(self, message_logs, metadata):
        if self.cfg.kill_plan:
            counter = Path(self.cfg.kill_counter)
            call = int(counter.read_text()) + 1 if counter.exists() else 1
            counter.write_text(str(call))
            for entry in self.cfg.kill_plan.split(";"):
                at, target, *how = entry.split(":")
                if int(at) != call:
                    continue
                if target == "hang":
                    threading.Event().wait()
                elif target == "touch":
                    Path(how[0]).touch()
                else:
                    number = getattr(signal, f"SIG{how[0] if how else 'KILL'}")
                    os.kill(os.getpid() if target == "self" else int(Path(target).read_text()), number)
        return super().step(message_logs, metadata)


class CoinEnv(MathEnvironment):
    """Reward 1 when the first generated character is in the first half of the alphabet.

    Prompts with an even answer always score 0 (no reward variance: dynamic sampling must drop
    them); odd ones depend on the sample, so their groups usually carry a learning signal.
    """

    def step(self, message_logs, metadata):
        out = super().step(message_logs, metadata)
        rewards = [0.0 if int(meta["ground_truth"]) % 2 == 0 else float(bool(log[-1]["content"]) and
                                                                           log[-1]["content"][0] < "O")
                   for log, meta in zip(message_logs, metadata)]
        return out._replace(rewards=out.rewards.new_tensor(rewards))


class NaNAfterFirstCallEnv(CoinEnv):
    """A reward function that breaks: every reward after its first call is NaN."""

    calls = 0

    def step(self, message_logs, metadata):
        NaNAfterFirstCallEnv.calls += 1
        out = super().step(message_logs, metadata)
        if NaNAfterFirstCallEnv.calls > 1:
            out = out._replace(rewards=out.rewards.new_full(out.rewards.shape, float("nan")))
        return out


class ThreeTurnEnv(MathEnvironment):
    """Multi-turn, its state in the sample's metadata (`turns_seen`): the first two answers get an
    observation (never trained on) and the episode goes on; the third ends it, rewarded like
    `CoinEnv` (its first character in the first half of the alphabet, for odd answers)."""

    OBSERVATION = "<|user|>again<|end|><|assistant|>"

    def step(self, message_logs, metadata):
        seen = [int(meta.get("turns_seen", 0)) + 1 for meta in metadata]
        if any(sum(m["role"] == "assistant" for m in log) != k for log, k in zip(message_logs, seen)):
            raise AssertionError("the conversation and its metadata disagree on the turn")
        rewards = [float(k >= 3 and int(meta["ground_truth"]) % 2 == 1 and bool(log[-1]["content"])
                         and log[-1]["content"][0] < "O") for log, meta, k in zip(message_logs, metadata, seen)]
        n = len(message_logs)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": self.OBSERVATION if k < 3 else ""} for k in seen],
            metadata=[{**meta, "turns_seen": k} for meta, k in zip(metadata, seen)], next_stop_strings=[None] * n,
            rewards=torch.tensor(rewards), terminateds=torch.tensor([k >= 3 for k in seen]), answers=[None] * n,
        )
