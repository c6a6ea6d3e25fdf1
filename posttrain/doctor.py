"""`posttrain doctor`: check this machine before a long run, one line per item.

    posttrain doctor          # exit 1 when a check fails (a broken cache entry, a missing essential)
    posttrain doctor --fix    # also remove broken cache entries and leftovers, saying what it removed

Items: Python and the essential packages (torch, transformers, Ray) with their versions; every
entry of posttrain's cache (`posttrain.utils.cache.cache_dir()`: converted and tiny models,
SFT warm-start exports, Hugging Face copies of checkpoints, isolated environments) and the
leftovers of interrupted builds; the code sandbox's mode (bubblewrap, or the weaker fallback
`code` environments would use); the GPUs torch sees and their memory; vLLM's isolated
environment; free disk at the cache and in the current directory.

A line starts with its status: `ok`, `warn` (worth knowing; does not fail), `FAIL` (exit 1) or
`fixed` (`--fix` removed it). A model entry is judged as the jobs judge it
(`posttrain.utils.cache.entry_problem`: its manifest, and every file at the size it was published
with); a broken one fails the check although a job would rebuild it, since a rebuild can mean a
minute's conversion or a warm start's training that the user should know about.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

OK, WARN, FAIL, FIXED = "ok", "warn", "FAIL", "fixed"
# Below this much free disk at the cache or the working directory a long run may not get to its
# last checkpoint (a 135M model's checkpoint with its Adam state is 1.6 GB; vLLM's environment several GB).
LOW_DISK_BYTES = 10 * 2**30
# The cache's kinds of entries (its top-level directories).
MODEL_KINDS = ("models", "sft_warmup", "checkpoint_hf")  # Hugging Face model directories
ENVS = "envs"  # isolated Python environments (`distributed/isolated_env.py`)
# Build directories: `.tmp-<name>-<pid>-<hex>` and `.stale-<name>-<hex>` (`cache.publish_entry`),
# `.<name>-<key>.tmp-<pid>-<hex>` (envs), `<hash>.tmp<pid>` (checkpoint_hf, by earlier versions).
_BUILD_PID = re.compile(r"\.tmp-?(?:.*?-)?(\d+)(?:-[0-9a-f]{8})?$")
ESSENTIALS = ("torch", "transformers", "ray")
_PIN = re.compile(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^;\s]+)$")


@dataclass(frozen=True)
class Finding:
    """One line of the report."""

    status: str
    item: str
    detail: str

    def line(self) -> str:
        return f"{self.status:5s}  {self.item:12s}  {self.detail}"


# ------------------------------------------------------------------------------------- the cache
def env_problem(path: Path) -> Optional[str]:
    """What an isolated environment lacks (None: complete): its spec file and interpreter
    (`isolated_env.is_ready`), and the main environment's files its shared links point to."""
    import json

    from posttrain.distributed.isolated_env import SPEC_FILE, env_python

    if not (path / SPEC_FILE).is_file():
        return f"no {SPEC_FILE}: its build did not finish"
    if not env_python(path).exists():
        return "no bin/python"
    try:
        links = json.loads((path / SPEC_FILE).read_text()).get("shared_links")
    except (OSError, ValueError, AttributeError):
        return f"{SPEC_FILE} is unreadable"
    if links:
        if not Path(links).is_dir():
            return f"its links to the main environment ({links}) are gone"
        broken = sorted(p.name for p in Path(links).iterdir() if not p.exists())
        if broken:
            return f"its links to the main environment are broken ({', '.join(broken)}): the main environment changed"
    return None


def shared_links_problem(path: Path) -> Optional[str]:
    """Why `envs/shared/<name>-<key>` (an environment's links to the main one) is garbage: its
    environment is gone and no live process is building it (None otherwise)."""
    envs = path.parent.parent
    if (envs / path.name).is_dir():
        return None
    if any(building_pid(p.name) for p in envs.glob(f".{path.name}.tmp-*")):
        return None
    return "links of an environment that is gone"


def building_pid(name: str) -> Optional[int]:
    """The process a build directory's name says is building it, when that process is alive
    (None: a leftover of a finished or killed build)."""
    match = _BUILD_PID.search(name)
    if match is None:
        return None
    pid = int(match.group(1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        return pid
    return pid


def is_leftover(name: str) -> bool:
    """A build's temporary or replaced directory (see `_BUILD_PID`)."""
    return name.startswith((".tmp-", ".stale-")) or _BUILD_PID.search(name) is not None


def entry_problem(path: Path) -> Optional[str]:
    """Why the cache entry `path` (`<cache>/<kind>/<name>`) is broken or garbage, None if healthy
    (or still being built by a live process)."""
    name, kind = path.name, path.parent.name
    if is_leftover(name):
        if name.startswith(".stale-"):
            return "leftover of a replaced entry"
        return None if building_pid(name) else "leftover of an interrupted build"
    if kind in MODEL_KINDS:
        from posttrain.utils.cache import entry_problem as model_entry_problem

        return model_entry_problem(path)
    if kind == ENVS:
        return env_problem(path)
    return None


def dir_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def check_cache(root: Path, fix: bool) -> list[Finding]:
    """One finding per entry of the cache at `root`; with `fix`, broken entries and leftovers are
    removed (and reported `fixed`)."""
    if not root.is_dir():
        return [Finding(OK, "cache", f"{root} does not exist yet (made on first use)")]
    findings = []
    from posttrain.distributed.isolated_env import SHARED_LINKS

    for kind in (*MODEL_KINDS, ENVS):
        paths = sorted((root / kind).iterdir()) if (root / kind).is_dir() else []
        if kind == ENVS and (root / kind / SHARED_LINKS).is_dir():  # after the environments they serve
            paths = [p for p in paths if p.name != SHARED_LINKS] + sorted((root / kind / SHARED_LINKS).iterdir())
        for path in paths:
            if not path.is_dir():  # envs' .lock and .log files
                continue
            where = str(path.relative_to(root))
            shared_links = path.parent.name == SHARED_LINKS and kind == ENVS
            problem = shared_links_problem(path) if shared_links else entry_problem(path)
            if problem is None:
                pid = building_pid(path.name) if is_leftover(path.name) else None
                note = f"being built by process {pid}" if pid else f"{dir_size(path) / 2**20:.1f} MiB"
                findings.append(Finding(OK, "cache", f"{where} ({note})"))
            elif fix:
                shutil.rmtree(path, ignore_errors=True)
                findings.append(Finding(FIXED if not path.exists() else FAIL, "cache",
                                        f"{'removed' if not path.exists() else 'could not remove'} {where}: {problem}"))
            else:
                findings.append(Finding(FAIL, "cache", f"{where}: {problem} (posttrain doctor --fix removes it)"))
    others = sorted(p.name for p in root.iterdir() if p.name not in (*MODEL_KINDS, ENVS))
    if others:
        findings.append(Finding(OK, "cache", f"not posttrain's entries, left alone: {', '.join(others)}"))
    counts = [(sum(f.status == status for f in findings), word) for status, word in ((FAIL, "broken"), (FIXED, "removed"))]
    summary = f"{root}: {len(findings) - bool(others)} entries" + "".join(f", {n} {word}" for n, word in counts if n)
    return [Finding(OK, "cache", summary)] + findings


# ---------------------------------------------------------------------------------- the machine
def check_python() -> list[Finding]:
    version = ".".join(map(str, sys.version_info[:3]))
    status = OK if sys.version_info >= (3, 10) else FAIL
    return [Finding(status, "python", f"{version} ({sys.executable})" + ("" if status == OK else "; posttrain needs >= 3.10"))]


def pinned_versions() -> dict[str, str]:
    """posttrain's pinned dependencies (`name==version` of pyproject.toml's `dependencies`), from the
    installed package's metadata, else from the checkout's pyproject.toml; {} when neither is found."""
    from importlib import metadata

    try:
        requirements = metadata.requires("posttrain") or []
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        text = pyproject.read_text() if pyproject.is_file() else ""
        block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
        requirements = re.findall(r'"([^"]+)"', block.group(1)) if block else []
    pins = (_PIN.match(r.strip()) for r in requirements if ";" not in r)
    return {m.group(1).lower(): m.group(2) for m in pins if m}


def check_packages() -> list[Finding]:
    """The essential packages (`ESSENTIALS`): importable, and their versions against posttrain's pins."""
    import importlib

    findings, pins = [], pinned_versions()
    for module in ESSENTIALS:
        pin = pins.get(module)
        try:
            version = importlib.import_module(module).__version__
        except Exception as e:  # noqa: BLE001 (an import that fails for any reason is the finding)
            install = f"pip install {module}=={pin}" if pin else f"pip install {module}"
            findings.append(Finding(FAIL, module, f"cannot be imported ({type(e).__name__}: {e}); {install}"))
            continue
        same = pin is None or version.split("+")[0] == pin
        findings.append(Finding(OK if same else WARN, module, version + ("" if same else f" (posttrain pins {pin})")))
    return findings


def check_sandbox() -> list[Finding]:
    """The code sandbox's strongest working mode (`environments/sandbox/runner.py`)."""
    from posttrain.environments.sandbox import cgroup, mode_problem

    problems = {}
    for mode in ("bwrap", "unshare", "rlimits"):
        problems[mode] = mode_problem(mode)
        if problems[mode] is None:
            memory = f"memory capped by {cgroup.available()}" if cgroup.available() else "per-process memory limits"
            if mode == "bwrap":
                return [Finding(OK, "sandbox", f"bwrap (bubblewrap: full isolation), {memory}")]
            return [Finding(WARN, "sandbox", f"{mode} (weaker than bubblewrap: {problems['bwrap']}), {memory}; "
                                             "apt-get install bubblewrap for full isolation of code environments")]
    return [Finding(WARN, "sandbox", f"no mode works, code environments cannot run: {problems}")]


def check_gpus() -> list[Finding]:
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build of torch"
        return [Finding(OK, "gpus", f"none visible ({build}): jobs run on CPU")]
    findings = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        findings.append(Finding(OK, "gpus", f"{i}: {torch.cuda.get_device_name(i)}, {total / 2**30:.1f} GiB "
                                            f"({free / 2**30:.1f} GiB free)"))
    return findings


def check_vllm_env() -> list[Finding]:
    """vLLM's isolated environment for this machine (GPU or CPU pins), built or not."""
    import torch

    from posttrain.distributed.isolated_env import env_dir, is_ready
    from posttrain.models.generation.vllm_env import vllm_env_spec

    spec = vllm_env_spec(use_gpu=torch.cuda.is_available())
    if is_ready(spec):
        return [Finding(OK, "vllm env", f"built: {env_dir(spec)}")]
    return [Finding(OK, "vllm env", f"not built (policy.generation.backend=vllm builds it on first use, a few "
                                     f"minutes): {env_dir(spec)}")]


def check_disk(cache: Path) -> list[Finding]:
    findings = []
    for label, path in (("cache", cache), ("cwd", Path.cwd())):
        existing = next(p for p in (path, *path.parents) if p.exists())
        free = shutil.disk_usage(existing).free
        low = free < LOW_DISK_BYTES
        findings.append(Finding(WARN if low else OK, "disk", f"{label} {path}: {free / 2**30:.1f} GiB free"
                                                             + (" (low: checkpoints and environments take GBs)" if low else "")))
    return findings


def run_checks(fix: bool = False, cache: Optional[Path] = None) -> Iterable[Finding]:
    """Every check, in order, as its findings come (a check that raises is a FAIL line of its own)."""
    from posttrain.utils.cache import cache_dir

    cache = cache or cache_dir()
    checks: list[tuple[str, Callable[[], list[Finding]]]] = [
        ("python", check_python), ("packages", check_packages), ("cache", lambda: check_cache(cache, fix)),
        ("sandbox", check_sandbox), ("gpus", check_gpus), ("vllm env", check_vllm_env),
        ("disk", lambda: check_disk(cache)),
    ]
    for name, check in checks:
        try:
            yield from check()
        except Exception as e:  # noqa: BLE001 (one broken check must not hide the others)
            yield Finding(FAIL, name, f"the check failed: {type(e).__name__}: {e}")


def main(fix: bool = False) -> int:
    """Print every finding, one line each; 1 if any failed, else 0."""
    failed = False
    for finding in run_checks(fix):
        print(finding.line(), flush=True)
        failed |= finding.status == FAIL
    return 1 if failed else 0
