import math

import pytest
import torch

from posttrain.config.schema import OptimizerConfig, SchedulerConfig
from posttrain.utils.lr_schedule import build_lr_scheduler, lr_at_step


def test_warmup_then_constant():
    # 10% of lr at step 0, +22.5% per step over 4 warm-up steps, then flat.
    values = [lr_at_step(s, lr=1.0, name="constant", warmup_steps=4) for s in range(7)]
    assert values == pytest.approx([0.1, 0.325, 0.55, 0.775, 1.0, 1.0, 1.0])


def test_no_warmup_constant_ignores_min_lr():
    assert lr_at_step(0, lr=2e-5, min_lr=1e-6) == 2e-5
    assert lr_at_step(1000, lr=2e-5, min_lr=1e-6) == 2e-5


def test_linear_decay_to_min_lr():
    # warm-up 2 steps, then 1.0 -> 0.2 over steps 2..6, then held at 0.2.
    values = [lr_at_step(s, lr=1.0, min_lr=0.2, name="linear", warmup_steps=2, total_steps=6) for s in range(8)]
    assert values == pytest.approx([0.1, 0.55, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2])


def test_cosine_decay_to_min_lr():
    values = [lr_at_step(s, lr=1.0, min_lr=0.0, name="cosine", total_steps=4) for s in range(6)]
    expected = [0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(5)] + [0.0]
    assert values == pytest.approx(expected)
    assert values[2] == pytest.approx(0.5)


def test_decay_needs_total_steps():
    with pytest.raises(ValueError, match="policy.scheduler.total_steps is required"):
        lr_at_step(3, lr=1.0, name="cosine")
    with pytest.raises(ValueError, match="must exceed"):
        lr_at_step(6, lr=1.0, name="linear", warmup_steps=5, total_steps=5)
    with pytest.raises(ValueError, match="unknown"):
        lr_at_step(0, lr=1.0, name="step")


def test_lambda_scheduler_follows_lr_at_step_and_round_trips():
    param = torch.nn.Parameter(torch.zeros(1))
    opt_cfg = OptimizerConfig(lr=0.5, min_lr=0.05)
    sched_cfg = SchedulerConfig(name="linear", warmup_steps=1, total_steps=3)
    opt = torch.optim.AdamW([param], lr=opt_cfg.lr)
    sched = build_lr_scheduler(opt, opt_cfg, sched_cfg)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.05, 0.5, 0.275, 0.05])

    opt2 = torch.optim.AdamW([param], lr=opt_cfg.lr)
    sched2 = build_lr_scheduler(opt2, opt_cfg, sched_cfg)
    sched2.load_state_dict(sched.state_dict())
    opt2.param_groups[0]["lr"] = sched2.get_last_lr()[0]
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.05)

    with pytest.raises(ValueError, match="total_steps is required"):
        build_lr_scheduler(opt, opt_cfg, SchedulerConfig(name="cosine"))


def test_a_decay_shape_plugs_in_by_registration_or_import_path(tmp_path):
    from posttrain.utils.lr_schedule import DECAYS, register_decay

    @register_decay("step_halfway")
    def step_halfway(progress):  # full lr for the first half, min_lr after
        return 0.0 if progress < 0.5 else 1.0

    try:
        assert lr_at_step(4, lr=1.0, min_lr=0.1, name="step_halfway", total_steps=10) == 1.0
        assert lr_at_step(6, lr=1.0, min_lr=0.1, name="step_halfway", total_steps=10) == pytest.approx(0.1)
        with pytest.raises(ValueError, match="already registered"):
            register_decay("step_halfway")(lambda p: p)
    finally:
        DECAYS.pop("step_halfway")
    (tmp_path / "my_decay.py").write_text("def squared(progress):\n    return progress ** 2\n")
    assert lr_at_step(5, lr=1.0, name=f"{tmp_path}/my_decay.py:squared", total_steps=10) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="unknown LR decay 'cosin'.*did you mean 'cosine'"):
        lr_at_step(5, lr=1.0, name="cosin", total_steps=10)


def test_preflight_names_a_bad_decay_path_before_workers_start(tmp_path):
    from posttrain.config import load_config
    from posttrain.errors import UserError
    from posttrain.preflight import check_components

    with pytest.raises(UserError, match=r"policy.scheduler.name: .*no_such_file.py"):
        check_components(load_config("sft", overrides=[f"policy.scheduler.name={tmp_path}/no_such_file.py:fn"]))
    with pytest.raises(UserError, match="policy.scheduler.name: unknown LR decay 'cosin'"):
        check_components(load_config("sft", overrides=["policy.scheduler.name=cosin"]))
