"""Where posttrain keeps what it builds once and reuses (converted models, SFT warm starts, isolated
Python environments), and how an entry gets there.

An entry is published only when it is complete, whoever builds it:

* one builder at a time: `publish_entry` takes a file lock beside the entry, so processes and ranks
  that ask at once wait for the first one's build instead of repeating it;
* the build goes to a private temporary directory; before it is renamed into place, a check of
  the kind of entry (`model_dir_problem` for a model: config, weights that open, tokenizer) must
  pass, so a build that wrote only part of its files (transformers' `save_pretrained` writes no
  weights on a non-zero `torch.distributed` rank) fails loudly instead of being kept;
* the last file written is the entry's manifest (`ENTRY_FILE`): what it was built from (`stamp`)
  and the size of every file. `entry_problem` trusts an entry only when the manifest is there, its
  stamp is the one asked for and every file has its size, so a partial, truncated or older entry
  is rebuilt; a build killed half-way (Ctrl-C, kill -9) leaves only a temporary directory, which
  the next builder (holding the lock) deletes.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

ENTRY_FILE = "posttrain-entry.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def cache_dir() -> Path:
    """Root of posttrain's cache: `$POSTTRAIN_CACHE`, default `~/.cache/posttrain`."""
    return Path(os.environ.get("POSTTRAIN_CACHE") or Path.home() / ".cache" / "posttrain").expanduser()


# ------------------------------------------------------------------ what a complete entry is
def read_manifest(path: Path) -> Optional[dict]:
    """The manifest of the entry at `path`, or None when it has none (or an unreadable one)."""
    try:
        manifest = json.loads((path / ENTRY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def entry_problem(path: Path, stamp: Optional[Mapping[str, Any]] = None) -> Optional[str]:
    """Why the entry at `path` cannot be trusted (None when it can): missing, no manifest, built
    from something else than `stamp` (when given), or a file missing or of another size than when
    it was published. Costs one `stat` per file."""
    if not path.is_dir():
        return "missing"
    manifest = read_manifest(path)
    if manifest is None:
        return f"no {ENTRY_FILE} (an unfinished build, or one from an older posttrain)"
    if stamp is not None and manifest.get("stamp") != dict(stamp):
        return f"built from {manifest.get('stamp')}, not {dict(stamp)}"
    for name, size in manifest["files"].items():
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, {size} when it was published"
    return None


def model_dir_problem(path: Path) -> Optional[str]:
    """Why `path` is not a loadable Hugging Face model directory (None when it is): its config
    must parse, its weights must be there and open (safetensors headers are read, not the
    tensors), and a tokenizer must be saved with it."""
    config = path / "config.json"
    try:
        json.loads(config.read_text())
    except (OSError, ValueError) as e:
        return f"config.json {'is missing' if isinstance(e, OSError) else 'does not parse'}"
    weights = [p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES]
    if not weights:
        return "no weights (model.safetensors)"
    for file in weights:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            try:
                with safe_open(str(file), framework="pt") as f:
                    if not list(f.keys()):
                        return f"{file.name} holds no tensors"
            except Exception as e:  # noqa: BLE001 - any unreadable header is a broken entry
                return f"{file.name} does not open ({type(e).__name__})"
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return "no tokenizer files"
    return None


# ------------------------------------------------------------------ publishing
@contextmanager
def entry_lock(final: Path) -> Iterator[None]:
    """Hold the build lock of the entry `final` (a file beside it) for the body."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def leftovers(final: Path) -> list[Path]:
    """Temporary and stale directories of builds of `final` that did not finish."""
    return sorted(p for pattern in (f".tmp-{final.name}-*", f".stale-{final.name}-*") for p in final.parent.glob(pattern))


def publish_entry(
    final: Path,
    build: Callable[[Path], Any],
    stamp: Mapping[str, Any],
    check: Optional[Callable[[Path], Optional[str]]] = model_dir_problem,
    describe: str = "cache entry",
) -> Path:
    """Return the complete entry `final` built from `stamp`, building it with `build(tmp_dir)` first
    unless it is already there (see the module doc). `check(tmp_dir)` names what is wrong with a
    finished build (None: nothing); a build that fails it raises `RuntimeError` and is not kept."""
    if entry_problem(final, stamp) is None:
        return final
    with entry_lock(final):
        if entry_problem(final, stamp) is None:  # built by another process while we waited
            return final
        for leftover in leftovers(final):  # only the lock holder builds: these are orphans
            shutil.rmtree(leftover, ignore_errors=True)
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            build(tmp)
            problem = check(tmp) if check is not None else None
            if problem:
                raise RuntimeError(f"building the {describe} {final} went wrong: {problem}; nothing was kept")
            write_manifest(tmp, stamp)
            if final.exists():  # broken or older: move it aside (atomic), then delete it
                stale = final.parent / f".stale-{final.name}-{uuid.uuid4().hex[:8]}"
                os.rename(final, stale)
                shutil.rmtree(stale, ignore_errors=True)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_manifest(path: Path, stamp: Mapping[str, Any]) -> None:
    """Write `path`'s manifest: `stamp` and every file's size. Written last, and durably, so its
    presence means everything before it is on disk."""
    files = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p.name != ENTRY_FILE):
        with open(file, "rb") as f:
            os.fsync(f.fileno())
        files[str(file.relative_to(path))] = file.stat().st_size
    text = json.dumps({"stamp": dict(stamp), "files": files}, indent=1, sort_keys=True) + "\n"
    with open(path / ENTRY_FILE, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
