"""The sandbox's first process: lock itself down, then run an untrusted program against test inputs.

Run by `posttrain.environments.sandbox.runner` as `python -I -S _inside.py` (isolated mode, no
site-packages: only the standard library, so neither posttrain nor ray nor torch can be imported
from here or from the program). It reads its job from stdin as one JSON object while it still
runs as root (the job never touches the file system, so the program cannot read it back):

    {"mode": "stdio" | "function", "program": str, "inputs": [...], "fn_name": str | None,
     "limits": {...}, "uid": int | null, "python": str, "workdir": str,
     "setup_mounts": {...} | null, "kill_all": bool, "counter_fds": {"memory"?: [fd, key], "pids"?: [fd, key]}}

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

A test fails when it hit a limit, whatever its exit code (a program may catch SIGXCPU or
MemoryError, print the answer and exit 0): after it and its leftovers are gone (this process is
their subreaper, so it collects them all), its CPU seconds (rusage) are compared with the limit,
and the sandbox cgroup's counters (a process killed at the memory cap, a fork refused at
pids.max; fds in `counter_fds`, where the host made a cgroup) are compared with their values before the test.
A seccomp filter refuses new namespaces (unshare, setns, clone with namespace flags, clone3), so
the program cannot build a user namespace of its own inside the sandbox.
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
PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 36, 22, 2
CLONE_NAMESPACE_FLAGS = 0x7E020080  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
# arch -> (AUDIT_ARCH value, syscall numbers of clone, unshare, setns, clone3)
SECCOMP_ARCHES = {"x86_64": (0xC000003E, 56, 272, 308, 435), "aarch64": (0xC00000B7, 220, 97, 268, 435)}

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
    for relative in spec.get("python_hide", []):  # its site-packages: no host package is importable
        mount("tmpfs", os.path.join(python_home, relative), "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=755")
    for path in spec["hide"]:  # empty read-only tmpfs over every directory that may hold secrets
        try:
            mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=755")
        except OSError:
            pass  # absent, or inside a directory hidden already
    os.mkdir(workdir, 0o755)


def deny_namespaces():
    """A seccomp filter (needs no_new_privs): no unshare or setns, no clone with a namespace flag;
    clone3 (flags in memory, out of the filter's reach) answers ENOSYS so that libc falls back to
    clone. Syscalls of a foreign ABI (x32, i386 on x86_64) are refused. Skipped on other arches."""
    arch = SECCOMP_ARCHES.get(os.uname().machine)
    if arch is None:
        return False
    audit_arch, nr_clone, nr_unshare, nr_setns, nr_clone3 = arch
    ld, jeq, jset, jge, ret = 0x20, 0x15, 0x45, 0x35, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    program = [
        (ld, 0, 0, 4),  # arch
        (jeq, 1, 0, audit_arch),
        (ret, 0, 0, eperm),
        (ld, 0, 0, 0),  # syscall number
        (jge, 9, 0, 0x40000000),  # x32 ABI -> refuse
        (jeq, 8, 0, nr_unshare),
        (jeq, 7, 0, nr_setns),
        (jeq, 4, 0, nr_clone3),
        (jeq, 1, 0, nr_clone),
        (ret, 0, 0, allow),
        (ld, 0, 0, 16),  # clone's flags (args[0], low half)
        (jset, 2, 1, CLONE_NAMESPACE_FLAGS),
        (ret, 0, 0, enosys),
        (ret, 0, 0, allow),
        (ret, 0, 0, eperm),
    ]

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    filters = (SockFilter * len(program))(*[SockFilter(*op) for op in program])
    fprog = SockFprog(len(program), filters)
    libc_call("prctl", PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_void_p(ctypes.addressof(fprog)), 0, 0)
    return True


def read_counter(counter):
    """The value of `key` in a cgroup file of `key value` lines (`counter` = [fd, key] or None):
    `oom_kill` of memory.events / memory.oom_control, `max` of pids.events."""
    if not counter:
        return 0
    fd, key = counter
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 4096).decode()
    except OSError:
        return 0
    for line in text.splitlines():
        words = line.split()
        if len(words) == 2 and words[0] == key and words[1].isdigit():
            return int(words[1])
    return 0


class LimitWatch:
    """What a test used: CPU seconds of all its processes (reaped by this subreaper) and the cgroup's
    limit counters, from `start()` to `hit(cpu_limit)` (after the test's processes are all reaped)."""

    def __init__(self, job):
        fds = job.get("counter_fds") or {}
        self.memory, self.pids = fds.get("memory"), fds.get("pids")

    def start(self):
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.cpu0 = usage.ru_utime + usage.ru_stime
        self.memory0, self.pids0 = read_counter(self.memory), read_counter(self.pids)

    def hit(self, cpu_limit_s, returncode):
        """The limits hit since `start()`, most telling first (a fork bomb also runs out of time)."""
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.cpu_s = usage.ru_utime + usage.ru_stime - self.cpu0
        hits = []
        if read_counter(self.pids) > self.pids0:
            hits.append("process_limit")
        if read_counter(self.memory) > self.memory0:
            hits.append("memory")
        # RLIMIT_CPU kills each process at the limit (SIGKILL: no handler can dodge it). rusage may
        # read a few percent below the clock the kernel enforces with, hence the margin for a killed
        # test; a tree of processes that used the whole budget between them also fails.
        if self.cpu_s >= cpu_limit_s or (returncode == -signal.SIGKILL and self.cpu_s >= 0.8 * cpu_limit_s):
            hits.append("cpu_limit")
        return hits


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
        # SIGKILL at the limit: a SIGXCPU (soft limit) could be caught and the answer printed
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds))
        try:  # the test's processes, not the sandbox's own, are the first the cgroup's OOM killer takes
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass

    return preexec


def wait_until(process, deadline):
    """The exit status of `process`; killed (its session) at the deadline: (returncode, "timeout"|"")."""
    try:
        return process.wait(timeout=max(deadline - time.monotonic(), 0.01)), ""
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            pass
        return process.wait(), "timeout"


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


def failure_reason(hits, why, returncode, stderr):
    """The reason a test failed, or "" when it passed. A limit the test hit comes first (`hits`, most
    telling first), then the cap that stopped it (`why`: output_limit, timeout), then its exit. A
    stopped test whose stderr is full of failed forks was a fork bomb at the process limit, whichever
    cap happened to stop it first on a busy machine."""
    if hits:
        return hits[0]
    if why and ("BlockingIOError" in stderr or "Resource temporarily unavailable" in stderr):
        return "process_limit"
    if why:
        return why
    return classify(returncode, stderr) if returncode != 0 else ""


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
    while True:  # reap them all (all are dead or dying in a PID namespace), so their CPU time counts
        try:
            if os.waitpid(-1, 0 if job["kill_all"] else os.WNOHANG) == (0, 0):
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
    watch = LimitWatch(job)
    for i, test_input in enumerate(job["inputs"]):
        watch.start()
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
        returncode, waited_out = wait_until(process, deadline)
        kill_leftovers(job)
        stderr = data["err"].decode(errors="replace")
        reason = failure_reason(watch.hit(limits["cpu_s"], returncode), why or waited_out, returncode, stderr)
        status = "ok" if not reason else reason if reason in ("timeout", "output_limit") else "error"
        emit({"test": i, "status": status, "reason": reason, "returncode": returncode, "cpu_s": round(watch.cpu_s, 3),
              "stdout": data["out"][: limits["output_bytes"]].decode(errors="replace"), "stderr": stderr[-500:]})


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
    watch = LimitWatch(job)
    watch.start()
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
    returncode, waited_out = wait_until(process, deadline)
    kill_leftovers(job)
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
    failure = failure_reason(watch.hit(limits["cpu_s"] * num_tests, returncode), why or waited_out, returncode, stderr)
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


def main():
    job = json.loads(sys.stdin.buffer.read())
    workdir = job["workdir"]
    if job.get("setup_mounts"):
        setup_mounts(job["setup_mounts"], workdir)
    set_limits(job["limits"])
    libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc_call("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of a test come back here
    deny_namespaces()
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


if __name__ == "__main__":  # run as `python -I -S -c <bootstrap>`: no script folder on sys.path
    main()
