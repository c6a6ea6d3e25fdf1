"""CheckpointManager: layout, atomic finalize, top-k retention, crash leftovers."""

import json
import os

import pytest

from posttrain.config.schema import CheckpointingConfig
from posttrain.utils.checkpoint import CheckpointManager, load_training_info


def make_manager(tmp_path, **overrides):
    return CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt"), **overrides))


def save(manager, step, accuracy=None, payload="weights"):
    path = manager.begin(step)
    (path / "policy").mkdir()
    (path / "policy" / "model.bin").write_text(f"{payload}-{step}")
    metrics = {} if accuracy is None else {"validation/accuracy": accuracy}
    return manager.finalize(step, path, metrics=metrics, training_info={"consumed_samples": 16 * step})


def steps_on_disk(manager):
    return sorted(int(p.name.split("_")[-1]) for p in manager.checkpoint_dir.iterdir() if p.name.startswith("step_"))


def test_layout_and_training_info(tmp_path):
    manager = make_manager(tmp_path)
    tmp = manager.begin(5)
    assert tmp == tmp_path / "ckpt" / "tmp_step_5" and tmp.is_dir() and not any(tmp.iterdir())
    (tmp / "config.yaml").write_text("grpo: {}\n")
    final = manager.finalize(5, tmp, metrics={"validation/accuracy": 0.5}, training_info={"consumed_samples": 80})
    assert final == tmp_path / "ckpt" / "step_5"
    assert not tmp.exists()
    assert (final / "config.yaml").read_text() == "grpo: {}\n"
    info = load_training_info(final)
    assert info == {"consumed_samples": 80, "step": 5, "metrics": {"validation/accuracy": 0.5}}
    assert manager.load_training_info(final) == info
    assert manager.latest() == final and manager.best() == final
    with pytest.raises(FileNotFoundError, match="not a finalized checkpoint"):
        load_training_info(tmp_path)


def test_top_k_by_metric_keeps_latest(tmp_path):
    manager = make_manager(tmp_path, keep_top_k=2, higher_is_better=True)
    accuracies = {1: 0.5, 2: 0.9, 3: 0.7, 4: 0.9, 5: 0.1}
    for step, accuracy in accuracies.items():
        save(manager, step, accuracy)
    # Best two: step 4 (0.9, newer of the tie) and step 2 (0.9); step 5 survives as the latest.
    assert steps_on_disk(manager) == [2, 4, 5]
    assert manager.best().name == "step_4"
    assert manager.latest().name == "step_5"
    save(manager, 6, 0.8)
    assert steps_on_disk(manager) == [2, 4, 6]  # 5 is no longer the latest and not top-2


def test_lower_is_better_and_missing_metric_ranks_last(tmp_path):
    manager = make_manager(tmp_path, keep_top_k=2, metric_name="validation/loss", higher_is_better=False)
    for step, loss in [(1, 0.3), (2, None), (3, 0.2), (4, 0.5)]:
        path = manager.begin(step)
        metrics = {} if loss is None else {"validation/loss": loss}
        manager.finalize(step, path, metrics=metrics)
    # Top-2 by lowest loss: 3 (0.2), 1 (0.3); 4 kept as the latest; 2 (no metric) pruned.
    assert steps_on_disk(manager) == [1, 3, 4]
    assert manager.best().name == "step_3"


def test_no_metric_keeps_most_recent_and_none_keeps_all(tmp_path):
    recent = make_manager(tmp_path / "a", keep_top_k=2, metric_name=None)
    for step in range(1, 5):
        save(recent, step, accuracy=1.0 - step / 10)
    assert steps_on_disk(recent) == [3, 4]
    keep_all = make_manager(tmp_path / "b", keep_top_k=None)
    for step in range(1, 5):
        save(keep_all, step)
    assert steps_on_disk(keep_all) == [1, 2, 3, 4]


def test_crash_between_begin_and_finalize(tmp_path):
    manager = make_manager(tmp_path)
    save(manager, 10, 0.5)
    partial = manager.begin(20)
    (partial / "policy").mkdir()
    (partial / "policy" / "model.bin").write_text("half written")
    # The process dies here. A new run's manager sees only the complete checkpoint...
    restarted = make_manager(tmp_path)
    assert restarted.latest() == tmp_path / "ckpt" / "step_10"
    assert (restarted.latest() / "policy" / "model.bin").read_text() == "weights-10"
    assert not partial.exists()  # ...and the leftover is cleaned up.
    # A step directory without training_info.json (copied by hand, half-deleted) is not complete.
    (tmp_path / "ckpt" / "step_30").mkdir()
    assert restarted.latest().name == "step_10"


def test_latest_does_not_remove_a_save_in_progress(tmp_path):
    manager = make_manager(tmp_path)
    save(manager, 1)
    tmp = manager.begin(2)
    assert manager.latest().name == "step_1"
    assert tmp.is_dir()
    assert manager.finalize(2, tmp).name == "step_2"


def test_resaving_a_step_swaps_atomically(tmp_path):
    manager = make_manager(tmp_path)
    save(manager, 3, payload="first")
    save(manager, 3, payload="second")
    assert steps_on_disk(manager) == [3]
    assert (manager.latest() / "policy" / "model.bin").read_text() == "second-3"
    assert sorted(p.name for p in manager.checkpoint_dir.iterdir()) == ["step_3"]


def test_crash_mid_swap_restores_the_old_checkpoint(tmp_path):
    manager = make_manager(tmp_path)
    save(manager, 3, payload="first")
    tmp = manager.begin(3)
    # The process died after step_3 -> old_step_3 but before tmp_step_3 -> step_3.
    os.rename(manager.checkpoint_dir / "step_3", manager.checkpoint_dir / "old_step_3")
    restarted = make_manager(tmp_path)
    assert restarted.latest() == manager.checkpoint_dir / "step_3"
    assert (restarted.latest() / "policy" / "model.bin").read_text() == "first-3"
    assert not tmp.exists() and not (manager.checkpoint_dir / "old_step_3").exists()


def test_should_save_and_finalize_without_begin(tmp_path):
    manager = make_manager(tmp_path, save_period=5)
    assert [s for s in range(1, 13) if manager.should_save(s, is_last_step=(s == 12))] == [5, 10, 12]
    assert not make_manager(tmp_path, enabled=False).should_save(5)
    with pytest.raises(FileNotFoundError, match=r"call begin\(7\) first"):
        manager.finalize(7, tmp_path / "nope")
    assert manager.latest() is None and manager.best() is None


def test_training_info_is_json(tmp_path):
    manager = make_manager(tmp_path)
    final = save(manager, 2, 0.25)
    assert json.loads((final / "training_info.json").read_text())["consumed_samples"] == 32


def test_validation_accuracy_ranks_by_the_accuracy_the_run_logs(tmp_path):
    """metric_name `validation/accuracy` (the default) stands for `validation/accuracy_greedy` or
    `_sampled` in runs that log those names."""
    manager = make_manager(tmp_path, keep_top_k=1)
    for step, accuracy in [(1, 0.2), (2, 0.9), (3, 0.4)]:
        path = manager.begin(step)
        manager.finalize(step, path, metrics={"validation/accuracy_sampled": accuracy})
    assert steps_on_disk(manager) == [2, 3] and manager.best().name == "step_2"
