"""The sandbox's first process: lock itself down, then run an untrusted program against test inputs.

Run by `posttrain.environments.sandbox.runner` as `python -I -S _inside.py` (isolated mode, no
site-packages: only the standard library, so neither posttrain nor ray nor torch can be imported
from here or from the program). It reads its job from stdin as one JSON object while it still
runs as root (the job never touches the file system, so the program cannot read it back):

    {"mode": "stdio" | "function", "program": str, "inputs": [...], "fn_name": str | None,
     "limits": {...}, "uid": int | null, "python": str, "workdir": str,
     "setup_mounts": {...} | null, "kill_all": bool}

then, in this order: makes the mounts of the `unshare` mode (tmpfs over /tmp and every hidden
directory, a read-only copy of the Python installation), sets the resource limits (they are
inherited by every child), sets no_new_privs (no set-uid binary or file capability can raise the
program's privileges), drops to the unprivileged `uid` (as root RLIMIT_NPROC would not count),
writes the program into the private working directory and runs it once per test:

- `stdio`: one process per test, the test's input on stdin; its stdout is the answer.
- `function`: one process imports the program as a module and calls `fn_name(*args)` per test;
  the JSON-encoded return values come back on a private pipe.

One JSON line per test goes to stdout: `{"test", "status", "reason", "stdout" | "value", ...}`.
The host compares outputs with the expected ones (which never enter the sandbox). Each test child
is its own session; after it, every other process of the sandbox user is killed (`kill(-1)`,
which in a PID namespace reaches only the sandbox), so a fork bomb cannot outlive its test.
"""

import ctypes
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38

# Run inside the function-mode child: import the program as module "solution" (so its
# `if __name__ == "__main__":` block does not run), call the function once per input and write
# one JSON line per call to the pipe whose fd is argv[2]. Printing to stdout is allowed and ignored.
FUNCTION_RUNNER = r"""
import json, os, sys, traceback
out = os.fdopen(int(sys.argv[2]), "w")
inputs = json.loads(sys.stdin.read())
namespace = {"__name__": "solution"}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
    fn = namespace[sys.argv[1]]
except BaseException as e:
    traceback.print_exc()
    out.write(json.dumps({"load_error": type(e).__name__ + ": " + str(e)[:200]}) + "\n"); out.flush()
    raise SystemExit(1)
for i, args in enumerate(inputs):
    try:
        value = fn(**args) if isinstance(args, dict) else fn(*args) if isinstance(args, list) else fn(args)
        line = json.dumps({"test": i, "value": value}, default=repr)
    except BaseException as e:
        traceback.print_exc()
        line = json.dumps({"test": i, "error": type(e).__name__ + ": " + str(e)[:200]})
    out.write(line + "\n"); out.flush()
"""


def libc_call(name, *args):
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}{args[:2]}: {os.strerror(errno)}")


def mount(source, target, fstype, flags, data=""):
    libc_call("mount", source.encode(), target.encode(), fstype.encode() if fstype else None, ctypes.c_ulong(flags),
              data.encode() if data else None)


def setup_mounts(spec, workdir):
    """`unshare` mode (root in a fresh mount namespace): what bubblewrap does for the other mode."""
    mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    tmp_size = spec["limits"]["disk_bytes"]
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_size},mode=1777")
    python_home = "/tmp/.python"  # a read-only view of the Python installation, which may sit under /root
    os.mkdir(python_home, 0o755)
    mount(spec["python_prefix"], python_home, None, MS_BIND | MS_REC)
    mount("none", python_home, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID)
    for path in spec["hide"]:  # empty read-only tmpfs over every directory that may hold secrets
        try:
            mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=755")
        except OSError:
            pass  # absent, or inside a directory hidden already
    os.mkdir(workdir, 0o755)


def set_limits(limits):
    as_bytes = limits["memory_bytes"]
    for name, value in (
        ("RLIMIT_CORE", 0),
        ("RLIMIT_AS", as_bytes),
        ("RLIMIT_FSIZE", limits["file_size_bytes"]),
        ("RLIMIT_NOFILE", limits["open_files"]),
        ("RLIMIT_NPROC", limits["processes"]),
        ("RLIMIT_MEMLOCK", 0),
        ("RLIMIT_MSGQUEUE", 0),
    ):
        resource.setrlimit(getattr(resource, name), (value, value))


def drop_privileges(uid):
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)  # also clears every capability
    if os.getuid() != uid or os.geteuid() != uid:
        raise RuntimeError("could not drop privileges")


def limit_cpu(seconds):
    def preexec():
        # Soft limit: SIGXCPU (reported as cpu_limit); one second later the hard limit kills.
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))

    return preexec


def read_capped(process, streams, cap, deadline):
    """Read `streams` (fd -> name) until EOF, the byte cap or the deadline; returns (data, why)."""
    data = {name: bytearray() for name in streams.values()}
    open_fds = dict(streams)
    why = ""
    while open_fds:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            why = "timeout"
            break
        ready, _, _ = select.select(list(open_fds), [], [], min(remaining, 0.5))
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                del open_fds[fd]
                continue
            buf = data[open_fds[fd]]
            buf += chunk
            if len(buf) > cap:
                why = "output_limit"
        if why:
            break
    if why:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            pass
    return data, why


def capped_reason(why, stderr):
    """`read_capped`'s reason, except that output flooded by the tracebacks of failed forks is the
    process limit at work (a fork bomb), not a program that prints too much."""
    if why == "output_limit" and ("BlockingIOError" in stderr or "Resource temporarily unavailable" in stderr):
        return "process_limit"
    return why


def classify(returncode, stderr):
    """Why a test process failed: a short reason from its exit signal or last traceback line."""
    if returncode < 0:
        return {
            signal.SIGXCPU: "cpu_limit", signal.SIGXFSZ: "file_size_limit", signal.SIGSEGV: "crash",
            signal.SIGKILL: "killed", signal.SIGSYS: "forbidden_syscall",
        }.get(-returncode, "signal_" + str(-returncode))
    tail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    rules = (
        ("MemoryError", "memory"), ("Cannot allocate memory", "memory"),
        ("Resource temporarily unavailable", "process_limit"), ("BlockingIOError", "process_limit"),
        ("No space left on device", "disk_full"), ("File too large", "file_size_limit"),
        ("Too many open files", "open_files_limit"),
        ("Network is unreachable", "network"), ("ConnectionRefusedError", "network"), ("gaierror", "network"),
        ("Read-only file system", "forbidden_file_access"), ("PermissionError", "forbidden"),
        ("Operation not permitted", "forbidden"), ("ProcessLookupError", "forbidden"),
        ("FileNotFoundError", "file_not_found"), ("ModuleNotFoundError", "import_error"),
        ("ImportError", "import_error"), ("RecursionError", "recursion_limit"),
        ("SyntaxError", "syntax_error"),
    )
    for needle, reason in rules:
        if needle in tail:
            return reason
    return "runtime_error"


def kill_leftovers(job):
    """Every other process of the sandbox user (possible only inside a PID namespace)."""
    if job["kill_all"]:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
    while True:  # reap what we can
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                break
        except ChildProcessError:
            break


def emit(record):
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def child_env(workdir):
    return {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0", "TMPDIR": workdir}


def run_stdio(job, workdir):
    limits = job["limits"]
    for i, test_input in enumerate(job["inputs"]):
        process = subprocess.Popen(
            [job["python"], "-I", "-S", "solution.py"], cwd=workdir, env=child_env(workdir),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=limit_cpu(limits["cpu_s"]),
        )
        try:
            process.stdin.write(str(test_input).encode())
            process.stdin.close()
        except OSError:  # the program exited without reading its input
            pass
        deadline = time.monotonic() + limits["wall_s"]
        data, why = read_capped(
            process, {process.stdout.fileno(): "out", process.stderr.fileno(): "err"}, limits["output_bytes"], deadline,
        )
        returncode = process.wait()
        stderr = data["err"].decode(errors="replace")
        why = capped_reason(why, stderr)
        if why:
            status, reason = why, why
        elif returncode != 0:
            status, reason = "error", classify(returncode, stderr)
        else:
            status, reason = "ok", ""
        emit({"test": i, "status": status, "reason": reason, "returncode": returncode,
              "stdout": data["out"][: limits["output_bytes"]].decode(errors="replace"), "stderr": stderr[-500:]})
        kill_leftovers(job)


def run_function(job, workdir):
    limits = job["limits"]
    with open(os.path.join(workdir, "_runner.py"), "w") as f:
        f.write(FUNCTION_RUNNER)
    read_end, write_end = os.pipe()
    num_tests = len(job["inputs"])
    process = subprocess.Popen(
        [job["python"], "-I", "-S", "_runner.py", job["fn_name"], str(write_end)], cwd=workdir,
        env=child_env(workdir), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        pass_fds=(write_end,), start_new_session=True, preexec_fn=limit_cpu(limits["cpu_s"] * num_tests),
    )
    os.close(write_end)
    try:
        process.stdin.write(json.dumps(job["inputs"]).encode())
        process.stdin.close()
    except OSError:
        pass
    deadline = time.monotonic() + limits["wall_s"] * num_tests
    data, why = read_capped(
        process, {read_end: "results", process.stdout.fileno(): "out", process.stderr.fileno(): "err"},
        limits["output_bytes"] * max(num_tests, 1), deadline,
    )
    returncode = process.wait()
    stderr = data["err"].decode(errors="replace")
    results = {}
    load_error = None
    for line in data["results"].decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "load_error" in record:
            load_error = record["load_error"]
        elif isinstance(record, dict) and isinstance(record.get("test"), int):
            results.setdefault(record["test"], record)
    failure = capped_reason(why, stderr) or ("" if returncode == 0 else classify(returncode, stderr))
    for i in range(num_tests):
        record = results.get(i)
        if record is not None and "value" in record:
            emit({"test": i, "status": "ok" if not failure else failure, "reason": failure, "value": record["value"],
                  "returncode": returncode, "stderr": stderr[-500:]})
        else:
            if record is not None:
                reason = "runtime_error"
            elif load_error and failure in ("", "runtime_error"):
                reason = "load_error"  # the program failed at import, or lacks the function
            else:
                reason = failure or "no_result"
            if record is not None and "error" in record:
                reason = classify(1, record["error"])
            emit({"test": i, "status": "error", "reason": reason, "returncode": returncode,
                  "stderr": (load_error or (record or {}).get("error") or stderr)[-500:]})
    kill_leftovers(job)


def main():
    job = json.loads(sys.stdin.buffer.read())
    workdir = job["workdir"]
    if job.get("setup_mounts"):
        setup_mounts(job["setup_mounts"], workdir)
    set_limits(job["limits"])
    libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if job.get("uid") is not None and os.getuid() == 0:
        try:
            os.chown(workdir, job["uid"], job["uid"])
        except PermissionError:
            pass  # bubblewrap keeps no CAP_CHOWN; its tmpfs is world-writable instead
        drop_privileges(job["uid"])
    os.chdir(workdir)
    with open("solution.py", "w") as f:
        f.write(job["program"])
    if job["mode"] == "function":
        run_function(job, workdir)
    else:
        run_stdio(job, workdir)


if __name__ == "__main__":
    sys.path.pop(0)  # this script's folder: its module names must not shadow the standard library
    main()
