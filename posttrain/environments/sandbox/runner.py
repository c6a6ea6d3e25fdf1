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
core dumps; no_new_privs; a seccomp filter against new namespaces; where this machine lets us make
one, a cgroup per sandbox run capping the memory and processes of all its processes together
(`cgroup.py`; `memory_enforcement()` says which applies); the host's site-packages covered by an
empty tmpfs; `_inside.py` read from a pipe (and bwrap's options from `--args`), so the sandbox's
/proc does not name the project's directory; a test that hit a limit fails whatever its exit
code; a scrubbed environment (PATH, HOME, LANG only: no trainer variables);
`python -I -S` (no site-packages: posttrain, ray, torch cannot be imported); output capped; a
wall-clock deadline per test. As root (bwrap and unshare modes) the programs run as an
unprivileged uid (RLIMIT_NPROC does not apply to root), so a fork bomb stops at
`Limits.processes`; every leftover process of a test is killed before the next (`kill(-1)` inside
the PID namespace) and the namespace dies with the sandbox.
"""

from __future__ import annotations

import glob
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
# The sandbox's own init (bwrap, the Python of _inside.py) and its tmpfs files count against the
# cgroup too: the program's processes get `memory_bytes`, the cgroup this much more.
SANDBOX_OWN_MEMORY = 32 * 2**20
FALLBACK_MIN_PROCESS_MEMORY = 64 * 2**20  # without a cgroup, no process gets less address space than this
# `python -I -S -c BOOTSTRAP FD`: _inside.py's source comes through a pipe, so neither its host path
# (the project's directory) nor a bind mount of it shows in the sandbox's /proc.
BOOTSTRAP = ("import os, sys; f = os.fdopen(int(sys.argv[1]), 'rb'); source = f.read(); f.close(); "
             "del sys.argv[1:]; exec(compile(source, 'sandbox_init.py', 'exec'))")


@dataclass(frozen=True)
class Limits:
    """Per-test limits of a sandboxed program (defaults in brackets).

    wall_s: wall-clock seconds per test [5.0]; cpu_s: CPU seconds per test, all its processes
    together [4]; memory_bytes: memory of the whole sandbox [512 MiB]: where a cgroup can be made
    (`memory_enforcement()`), all its processes together (plus its tmpfs files and 32 MiB for the
    sandbox's own init), and each process's address space; else each process's address space is
    memory_bytes / processes (at least 64 MiB); processes: processes and threads of the sandbox user
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


def _site_package_dirs(prefix: str) -> list[str]:
    """Every site-packages / dist-packages folder under /usr, /usr/local and the Python installation:
    the sandbox covers them with an empty tmpfs (no host package is importable, even by path)."""
    found = []
    for root in ("/usr", "/usr/local", prefix):
        for pattern in ("lib*/python3*/site-packages", "lib*/python3*/dist-packages", "lib/python3/dist-packages"):
            for path in sorted(glob.glob(os.path.join(root, pattern))):
                if os.path.isdir(path) and not os.path.islink(path) and path not in found:
                    found.append(path)
    return found


_bwrap_help: Optional[str] = None


def _bwrap_supports(option: str) -> bool:
    global _bwrap_help
    if _bwrap_help is None:
        try:
            _bwrap_help = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            _bwrap_help = ""
    return option in _bwrap_help


def _bwrap_command(limits: Limits) -> list[str]:
    python, prefix = _python()
    cmd = [
        "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
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
    for packages in _site_package_dirs(prefix):
        cmd += ["--tmpfs", packages, "--remount-ro", packages]
    cmd += [
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(limits.disk_bytes), "--perms", "1777", "--tmpfs", "/tmp",
        "--size", str(limits.disk_bytes), "--perms", "1777", "--tmpfs", WORKDIR_BWRAP,
        "--chdir", "/", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
    ]
    if _is_root():  # to drop to the sandbox uid; setuid() clears both again
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        cmd += ["--unshare-user"]
        if _bwrap_supports("--disable-userns"):  # bubblewrap >= 0.8; the seccomp filter of _inside.py also
            cmd += ["--disable-userns"]
    return cmd + ["--", python, "-I", "-S", "-c", BOOTSTRAP]


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
               "--propagation", "private", python, "-I", "-S", "-c", BOOTSTRAP]
        inner_python = "/tmp/.python/" + os.path.relpath(python, prefix)
        site_dirs = _site_package_dirs(prefix)
        return cmd, {
            "python": inner_python, "workdir": WORKDIR_UNSHARE, "uid": uid, "kill_all": True, "nproc_extra": 0,
            "setup_mounts": {
                "python_prefix": prefix, "hide": _hidden_dirs() + [d for d in site_dirs if not d.startswith(prefix + os.sep)],
                "python_hide": [os.path.relpath(d, prefix) for d in site_dirs if d.startswith(prefix + os.sep)],
                "limits": asdict(limits),
            },
        }
    if _is_root() and not _world_accessible(python, prefix):
        # Root is exempt from RLIMIT_NPROC, and this Python cannot be run as another user.
        raise SandboxUnavailable(
            f"the rlimits mode as root needs a Python that an unprivileged user can run ({prefix} is not "
            "world-readable), or a fork bomb could not be contained; install bubblewrap"
        )
    return [python, "-I", "-S", "-c", BOOTSTRAP], {
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


def _pipe_holding(data: bytes) -> int:
    """The read end of a pipe that holds `data` and is closed for writing (the child reads to EOF)."""
    read_end, write_end = os.pipe()
    try:
        if len(data) > 65536:  # the default pipe buffer: more would block this write
            import fcntl

            fcntl.fcntl(write_end, getattr(fcntl, "F_SETPIPE_SZ", 1031), len(data))
        os.write(write_end, data)
    except OSError:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return read_end


_memory_announced = False


def memory_enforcement() -> str:
    """How `Limits.memory_bytes` and `Limits.processes` are enforced here (logged once per process)."""
    from posttrain.environments.sandbox import cgroup

    global _memory_announced
    kind = cgroup.available()
    if kind:
        text = (f"{kind}: memory and processes of the whole sandbox capped together (memory.max / pids.max "
                "of a cgroup per sandbox run); a test that hits a cap fails even if it exits 0")
    else:
        text = ("no cgroup can be made here: each process gets memory_mb / max_processes of address space "
                f"(at least {FALLBACK_MIN_PROCESS_MEMORY >> 20} MiB), so a sandbox holds at most about "
                f"max(memory_mb, {FALLBACK_MIN_PROCESS_MEMORY >> 20} MiB x max_processes); processes are capped by RLIMIT_NPROC")
    if not _memory_announced:
        _memory_announced = True
        (log.info if kind else log.warning)("code sandbox memory: %s", text)
    return text


def _sandbox_cgroup(limits: Limits):
    """A fresh cgroup for one sandbox run, or None where none can be made (see `memory_enforcement`)."""
    from posttrain.environments.sandbox import cgroup

    memory_enforcement()
    if not cgroup.available():
        return None
    try:
        return cgroup.SandboxCgroup.create(limits.memory_bytes + 2 * limits.disk_bytes + SANDBOX_OWN_MEMORY,
                                           limits.processes + 3)  # + bwrap, its init and _inside.py
    except OSError as e:
        log.warning("code sandbox: could not make a cgroup (%s); this run has per-process limits only", e)
        return None


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
    cgroup = _sandbox_cgroup(limits)
    if cgroup is None:
        limit_fields["memory_bytes"] = max(limits.memory_bytes // limits.processes, FALLBACK_MIN_PROCESS_MEMORY)
    elif "pids" in cgroup.counter_files:
        # the cgroup's pids.max stops a fork bomb first and counts it; RLIMIT_NPROC stays as a backstop
        limit_fields["processes"] += 8
    job.update({"mode": style, "program": program, "inputs": inputs, "fn_name": fn_name, "limits": limit_fields})
    owned_workdir = None
    if job["workdir"] is None:  # rlimits mode: a private directory on the host
        import tempfile

        owned_workdir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
        job["workdir"] = owned_workdir
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    n = len(inputs)
    deadline = time.monotonic() + n * (limits.wall_s + 1.0) + 10.0
    passed_fds: list[int] = []
    try:
        if cgroup is not None:
            job["counter_fds"] = cgroup.open_counters()
            passed_fds += [fd for fd, _ in job["counter_fds"].values()]
        init_fd = _pipe_holding(_INSIDE.read_bytes())
        passed_fds.append(init_fd)
        cmd = cmd + [str(init_fd)]
        if mode == "bwrap":  # its options (host paths) through a pipe: /proc/1/cmdline inside is `bwrap --args N python ...`
            split = cmd.index("--")
            args_fd = _pipe_holding(b"".join(arg.encode() + b"\0" for arg in cmd[:split]))
            passed_fds.append(args_fd)
            cmd = ["bwrap", "--args", str(args_fd), *cmd[split:]]
        if cgroup is not None:
            cmd = cgroup.wrap(cmd)
        process = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            start_new_session=True, close_fds=True, pass_fds=passed_fds, cwd="/",
        )
        for fd in passed_fds:
            os.close(fd)
        passed_fds = []
        try:
            process.stdin.write(json.dumps(job).encode())
            process.stdin.close()
        except OSError:
            pass
        stdout, stderr, why = _read_capped(process, n * (limits.output_bytes * 2 + 4096) + 65536, deadline)
        process.wait()
    finally:
        for fd in passed_fds:
            os.close(fd)
        if cgroup is not None:
            cgroup.remove()
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
