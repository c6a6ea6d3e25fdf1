"""The run-level pieces the on-policy algorithms share (`algorithms/on_policy.py`): distillation
samples a `data.blend` by its weights and releases the run-directory lock when it ends, as GRPO does."""

from __future__ import annotations

from collections import Counter

import pytest

from posttrain.algorithms import distill, grpo, on_policy
from posttrain.config.loader import load_config
from posttrain.utils.run_dirs import LOCK_FILE, lock_run_dirs


class _Part:
    def __init__(self):
        self.shut = False

    def shutdown(self):
        self.shut = True

    def refit_info(self):
        return {}

    def refit_bucket_bytes(self):
        return 2**20

    def weight_dtypes(self):
        return None

    def prepare_refit_info(self, metadata):
        pass


class _Loop:
    closed = False

    def __init__(self, *args, loader=None, **kwargs):
        self.loader = loader

    def resume(self):
        return False

    def close(self):
        self.closed = True


def _cfg(tmp_path, algorithm="distill", *overrides):
    return load_config(algorithm, overrides=[f"logger.log_dir={tmp_path}/logs",
                                             f"checkpointing.checkpoint_dir={tmp_path}/ckpt", *overrides])


@pytest.mark.parametrize("algorithm", ["distill", "grpo"])
def test_a_distillation_blend_samples_its_weights(algorithm, tmp_path, monkeypatch):
    """`data.blend` of two equally large sources weighted 0.8 / 0.2: the run's prompts come 4:1 from
    them (a plain loader over the rows would give 1:1), in distillation as in GRPO, which share
    `on_policy.build_on_policy_run`. Data and tokenizer are real; no worker starts."""
    from posttrain.models.tiny import build_tokenizer

    setup = {"distill": distill.setup, "grpo": grpo.setup}[algorithm]
    blend = ("data.blend=[{name: easy, env: math, weight: 0.8, num_train: 40, num_validation: 2}, "
             "{name: hard, env: math, weight: 0.2, num_train: 40, num_validation: 2}]")
    cfg = _cfg(tmp_path, algorithm, blend)
    tokenizer = build_tokenizer()
    monkeypatch.setattr(on_policy, "start_run", lambda c, **kw: (c, tokenizer))
    monkeypatch.setattr(on_policy, "make_cluster", lambda *a, **kw: _Part())
    monkeypatch.setattr(on_policy, "make_policy", lambda *a, **kw: _Part())
    monkeypatch.setattr(on_policy, "make_generation", lambda *a, **kw: _Part())
    monkeypatch.setattr(on_policy, "make_envs", lambda *a: {})
    monkeypatch.setattr(on_policy, "TrainingLoop", _Loop)
    ctx = setup(cfg)
    assert {s.task_name for s in ctx.val_samples} == {"easy", "hard"}
    drawn = Counter(s.task_name for _ in range(100) for s in ctx.train_loader.next_batch())
    total = sum(drawn.values())
    assert total >= 1600
    assert 0.75 < drawn["easy"] / total < 0.85, drawn  # 4:1, not the rows' 1:1
    assert ctx.loop.loader is ctx.train_loader  # the loop checkpoints the blend's position
    if algorithm == "distill":
        assert isinstance(ctx.teacher, _Part) and ctx.workers() == (ctx.generation, ctx.teacher, ctx.policy)
        assert ctx.teacher_cluster in ctx.clusters


def test_distillation_shutdown_releases_the_run_directory_lock(tmp_path):
    cfg = _cfg(tmp_path)
    locks = lock_run_dirs(cfg)
    assert all(lock.exists() for lock in locks) and len(locks) == 2
    parts = [_Part() for _ in range(4)]
    loop = _Loop()
    ctx = distill.DistillContext(
        cfg=cfg, policy=parts[0], generation=parts[1], teacher=parts[2], envs={}, tokenizer=None,
        train_loader=None, val_samples=[], loop=loop, loss_fn=None, refit_metadata=None,
        teacher_cluster=parts[3], clusters=[parts[3]],
    )
    ctx.shutdown()
    assert all(p.shut for p in parts) and loop.closed
    assert not any((tmp_path / d / LOCK_FILE).exists() for d in ("logs", "ckpt"))
