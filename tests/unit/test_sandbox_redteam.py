"""Red-team suite of the code sandbox: each attack is contained, fails its test with a reason, and
leaves the host (this process, other processes, files, network) unharmed.

Every attack prints the expected answer first, so a sandbox that let the program finish normally
would score it; a contained attack must fail. Runs in each sandbox mode that works here (bwrap
and, as root, unshare; the rlimits mode as root refuses to run, see runner.py).
"""

from __future__ import annotations

import os
import site
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from posttrain.environments.code_env import CodeEnvConfig, CodeEnvironment
from posttrain.environments.sandbox import Limits, cgroup, memory_enforcement, mode_problem, run_tests
from posttrain.environments.sandbox.runner import _SANDBOX_UID_BASE

MODES = [m for m in ("bwrap", "unshare") if mode_problem(m) is None]
if not MODES:
    pytest.skip("no namespace sandbox (bwrap or unshare as root) works here", allow_module_level=True)

# Generous wall time: these attacks are not about time, and a busy machine may take seconds to start
# a sandbox; the tests that are about time set their own. No test asserts how long anything took.
FAST = Limits(wall_s=20.0, cpu_s=1, memory_bytes=256 * 2**20, processes=16, file_size_bytes=2**20,
              disk_bytes=4 * 2**20, output_bytes=4096)
PATIENT = Limits(wall_s=60.0)  # the default limits, with a wall clock a loaded machine cannot run out of


def sandbox_processes() -> list[int]:
    """Host processes running as a sandbox uid (there must be none after a run)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid >= _SANDBOX_UID_BASE:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def attack(program: str, mode: str, limits: Limits = FAST) -> dict:
    [result] = run_tests(program, [""], limits=limits, mode=mode)
    assert os.getpid() and subprocess.run(["true"]).returncode == 0  # the host can still fork
    deadline = time.monotonic() + 60
    while sandbox_processes() and time.monotonic() < deadline:  # killed processes may take a moment
        time.sleep(0.05)
    assert not sandbox_processes(), "sandbox processes outlived the run"
    assert result["status"] != "ok", result
    return result


@pytest.fixture(params=MODES)
def mode(request):
    return request.param


def test_benign_program_passes(mode):
    [r] = run_tests("print(sum(map(int, input().split())))", ["2 3"], mode=mode)
    assert r["status"] == "ok" and r["stdout"].strip() == "5"


def test_fork_bomb(mode):
    r = attack("print(42, flush=True)\nimport os\nwhile True:\n    os.fork()", mode)
    assert r["reason"] == "process_limit"
    # also when the wall clock runs out first (a busy machine): the refused forks tell
    short = Limits(**{**FAST.__dict__, "wall_s": 1.0})
    assert attack("print(42, flush=True)\nimport os\nwhile True:\n    os.fork()", mode, short)["reason"] == "process_limit"


def test_a_caught_cpu_limit_still_fails(mode):
    # SIGXCPU could be caught: the program prints the answer and exits 0 in its handler
    program = ("import os, signal\ndef handler(*_):\n    print(42, flush=True)\n    os._exit(0)\n"
               "signal.signal(signal.SIGXCPU, handler)\nwhile True: pass\n")
    r = attack(program, mode)
    assert r["reason"] == "cpu_limit", r
    # the CPU of a test's children counts too, even when the parent exits 0 without waiting for them
    program = ("import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        t = time.process_time()\n"
               "        while time.process_time() - t < 0.6: pass\n        os._exit(0)\n"
               "while True:\n    try:\n        os.wait()\n    except ChildProcessError:\n        break\nprint(42)\n")
    r = attack(program, mode)
    assert r["reason"] == "cpu_limit", r


def test_no_nested_namespaces(mode):
    program = (
        "import ctypes, os, threading\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "for name, flag in [('user', 0x10000000), ('net', 0x40000000), ('mount', 0x20000)]:\n"
        "    print(name, libc.unshare(flag), ctypes.get_errno())\n"
        "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
        "pid = os.fork()\nif pid == 0:\n    os._exit(7)\nprint('child', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
    )
    [r] = run_tests(program, [""], limits=FAST, mode=mode)
    assert r["status"] == "ok", r
    assert r["stdout"].split("\n") == ["user -1 1", "net -1 1", "mount -1 1", "thread", "child 7", ""]  # EPERM


def test_many_children_share_one_memory_budget(mode):
    # 8 children of 300 MiB each (touched): under the default limits they cannot all succeed
    program = (
        "import os, time\nkids = []\nfor _ in range(8):\n    pid = os.fork()\n    if pid == 0:\n"
        "        try:\n            x = b'x' * (300 * 2**20)\n            time.sleep(1)\n        except MemoryError:\n"
        "            os._exit(3)\n        os._exit(0)\n    kids.append(pid)\n"
        "print(sum(os.waitpid(pid, 0)[1] == 0 for pid in kids))\n"
    )
    [r] = run_tests(program, [""], limits=PATIENT, mode=mode)
    assert r.get("stdout", "").strip() != "8", r
    if cgroup.available():  # children killed at the sandbox's cap fail the test, though the parent exits 0
        assert r["status"] != "ok" and r["reason"] == "memory", r


def test_without_a_cgroup_each_process_gets_a_share(mode, monkeypatch):
    monkeypatch.setattr(cgroup, "available", lambda: None)
    assert "no cgroup" in memory_enforcement()
    test_many_children_share_one_memory_budget(mode)
    [r] = run_tests("x = b'x' * (100 * 2**20)\nprint(len(x))", [""], limits=PATIENT, mode=mode)
    assert r["reason"] == "memory"  # 512 MiB / 32 processes -> 64 MiB each
    [r] = run_tests("x = b'x' * (40 * 2**20)\nprint(len(x))", [""], limits=PATIENT, mode=mode)
    assert r["status"] == "ok" and r["stdout"].strip() == str(40 * 2**20)
    test_fork_bomb(mode)


def test_host_packages_and_paths_are_hidden(mode):
    repo = str(Path(__file__).resolve().parents[2])
    host_dirs = sorted({*site.getsitepackages(), *(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))),
                        "/usr/lib/python3/dist-packages",
                        f"/usr/local/lib/python{sys.version_info[0]}.{sys.version_info[1]}/dist-packages",
                        f"{sys.base_prefix}/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"})
    program = (
        f"import sys\nsys.path[:0] = {host_dirs!r}\n"
        "for name in ('numpy', 'yaml', 'pydantic', 'torch'):\n"
        "    try:\n        __import__(name)\n        print('imported', name)\n    except ImportError:\n        pass\n"
        "print(open('/proc/1/cmdline').read().replace('\\0', ' '))\n"
        "print(open('/proc/self/cmdline').read().replace('\\0', ' '))\n"
        "print(open('/proc/self/mountinfo').read())\n"
    )
    [r] = run_tests(program, [""], limits=FAST, mode=mode)
    assert r["status"] == "ok", r
    assert "imported" not in r["stdout"], r["stdout"]
    init_cmdline, own_cmdline, mountinfo = r["stdout"].split("\n", 2)
    assert repo not in init_cmdline and repo not in own_cmdline
    if mode == "bwrap":  # the unshare mode's mountinfo names the directories it covers (README)
        assert repo not in mountinfo


def test_infinite_loop_and_sleep(mode):
    # CPU time runs out first unless the machine is too busy to give it 1 s within 3 s of wall time
    assert attack("print(42, flush=True)\nwhile True: pass", mode)["reason"] in ("cpu_limit", "timeout")
    sleeper = Limits(**{**FAST.__dict__, "wall_s": 1.0})
    assert attack("print(42, flush=True)\nimport time\ntime.sleep(600)", mode, sleeper)["reason"] == "timeout"


def test_memory_bomb(mode):
    assert attack("print(42)\nx = bytearray(10**10)", mode)["reason"] == "memory"
    assert attack("print(42)\nchunks = []\nwhile True: chunks.append(b'x' * 2**20)", mode)["reason"] == "memory"


def test_disk_fill(mode):
    big_file = "print(42)\nwith open('big', 'wb') as f:\n    while True: f.write(b'x' * 2**16)"
    assert attack(big_file, mode)["reason"] == "file_size_limit"
    many_files = "print(42)\ni = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * 900_000)\n    i += 1"
    assert attack(many_files, mode)["reason"] == "disk_full"


def test_writes_outside_its_directory(mode, tmp_path):
    marker = f"pwned-{uuid.uuid4().hex}"
    targets = [tmp_path / marker, Path("/tmp") / marker, Path.cwd() / marker, Path("/etc") / marker,
               Path(sys.prefix) / marker]
    program = "print(42)\nfailures = 0\n"
    for target in targets:
        program += f"try:\n    open({str(target)!r}, 'w').write('x')\nexcept OSError:\n    failures += 1\n"
    program += "raise SystemExit(0 if failures == 0 else 1)"
    attack_result = run_tests(program, [""], limits=FAST, mode=mode)[0]
    for target in targets:
        assert not target.exists(), f"the sandbox wrote {target}"
    # /tmp inside is the sandbox's own tmpfs, so that write may succeed there, unseen by the host;
    # the host paths must all have failed.
    assert attack_result["returncode"] != 0 or attack_result["status"] != "ok"


def test_reads_no_trainer_secrets(mode, tmp_path, monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", secret)
    planted = tmp_path / "secret.txt"
    planted.write_text(secret)
    planted.chmod(0o644)  # world-readable: only isolation keeps it out
    home_secret = Path.home() / f".posttrain-test-secret-{secret[:8]}"
    home_secret.write_text(secret)
    try:
        program = (
            "import os\nprint(dict(os.environ))\n"
            f"for path in [{str(planted)!r}, {str(home_secret)!r}, '/proc/1/environ', '/proc/{os.getpid()}/environ']:\n"
            "    try:\n        print(open(path).read())\n    except OSError as e:\n        print('denied', path, e)\n"
        )
        [r] = run_tests(program, [""], limits=FAST, mode=mode)
        assert secret not in r.get("stdout", "") and secret not in r.get("stderr", "")
        assert "POSTTRAIN_TEST_SECRET" not in r.get("stdout", "")
        # and the environment scores a program that needs the secret 0, saying why
        attack_result = attack(f"print(open({str(planted)!r}).read())", mode)
        assert attack_result["reason"] in ("file_not_found", "forbidden")
    finally:
        home_secret.unlink()


def test_no_network_even_loopback(mode):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    connections = []
    done = threading.Event()

    def accept():
        while not done.is_set():
            try:
                connections.append(server.accept())
            except socket.timeout:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        r = attack(
            "import socket\nprint(42)\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'hi')",
            mode,
        )
        assert r["reason"] == "network"
        done.set()
        thread.join()
        assert connections == []
    finally:
        server.close()


def test_cannot_kill_the_trainer_or_other_processes(mode):
    victim = subprocess.Popen(["sleep", "60"])
    try:
        program = (
            "import os, signal\nprint(42, flush=True)\n"
            f"for pid in ({os.getpid()}, {victim.pid}, os.getppid(), 1):\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
            "os.kill(-1, signal.SIGKILL)\n"
        )
        r = attack(program, mode)
        assert r["reason"] in ("killed", "sandbox_error", "forbidden")
        assert victim.poll() is None  # the host process survived
    finally:
        victim.kill()
        victim.wait()


def test_huge_output_is_capped(mode):
    r = attack("import sys\nwhile True: sys.stdout.write('x' * 65536)", mode)
    assert r["reason"] == "output_limit" and len(r.get("stdout", "")) <= FAST.output_bytes


def test_cannot_import_posttrain_or_reach_ray(mode):
    repo = str(Path(__file__).resolve().parents[2])
    site = [p for p in sys.path if p.endswith("site-packages")]
    program = f"import sys\nsys.path[:0] = {[repo] + site!r}\nprint(42)\nimport ray\nray.init(address='auto')"
    assert attack(program, mode)["reason"] == "import_error"
    program = f"import sys\nsys.path[:0] = {[repo]!r}\nprint(42)\nimport posttrain"
    assert attack(program, mode)["reason"] == "import_error"


def test_a_mix_of_attacks(mode):
    program = (
        "import os, threading\nprint(42, flush=True)\n"
        "for _ in range(4):\n"
        "    if os.fork() == 0:\n"
        "        data = []\n"
        "        while True:\n            data.append(b'x' * 2**20); open('junk', 'ab').write(b'y' * 2**16)\n"
        "threading.Thread(target=lambda: [0 for _ in iter(int, 1)], daemon=True).start()\n"
        "while True: os.fork() if len(os.listdir('.')) < 5 else None\n"
    )
    assert attack(program, mode)["reason"] in ("cpu_limit", "timeout", "process_limit", "memory", "file_size_limit")


def test_environment_scores_attacks_zero_with_reasons(mode):
    # a wall clock a busy machine cannot run out of before the honest program ends: the sleep runs it out
    env = CodeEnvironment(CodeEnvConfig(sandbox=mode, timeout_s=10.0, cpu_s=1, memory_mb=256, reward="fraction"))
    tests = {"tests": [{"input": "2 3", "output": "5"}]}
    responses = {
        "```python\nprint(sum(map(int, input().split())))\n```": (1.0, ""),
        "```python\nprint(5)\nimport os\nwhile True: os.fork()\n```": (0.0, "process_limit"),
        "```python\nprint(5)\nx = bytearray(10**10)\n```": (0.0, "memory"),
        "```python\nprint(5, flush=True)\nimport time\ntime.sleep(60)\n```": (0.0, "timeout"),
        "no code here": (0.0, "no_code"),
    }
    logs = [[{"role": "assistant", "content": text}] for text in responses]
    try:
        out = env.step(logs, [tests] * len(logs))
    finally:
        env.shutdown()
    for (text, (reward, reason)), got, obs in zip(responses.items(), out.rewards.tolist(), out.observations):
        assert got == reward, text
        assert (reason in obs["content"]) if reason else "first failure" not in obs["content"]


def test_the_reason_does_not_depend_on_which_limit_fired_first():
    from posttrain.environments.sandbox._inside import failure_reason

    fork_errors = "BlockingIOError: [Errno 11] Resource temporarily unavailable"
    # a fork bomb stopped by the wall clock (a busy machine) or by its output cap is still a fork bomb
    assert failure_reason([], "timeout", -9, fork_errors) == "process_limit"
    assert failure_reason([], "output_limit", -9, fork_errors) == "process_limit"
    # a limit the test hit comes before the cap that stopped it, and before its exit status
    assert failure_reason(["process_limit", "cpu_limit"], "timeout", -9, "") == "process_limit"
    assert failure_reason(["cpu_limit"], "", 0, "") == "cpu_limit"
    assert failure_reason([], "timeout", -9, "") == "timeout"
    assert failure_reason([], "", 1, "MemoryError") == "memory"
    assert failure_reason([], "", 0, "") == ""
