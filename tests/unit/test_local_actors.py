"""The local backend's actors (`posttrain.distributed.actors`): Ray's actor semantics in one process,
and the backend choice (`cluster.backend`)."""

import threading
import time

import pytest

from posttrain.config import load_config
from posttrain.config.loader import ConfigError
from posttrain.config.schema import local_backend_problem, resolve_backend
from posttrain.distributed import actors


class Counter:
    def __init__(self, start=0, fail=False):
        if fail:
            raise ValueError("constructor refused")
        self.value = start
        self.thread = threading.current_thread().name
        self.identity = actors.worker_identity()

    def add(self, amount, delay=0.0):
        time.sleep(delay)
        self.value += amount
        return self.value

    def hold(self, started, release):
        """Stay in this call until `release` is set (a call in progress, for as long as a test needs)."""
        started.set()
        release.wait(600)
        return "held"

    def explode(self):
        raise KeyError("boom")

    def where(self):
        return self.thread, threading.current_thread().name, self.identity


def test_calls_run_one_at_a_time_in_call_order_on_the_actors_thread():
    actor = actors.LocalActor(Counter, kwargs={"start": 10}, name="counter", identity={"RANK": "0"})
    refs = [actor.add.remote(1, delay=0.02), actor.add.remote(2), actor.add.remote(3)]
    assert actors.get(refs) == [11, 13, 16]  # the slow first call still comes first
    built_on, called_on, identity = actors.get(actor.where.remote())
    assert built_on == called_on == "posttrain-counter" != threading.current_thread().name
    assert identity == {"RANK": "0"} and actors.worker_identity() is None  # the caller has none
    actor.kill()


def test_an_exception_comes_back_from_its_call_and_the_actor_lives_on():
    actor = actors.LocalActor(Counter)
    with pytest.raises(KeyError, match="boom"):
        actors.get(actor.explode.remote())
    assert actors.get(actor.add.remote(5)) == 5
    actor.kill()


def test_a_failed_constructor_fails_every_call_with_its_error():
    actor = actors.LocalActor(Counter, kwargs={"fail": True})
    with pytest.raises(actors.LocalActorDiedError, match="constructor refused") as caught:
        actors.get(actor.add.remote(1))
    assert actors.is_actor_death(caught.value) and isinstance(caught.value.__cause__, ValueError)


def test_kill_fails_queued_and_later_calls():
    actor = actors.LocalActor(Counter)
    started, release = threading.Event(), threading.Event()
    running = actor.hold.remote(started, release)
    queued = actor.add.remote(1)
    assert started.wait(60)
    actor.kill(wait_s=0)
    release.set()
    assert actors.get(running) == "held"  # a call in progress cannot be interrupted
    for ref in (queued, actor.add.remote(1)):
        with pytest.raises(actors.LocalActorDiedError, match="was killed"):
            actors.get(ref)


def test_wait_and_get_time_out_like_rays():
    actor = actors.LocalActor(Counter)
    started, release = threading.Event(), threading.Event()
    slow = actor.hold.remote(started, release)  # in progress until released, however slow the machine
    ready, waiting = actors.wait([slow], num_returns=1, timeout=0.05)
    assert ready == [] and waiting == [slow]
    with pytest.raises(actors.GetTimeoutError) as caught:
        actors.get(slow, timeout=0.05)
    assert actors.is_get_timeout(caught.value)
    fast = actor.add.remote(1)  # queued behind the held call
    release.set()
    ready, waiting = actors.wait([fast, slow], num_returns=2, timeout=120)
    assert ready == [fast, slow] and waiting == [] and actors.get(fast) == 1 and actors.get(slow) == "held"
    actor.kill()


def test_a_future_passed_as_an_argument_is_resolved_first():
    source, sink = actors.LocalActor(Counter, kwargs={"start": 1}), actors.LocalActor(Counter)
    assert actors.get(sink.add.remote(source.add.remote(4, delay=0.05))) == 5
    source.kill(), sink.kill()


def test_mixing_local_and_ray_futures_is_refused():
    ref = actors.LocalActor(Counter).add.remote(1)
    with pytest.raises(TypeError, match="local and Ray"):
        actors.wait([ref, object()])


# ----------------------------------------------------------------------------- backend choice
@pytest.mark.parametrize("overrides, backend", [
    ([], "local"),                                                       # the default job: one process
    (["cluster.backend=ray"], "ray"),
    (["policy.num_workers=2", "policy.train_global_batch_size=128"], "ray"),  # two ranks: Ray
    (["cluster.gpus_per_node=1"], "ray"),                                # auto sends GPU jobs to Ray
    (["cluster.backend=local", "cluster.gpus_per_node=1"], "local"),     # ... unless asked
    (["cluster.ray_address=auto"], "ray"),
    (["policy.generation.backend=vllm"], "ray"),
    (["policy.generation.colocated.enabled=false", "policy.generation.colocated.num_workers=2"], "ray"),
])
def test_auto_picks_local_only_for_jobs_that_fit_one_process(overrides, backend):
    assert resolve_backend(load_config("grpo", overrides=overrides)) == backend


def test_async_grpo_goes_to_ray():
    cfg = load_config("grpo", config_path="examples/configs/grpo_async_tiny.yaml")
    assert local_backend_problem(cfg) == "grpo.async_grpo.enabled overlaps generation and training"
    assert resolve_backend(cfg) == "ray"


def test_asking_local_for_what_it_cannot_run_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"cluster.backend=local: policy.num_workers=2: a local worker group has one "
                                          r"worker; use cluster.backend=ray"):
        load_config("grpo", overrides=["cluster.backend=local", "policy.num_workers=2"])


def test_a_process_that_stops_its_actors_and_exits_at_once_exits_cleanly(tmp_path):
    """An actor's last call left many tensors to free; the process kills it and exits straight away.
    The actor frees them on its own thread before the interpreter shuts down (ended mid-free, the
    thread's C++ frames would abort the process: exit code 134)."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(
        "import torch\n"
        "from posttrain.distributed import actors\n"
        "class Holder:\n"
        "    def take(self, tensors):\n"
        "        return len(tensors)\n"
        "actor = actors.LocalActor(Holder)\n"
        "print(actors.get(actor.take.remote([torch.ones(1000) for _ in range(20000)])))\n"
        "actor.kill()\n"
    )
    for _ in range(2):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stdout.strip()) == (0, "20000"), done.stderr[-2000:]


def test_getting_no_refs_returns_at_once_without_ray():
    """An empty list of results (every environment of a launch missed its deadline) is empty under
    either backend: `ray.get([])` would start a Ray instance in a local-backend run."""
    import sys

    had_ray = "ray" in sys.modules
    assert actors.get([]) == [] and actors.get(()) == []
    assert ("ray" in sys.modules) == had_ray
