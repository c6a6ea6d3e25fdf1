"""The shared registry decorator behind losses, advantage estimators, packers and processors."""

import pytest

from posttrain.algorithms.advantages import ADVANTAGE_ESTIMATORS, register_advantage_estimator
from posttrain.algorithms.loss import LOSS_REGISTRY, ClippedPGLoss, register_loss
from posttrain.data.packing import PACKERS
from posttrain.data.processors import PROCESSORS, build_prompt_message_log
from posttrain.utils.registry import registrar


def test_register_returns_the_object_and_refuses_a_second_entry_of_a_name():
    things: dict = {}
    register = registrar(things, "widget")

    @register("a")
    def a():
        return 1

    assert things == {"a": a} and a() == 1
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        register("a")(lambda: 2)
    assert things["a"] is a


def test_built_in_registries():
    assert LOSS_REGISTRY["clipped_pg"] is ClippedPGLoss
    assert PROCESSORS["math"] is build_prompt_message_log
    assert "grpo" in ADVANTAGE_ESTIMATORS and PACKERS
    with pytest.raises(ValueError, match="loss 'clipped_pg' is already registered"):
        register_loss("clipped_pg")(object)
    with pytest.raises(ValueError, match="advantage estimator 'grpo' is already registered"):
        register_advantage_estimator("grpo")(lambda: None)
