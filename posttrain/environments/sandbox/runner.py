"""Run untrusted programs against test inputs in an OS-level sandbox (host side).

`run_tests(program, inputs, ...)` starts one sandbox per call. Inside it `_inside.py` (stdlib only)
sets the resource limits, drops privileges and runs the program once per test input (or calls a
function of it), and reports each test's output and, for a failure, why. Expected outputs never
enter the sandbox; the caller compares.

Modes (`sandbox=`), strongest first; `auto` takes the strongest that works here and warns loudly
when that is not `bwrap`:

- `bwrap` (bubblewrap, the Debian/Ubuntu/Fedora package `bubblewrap`): new PID, network, IPC and
  UTS namespaces; a root file system holding only /usr (and /bin, /lib*, /sbin), /etc/ld.so.cache
  and the Python installation, all read-only; a fresh /proc and minimal /dev; size-capped private
  tmpfs at /tmp and at the working directory /sandbox; nothing else of the host (home, the
  trainer's files and working directory, /tmp, /dev/shm, /run) exists inside.
- `unshare` (util-linux `unshare`, needs root): new PID, network, IPC, UTS and mount namespaces; a
  size-capped tmpfs over /tmp; empty read-only tmpfs over /root, /home, /opt, /srv, /mnt, /media,
  /run, /var/tmp, /var/lib, /var/log, /dev/shm, the trainer's working directory, its virtual
  environment and posttrain's own directory; the rest of the host file system stays visible
  read-only to the unprivileged sandbox user (it can read what any local user can read).
- `rlimits` (last resort, no namespaces): resource limits, a private working directory, a
  scrubbed environment, the wall-clock kill of the process group. The program can read what the
  trainer's user can read and can open network connections.

Every mode: rlimits on address space (memory), processes, file size, open files, CPU seconds, no
core dumps; no_new_privs; a scrubbed environment (PATH, HOME, LANG only: no trainer variables);
`python -I -S` (no site-packages: posttrain, ray, torch cannot be imported); output capped; a
wall-clock deadline per test. As root (bwrap and unshare modes) the programs run as an
unprivileged uid (RLIMIT_NPROC does not apply to root), so a fork bomb stops at
`Limits.processes`; every leftover process of a test is killed before the next (`kill(-1)` inside
the PID namespace) and the namespace dies with the sandbox.
"""

from __future__ import annotations

import json
import logging
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Optional

log = logging.getLogger(__name__)

Mode = Literal["bwrap", "unshare", "rlimits"]
MODES: tuple[Mode, ...] = ("bwrap", "unshare", "rlimits")
_INSIDE = Path(__file__).with_name("_inside.py")
_SANDBOX_UID_BASE = 1_200_000  # unprivileged uids no real account uses; one per sandbox run
WORKDIR_BWRAP = "/sandbox"
WORKDIR_UNSHARE = "/tmp/work"


@dataclass(frozen=True)
class Limits:
    """Per-test limits of a sandboxed program (defaults in brackets).

    wall_s: wall-clock seconds per test [5.0]; cpu_s: CPU seconds per test [4]; memory_bytes:
    address space per process [512 MiB]; processes: processes and threads of the sandbox user
    [32]; file_size_bytes: largest file it may write [4 MiB]; disk_bytes: size of its private
    tmpfs (/tmp and the working directory, each) [16 MiB]; open_files: file descriptors per
    process [64]; output_bytes: stdout kept per test; more is an `output_limit` failure [64 KiB].
    """

    wall_s: float = 5.0
    cpu_s: int = 4
    memory_bytes: int = 512 * 2**20
    processes: int = 32
    file_size_bytes: int = 4 * 2**20
    disk_bytes: int = 16 * 2**20
    open_files: int = 64
    output_bytes: int = 64 * 2**10


class SandboxUnavailable(RuntimeError):
    """The requested sandbox mode cannot run on this machine."""


def _python() -> tuple[str, str]:
    """(the real Python executable, its installation prefix) to run inside the sandbox."""
    executable = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if not executable.startswith(prefix + os.sep):
        prefix = str(Path(executable).parent.parent)
    return executable, prefix


def _is_root() -> bool:
    return os.geteuid() == 0


def _user_process_count() -> int:
    """Processes of this uid now (RLIMIT_NPROC counts them all, the trainer's included)."""
    uid, count = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                pass
    return count


def _bwrap_command(limits: Limits) -> list[str]:
    python, prefix = _python()
    cmd = [
        "bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr",
    ]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    cmd += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    if not prefix.startswith("/usr/"):
        # bwrap would create the prefix's parents with the host's modes (e.g. /root is 0700):
        # make them traversable for the unprivileged sandbox user.
        parents = list(Path(prefix).parents)[:-1]
        for parent in reversed(parents):
            cmd += ["--perms", "0755", "--dir", str(parent)]
        cmd += ["--ro-bind", prefix, prefix]
    cmd += [
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(limits.disk_bytes), "--perms", "1777", "--tmpfs", "/tmp",
        "--size", str(limits.disk_bytes), "--perms", "1777", "--tmpfs", WORKDIR_BWRAP,
        "--ro-bind", str(_INSIDE), "/.sandbox_init.py", "--chdir", "/", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
    ]
    if _is_root():  # to drop to the sandbox uid; setuid() clears both again
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        cmd += ["--unshare-user"]
    return cmd + [python, "-I", "-S", "/.sandbox_init.py"]


def _hidden_dirs() -> list[str]:
    """Directories the `unshare` mode covers with an empty tmpfs (they may hold secrets)."""
    candidates = ["/root", "/home", "/opt", "/srv", "/mnt", "/media", "/run", "/var/tmp", "/var/lib", "/var/log",
                  "/dev/shm", os.getcwd(), sys.prefix, str(Path(__file__).resolve().parents[3]),
                  os.path.expanduser("~")]
    keep = {"/", "/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc", "/proc", "/dev", "/tmp", "/sys", "/var"}
    hidden = []
    for path in candidates:
        path = os.path.realpath(path)
        if path not in keep and path not in hidden and not path.startswith("/usr/"):
            hidden.append(path)
    return hidden


def _command(mode: Mode, limits: Limits) -> tuple[list[str], dict]:
    """(argv that starts the sandbox's init, the mode-specific part of its job)."""
    python, prefix = _python()
    uid = random.SystemRandom().randrange(_SANDBOX_UID_BASE, _SANDBOX_UID_BASE + 1_000_000)
    if mode == "bwrap":
        return _bwrap_command(limits), {
            "python": python, "workdir": WORKDIR_BWRAP, "uid": uid if _is_root() else None, "kill_all": True,
            "nproc_extra": 0 if _is_root() else _user_process_count(),
        }
    if mode == "unshare":
        if not _is_root():
            raise SandboxUnavailable("the unshare sandbox needs root (run as root or install bubblewrap)")
        cmd = ["unshare", "--pid", "--fork", "--kill-child", "--net", "--ipc", "--uts", "--mount", "--mount-proc",
               "--propagation", "private", python, "-I", "-S", str(_INSIDE)]
        inner_python = "/tmp/.python/" + os.path.relpath(python, prefix)
        return cmd, {
            "python": inner_python, "workdir": WORKDIR_UNSHARE, "uid": uid, "kill_all": True, "nproc_extra": 0,
            "setup_mounts": {"python_prefix": prefix, "hide": _hidden_dirs(), "limits": asdict(limits)},
        }
    if _is_root() and not _world_accessible(python, prefix):
        # Root is exempt from RLIMIT_NPROC, and this Python cannot be run as another user.
        raise SandboxUnavailable(
            f"the rlimits mode as root needs a Python that an unprivileged user can run ({prefix} is not "
            "world-readable), or a fork bomb could not be contained; install bubblewrap"
        )
    return [python, "-I", "-S", str(_INSIDE)], {
        "python": python, "workdir": None, "uid": uid if _is_root() else None, "kill_all": False,
        "nproc_extra": 0 if _is_root() else _user_process_count(),
    }


def _world_accessible(python: str, prefix: str) -> bool:
    """Can any user run `python` and read its standard library (every parent directory o+x)?"""
    stdlib = Path(prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for path in [Path(python), stdlib, *stdlib.parents]:
        try:
            mode = path.stat().st_mode
        except OSError:
            return False
        if not mode & 0o001 or (path == Path(python) and not mode & 0o004):
            return False
    return True


def _read_capped(process: subprocess.Popen, cap: int, deadline: float) -> tuple[bytes, bytes, str]:
    """stdout and stderr of the sandbox until EOF, `cap` bytes or the deadline (then it is killed)."""
    buffers = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    open_fds = set(buffers)
    why = ""
    while open_fds:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            why = "timeout"
            break
        ready, _, _ = select.select(list(open_fds), [], [], min(remaining, 0.5))
        for fd in ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_fds.discard(fd)
            else:
                buffers[fd] += chunk
                if len(buffers[fd]) > cap:
                    why = "output_limit"
        if why:
            break
    if why:
        _kill(process)
    return bytes(buffers[process.stdout.fileno()]), bytes(buffers[process.stderr.fileno()]), why


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the sandbox is its own session
    except OSError:
        pass


def run_tests(
    program: str,
    inputs: list[Any],
    *,
    style: Literal["stdio", "function"] = "stdio",
    fn_name: Optional[str] = None,
    limits: Limits = Limits(),
    mode: Mode = "bwrap",
) -> list[dict]:
    """Run `program` once per test input in a fresh sandbox; one result dict per input, in order.

    Args:
        program: Python source.
        inputs: per test, the stdin text (`stdio`) or the arguments (`function`: a list of positional
            arguments, a dict of keyword arguments, or one value).
        style: `stdio` (default): one process per test, the answer is its stdout; `function`: one
            process calls `fn_name(*args)` per test, the answer is the JSON return value.
        fn_name: the function to call (`function` style).
        limits: see `Limits`.
        mode: `bwrap` (default), `unshare` or `rlimits` (see the module docstring; `resolve_mode`).

    A result: `{"test": i, "status": "ok" | <failure>, "reason": "" | why, "stdout" | "value",
    "returncode", "stderr"}`. Reasons: timeout, cpu_limit, memory, process_limit, file_size_limit,
    disk_full, open_files_limit, output_limit, network, forbidden, forbidden_file_access,
    file_not_found, import_error, syntax_error, recursion_limit, runtime_error, killed, crash,
    sandbox_error (the sandbox itself failed or was killed by the program).
    """
    if style == "function" and not fn_name:
        raise ValueError("style='function' needs fn_name")
    if not inputs:
        return []
    cmd, job = _command(mode, limits)
    limit_fields = asdict(limits)
    limit_fields["processes"] = limits.processes + job.pop("nproc_extra")
    limit_fields["cpu_s"] = max(1, int(limits.cpu_s))
    job.update({"mode": style, "program": program, "inputs": inputs, "fn_name": fn_name, "limits": limit_fields})
    owned_workdir = None
    if job["workdir"] is None:  # rlimits mode: a private directory on the host
        import tempfile

        owned_workdir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
        job["workdir"] = owned_workdir
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    n = len(inputs)
    deadline = time.monotonic() + n * (limits.wall_s + 1.0) + 10.0
    try:
        process = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            start_new_session=True, close_fds=True, cwd="/",
        )
        try:
            process.stdin.write(json.dumps(job).encode())
            process.stdin.close()
        except OSError:
            pass
        stdout, stderr, why = _read_capped(process, n * (limits.output_bytes * 2 + 4096) + 65536, deadline)
        process.wait()
    finally:
        if owned_workdir:
            shutil.rmtree(owned_workdir, ignore_errors=True)
    results: dict[int, dict] = {}
    for line in stdout.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("test"), int) and 0 <= record["test"] < n:
            results.setdefault(record["test"], record)
    missing_reason = why or "sandbox_error"
    detail = stderr.decode(errors="replace")[-500:]
    return [
        results.get(i) or {"test": i, "status": "error", "reason": missing_reason, "returncode": process.returncode,
                           "stderr": detail}
        for i in range(n)
    ]


# ----------------------------------------------------------------------------- mode detection
_probe_lock = threading.Lock()
_probed: dict[str, Optional[str]] = {}  # mode -> None (works) or why not


def mode_problem(mode: Mode) -> Optional[str]:
    """None when `mode` runs a trivial program correctly here, else why not (cached per process)."""
    with _probe_lock:
        if mode not in _probed:
            _probed[mode] = _probe(mode)
        return _probed[mode]


def _probe(mode: Mode) -> Optional[str]:
    tool = {"bwrap": "bwrap", "unshare": "unshare"}.get(mode)
    if tool and shutil.which(tool) is None:
        return f"'{tool}' is not installed" + (" (apt-get install bubblewrap)" if tool == "bwrap" else "")
    if mode == "unshare" and not _is_root():
        return "the unshare mode needs root"
    try:
        result = run_tests("print(int(input()) + 1)", ["41"], limits=Limits(wall_s=30.0), mode=mode)[0]
    except (OSError, SandboxUnavailable) as e:
        return f"{mode} failed to start: {e}"
    if result.get("status") != "ok" or result.get("stdout", "").strip() != "42":
        return f"{mode} could not run a test program ({result.get('reason')}: {result.get('stderr', '')[-300:].strip()})"
    return None


_warned = False


def resolve_mode(requested: str = "auto") -> Mode:
    """The sandbox mode to use: `requested` itself (SandboxUnavailable if it cannot run here), or for
    `auto` the strongest that works, with a loud warning when that is not bubblewrap."""
    global _warned
    if requested != "auto":
        if requested not in MODES:
            raise ValueError(f"unknown sandbox mode {requested!r}; expected auto or one of {MODES}")
        problem = mode_problem(requested)  # type: ignore[arg-type]
        if problem:
            raise SandboxUnavailable(f"sandbox mode {requested!r} is unavailable: {problem}")
        return requested  # type: ignore[return-value]
    problems = {}
    for mode in MODES:
        problem = mode_problem(mode)
        if problem is None:
            if mode != "bwrap" and not _warned:
                _warned = True
                weaker = "a file-system view that hides home, /tmp and the trainer's files but not the rest of /" \
                    if mode == "unshare" else "NO namespaces: programs can read the trainer's files and use the network"
                message = (
                    f"code sandbox: bubblewrap unavailable ({problems['bwrap']}); falling back to '{mode}' mode: "
                    f"{weaker}. Install bubblewrap (apt-get install -y bubblewrap) for full isolation."
                )
                log.warning(message)
                print(f"[posttrain] WARNING: {message}", file=sys.stderr, flush=True)
            return mode
        problems[mode] = problem
    raise SandboxUnavailable(f"no sandbox mode works here: {problems}")
