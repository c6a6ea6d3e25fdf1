"""`posttrain.PPO`: `posttrain ppo` as an object, with GRPO's arguments."""

from __future__ import annotations

from posttrain.api.grpo import GRPO


class PPO(GRPO):
    """PPO with a critic (`posttrain ppo`) on your reward functions and data: `GRPO`'s arguments,
    with the `critic` section in `config` (default None: the embedded `ppo_tiny.yaml`)."""

    command = "ppo"
