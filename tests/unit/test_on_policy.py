"""The run-level pieces the on-policy algorithms share (`algorithms/on_policy.py`): distillation
samples a `data.blend` by its weights and releases the run-directory lock when it ends, as GRPO does."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from posttrain.algorithms import distill
from posttrain.config.loader import load_config
from posttrain.data.sample import Sample
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


def _cfg(tmp_path):
    return load_config("distill", overrides=[f"logger.log_dir={tmp_path}/logs",
                                               f"checkpointing.checkpoint_dir={tmp_path}/ckpt"])


def test_distillation_blend_samples_its_weights(tmp_path, monkeypatch):
    rows = [Sample(message_log=[], prompt_length=1, task_name="math", source="math", source_weight=3.0) for _ in range(40)] + \
           [Sample(message_log=[], prompt_length=1, task_name="mc", source="mc", source_weight=1.0) for _ in range(40)]
    cfg = _cfg(tmp_path)
    monkeypatch.setattr(distill, "start_run", lambda c, **kw: (c, SimpleNamespace(pad_token_id=0)))
    monkeypatch.setattr(distill, "build_splits", lambda *a: (rows, []))
    monkeypatch.setattr(distill, "make_cluster", lambda *a, **kw: _Part())
    monkeypatch.setattr(distill, "make_policy", lambda *a, **kw: _Part())
    monkeypatch.setattr(distill, "make_generation", lambda *a, **kw: _Part())
    monkeypatch.setattr(distill, "make_envs", lambda *a: {})
    monkeypatch.setattr(distill, "build_refit_metadata", lambda *a, **kw: None)
    monkeypatch.setattr(distill, "TrainingLoop", _Loop)
    monkeypatch.setattr("posttrain.algorithms.distill_loss.DistillationLoss", lambda **kw: None)
    ctx = distill.setup(cfg)
    drawn = Counter(s.task_name for _ in range(100) for s in ctx.train_loader.next_batch())
    total = sum(drawn.values())
    assert 0.7 < drawn["math"] / total < 0.8  # 3:1, not the rows' 1:1
    assert ctx.loop.loader is ctx.train_loader  # the loop checkpoints the blend's position


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
