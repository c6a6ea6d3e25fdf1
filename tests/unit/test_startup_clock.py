"""The start-up clock: phases from marks, nested jobs ignored, one report per process."""

import time

import pytest

from posttrain.utils.startup import StartupClock, process_start_time, summary_line


@pytest.fixture(autouse=True)
def no_install_time(monkeypatch):
    """Under `./run.sh pytest` right after an install, the suite inherits run.sh's real install time;
    these clocks start at 1000.0, so only the tests that set one see one."""
    monkeypatch.delenv("POSTTRAIN_INSTALL_DONE_AT", raising=False)


def clock_with_marks(monkeypatch, marks: list[tuple[str, float]], now: float) -> dict:
    """A clock started at 1000.0 whose phases end at the given offsets; its report at `now`
    with a first step of 1 s."""
    clock = StartupClock(start=1000.0)
    for phase, at in marks:
        monkeypatch.setattr(time, "time", lambda at=at: 1000.0 + at)
        clock.mark(phase)
    monkeypatch.setattr(time, "time", lambda: 1000.0 + now)
    return clock.report(first_step_seconds=1.0)


def test_phases_are_the_gaps_between_marks(monkeypatch):
    phases = clock_with_marks(monkeypatch, [("config", 0.5), ("imports", 2.0), ("workers", 3.5)], now=5.0)
    assert phases["config"] == pytest.approx(0.5)
    assert phases["imports"] == pytest.approx(1.5)
    assert phases["workers"] == pytest.approx(1.5)
    assert phases["to_first_step"] == pytest.approx(4.0)  # now minus the first step
    assert phases["other"] == pytest.approx(0.5)  # 3.5 .. 4.0: nothing marked it
    assert phases["first_step"] == 1.0


def test_validation_at_start_is_its_own_phase_and_other_adds_up(monkeypatch):
    # The loop marks "other" before validating at step 0 and "validation" after it.
    marks = [("config", 1.0), ("other", 1.5), ("validation", 31.5)]
    phases = clock_with_marks(monkeypatch, marks, now=33.0)
    assert phases["validation"] == pytest.approx(30.0)
    assert phases["other"] == pytest.approx(0.5 + 0.5)  # before and after validation
    assert phases["to_first_step"] == pytest.approx(32.0)
    assert "validation 30.0" in summary_line(phases)


def test_a_phase_marked_twice_adds_up(monkeypatch):
    phases = clock_with_marks(monkeypatch, [("data", 1.0), ("workers", 3.0), ("data", 4.0)], now=5.0)
    assert phases["data"] == pytest.approx(2.0)
    assert phases["workers"] == pytest.approx(2.0)


def test_nested_jobs_neither_mark_nor_report_and_only_the_first_report_counts(monkeypatch):
    clock = StartupClock(start=1000.0)
    monkeypatch.setattr(time, "time", lambda: 1002.0)
    with clock.nested():
        clock.mark("config")  # the warm start's own job: ignored
        assert clock.report(first_step_seconds=0.1) is None
    clock.mark("warm_start")
    monkeypatch.setattr(time, "time", lambda: 1003.0)
    phases = clock.report(first_step_seconds=0.5)
    assert list(phases)[:1] == ["warm_start"] and "config" not in phases
    assert phases["warm_start"] == pytest.approx(2.0)
    assert clock.report(first_step_seconds=0.5) is None
    clock.mark("late")  # after the report: ignored
    assert clock.marks == [("warm_start", pytest.approx(2.0))]


def test_process_start_is_in_the_past():
    assert 0 <= time.time() - process_start_time() < 24 * 3600


def test_run_sh_install_is_its_own_phase_not_config(monkeypatch):
    # run.sh installed the environment for 60 s, then exec'd the job in the same process.
    monkeypatch.setenv("POSTTRAIN_INSTALL_DONE_AT", "1060.0")
    phases = clock_with_marks(monkeypatch, [("config", 60.3), ("workers", 61.0)], now=63.0)
    assert phases["install"] == pytest.approx(60.0)
    assert phases["config"] == pytest.approx(0.3)
    assert list(phases)[0] == "install"
    assert "install 60.0, config 0.3" in summary_line(phases)


@pytest.mark.parametrize("value", ["999.0", "not-a-time", ""])
def test_install_time_of_another_process_or_garbage_is_ignored(monkeypatch, value):
    # An inherited value from before this process started (a shell opened by `run.sh bash`).
    monkeypatch.setenv("POSTTRAIN_INSTALL_DONE_AT", value)
    phases = clock_with_marks(monkeypatch, [("config", 0.5)], now=2.0)
    assert "install" not in phases
    assert phases["config"] == pytest.approx(0.5)
