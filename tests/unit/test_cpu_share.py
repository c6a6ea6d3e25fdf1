"""The local backend's thread count on a CPU that other processes use too (posttrain/utils/cpu_share.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from posttrain.distributed.actors import LocalActor
from posttrain.utils import cpu_share
from posttrain.utils.cpu_share import CpuShare, busy_seconds, threads_for

TICKS = os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("max_threads, num_cpus, others, expected", [
    (2, 2, 0.0, 2),   # quiet
    (2, 2, 0.2, 2),   # daemons, a log flush
    (2, 2, 0.8, 1),   # one core mostly taken
    (2, 2, 2.0, 1),   # a busy loop on each core: never fewer than one
    (8, 8, 3.0, 5),
    (4, 8, 0.0, 4),   # never more than configured
])
def test_one_thread_per_core_the_others_leave_free(max_threads, num_cpus, others, expected):
    assert threads_for(max_threads, num_cpus, others) == expected


def stat(*cpus: tuple[int, ...]) -> str:
    """`/proc/stat` text with an aggregate line and per-CPU lines of (user nice system idle iowait irq softirq steal)."""
    total = [sum(column) for column in zip(*cpus)]
    lines = ["cpu  " + " ".join(map(str, total)) + " 0 0"]
    lines += [f"cpu{i} " + " ".join(map(str, fields)) + " 0 0" for i, fields in enumerate(cpus)]
    return "\n".join(lines + ["intr 1 2 3", "ctxt 99"]) + "\n"


def test_busy_seconds_count_this_processs_cpus_only_and_steal_as_busy():
    text = stat((100, 10, 20, 500, 7, 1, 2, 3), (1000, 0, 0, 0, 0, 0, 0, 0), (50, 0, 0, 0, 0, 0, 0, 0))
    assert busy_seconds(text, {0}, TICKS) == pytest.approx((100 + 10 + 20 + 1 + 2 + 3) / TICKS)  # idle, iowait left out
    assert busy_seconds(text, {0, 2}, TICKS) == pytest.approx((136 + 50) / TICKS)


def test_the_others_load_is_the_cpus_busy_time_minus_this_processs_own_averaged_over_samples():
    state = {"now": 0.0, "busy": [0, 0], "own": 0.0}

    def read_stat() -> str:
        return stat(*((ticks, 0, 0, 0, 0, 0, 0, 0) for ticks in state["busy"]))

    share = CpuShare(2, cpus={0, 1}, read_stat=read_stat, own_cpu_s=lambda: state["own"], clock=lambda: state["now"])

    def second(others_s: float, own_s: float) -> int:
        """One wall second in which the others and this process used that much CPU, spread over both cores."""
        state["now"] += 1.0
        state["own"] += own_s
        per_cpu = round((others_s + own_s) * TICKS / 2)
        state["busy"] = [ticks + per_cpu for ticks in state["busy"]]
        return share.sample()

    assert second(others_s=0.0, own_s=2.0) == 2 and share.others_cores == pytest.approx(0.0)  # our own work is not the others'
    assert second(others_s=2.0, own_s=0.0) == 1 and share.others_cores == pytest.approx(1.0)  # two busy loops start
    assert second(others_s=2.0, own_s=0.0) == 1 and share.others_cores == pytest.approx(1.5)
    # They stop: the count comes back once the average has let go of them.
    assert [second(others_s=0.0, own_s=1.0) for _ in range(4)] == [1, 1, 2, 2]


@pytest.mark.parametrize("adapt", [False, True])
def test_the_process_says_once_what_adapting_does_or_would_do(adapt, capsys, monkeypatch):
    monkeypatch.setattr(cpu_share, "_said", set())
    for _ in range(2):  # a warm start's sampler, then the main run's
        state = {"now": 0.0, "busy": 0}
        share = CpuShare(2, adapt=adapt, cpus={0, 1}, read_stat=lambda: stat((state["busy"], 0, 0, 0, 0, 0, 0, 0)),
                         own_cpu_s=lambda: 0.0, clock=lambda: state["now"])
        for _ in range(10):  # a busy loop on each core, 10 s
            state["now"] += 1.0
            state["busy"] += 2 * TICKS
            assert share.sample() == 1 and share.threads == (1 if adapt else 2)
    lines = capsys.readouterr().err.splitlines()
    said = "computing with 1 of 2 threads while they do" if adapt else "cluster.adapt_threads_to_load=true would compute with 1"
    assert len(lines) == 1 and said in lines[0], lines


class ThreadCount:
    def get(self) -> int:
        return torch.get_num_threads()


def test_a_local_worker_computes_with_the_samplers_count_on_its_own_thread(monkeypatch):
    class Share:
        threads = 1

    monkeypatch.setattr(cpu_share, "_share", Share())
    main_threads = torch.get_num_threads()
    actor = LocalActor(ThreadCount, name="threads")
    try:
        assert actor.get.remote().future.result(timeout=60) == 1
        Share.threads = 3
        assert actor.get.remote().future.result(timeout=60) == 3
    finally:
        actor.kill()
        torch.set_num_threads(main_threads)  # the worker's set_num_threads also moved torch's default


@pytest.mark.skipif(not 2 <= len(os.sched_getaffinity(0)) <= 4, reason="needs 2-4 CPUs (one busy loop on each)")
def test_beside_a_busy_loop_on_every_core_the_count_drops_to_one():
    share = CpuShare(len(os.sched_getaffinity(0)), adapt=True)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in share.cpus]
    try:
        deadline = time.monotonic() + 120  # a busy machine only adds to the others' load
        while share.sample() != 1:
            assert time.monotonic() < deadline, f"others {share.others_cores:.2f} cores, threads {share.threads}"
            time.sleep(0.5)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.mark.parametrize("overrides, sampling, adapting", [
    ([], True, False),                                          # default: sample, advise, keep the count
    (["cluster.adapt_threads_to_load=true"], True, True),
    (["cluster.adapt_threads_to_load=true", "cluster.cpus_per_worker=1"], False, False),  # the user's count stays
])
def test_a_local_job_samples_the_load_and_adapts_only_when_asked(overrides, sampling, adapting):
    from posttrain.config.loader import load_config
    from posttrain.job import start_backend

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to share")
    main_threads = torch.get_num_threads()
    try:
        start_backend(load_config("grpo", overrides=["cluster.backend=local", *overrides]))
        assert (cpu_share._share is not None) == sampling
        assert sampling is False or cpu_share._share.adapt == adapting
    finally:
        cpu_share.stop_sharing()
        torch.set_num_threads(main_threads)


@pytest.mark.parametrize("fails", [False, True])
def test_the_sampler_ends_with_its_job(tmp_path, monkeypatch, fails):
    """`run_job` (the CLI's and the Python API's) stops the local backend's sampler when the job
    ends, however it ends: no thread reads /proc/stat between jobs."""
    import threading

    import posttrain.cli as cli
    import posttrain.preflight as preflight
    from posttrain.config.loader import load_config
    from posttrain.job import start_backend

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to share")
    main_threads = torch.get_num_threads()
    seen = {}

    def job(cfg):
        start_backend(cfg)
        seen["sampling"] = cpu_share._share is not None
        seen["threads"] = {t.name for t in threading.enumerate()}
        if fails:
            raise RuntimeError("the job failed")

    monkeypatch.setattr(preflight, "preflight", lambda cfg: None)  # the job below needs no model or data
    monkeypatch.setattr(cli, "load_target", lambda module, attr, command: job)
    cfg = load_config("grpo", overrides=["cluster.backend=local", f"logger.log_dir={tmp_path}/logs",
                                         f"checkpointing.checkpoint_dir={tmp_path}/ckpt"])
    try:
        if fails:
            with pytest.raises(RuntimeError, match="the job failed"):
                cli.run_job("grpo", cfg)
        else:
            cli.run_job("grpo", cfg)
        assert seen["sampling"] and "posttrain-cpu-share" in seen["threads"]
        assert cpu_share._share is None
        deadline = time.monotonic() + 60  # the thread ends at its next wake-up (a second)
        while any(t.name == "posttrain-cpu-share" for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the sampler's thread is still running"
            time.sleep(0.1)
    finally:
        cpu_share.stop_sharing()
        torch.set_num_threads(main_threads)
