"""Idle threads give their GNU OpenMP team back (`posttrain.utils.openmp`), so that the thread still
computing is not throttled by teams that wait: a local actor's thread after its last queued call,
and a thread that waits on a local future."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Counts this process's threads (/proc/self/task) at each point; an OpenMP team of 2 is 1 extra thread.
PROBE = """
import json, os, threading, time
import posttrain
import torch
from posttrain.distributed import actors
from posttrain.utils.openmp import release_thread_team

def threads():
    return len(os.listdir("/proc/self/task"))

def settle(target, deadline_s=60.0):
    # A released team's threads end on their own schedule: wait for the count, never race a clock.
    end = time.monotonic() + deadline_s
    while threads() > target and time.monotonic() < end:
        time.sleep(0.01)
    return threads()

def parallel_work():
    torch.set_num_threads(2)
    return float(torch.randn(4_000_000).exp().sum())

out = {"before_torch_work": release_thread_team()}
done = threading.Event()
def own_thread():
    parallel_work()
    with_team = threads()
    out["released"] = release_thread_team()
    out["threads_ended"] = with_team - settle(with_team - 1)
    done.set()
worker = threading.Thread(target=own_thread)
worker.start(); done.wait(); worker.join()

class Worker:
    def work(self):
        parallel_work()
        return threads()  # with this thread's team
actor = actors.LocalActor(Worker, name="probe")
with_team = actors.get(actor.work.remote())
out["actor_threads_ended"] = with_team - settle(with_team - 1)
actor.kill()
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2,
                    reason="GNU OpenMP teams of 2 threads, counted in /proc")
def test_idle_threads_give_their_openmp_team_back():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["before_torch_work"] in (True, False)
    if not out["released"]:
        pytest.skip("torch's OpenMP here is not GNU OpenMP with omp_pause_resource_all")
    assert out["threads_ended"] >= 1, "releasing the team did not end its worker thread"
    assert out["actor_threads_ended"] >= 1, "a local actor kept its OpenMP team after its last call"


def test_release_is_a_no_op_before_torch_is_loaded():
    code = "from posttrain.utils.openmp import release_thread_team; import sys; print(release_thread_team(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
