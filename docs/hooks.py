"""MkDocs hooks (mkdocs.yml `hooks:`): the pages written at build time.

- `index.md`: the repository's README.md, the front page on GitHub and on the site alike; its
  links into `docs/` are made relative to the docs folder.
- `reference/config.md`: the configuration reference, from the schema's descriptions
  (`posttrain.config.reference`), so it cannot drift from the code.
- `reference/api.md`: the Python API from the docstrings (mkdocstrings), one section per public
  module of the package as it is on disk, so a moved or renamed module needs no edit here.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[1]


def front_page_markdown() -> str:
    """README.md with the `docs/` prefix taken off its links (the site is built from docs/)."""
    return re.sub(r"\]\(docs/", "](", (REPO / "README.md").read_text())


def api_reference_markdown() -> str:
    """One mkdocstrings block per public module of `posttrain` (no `_private` parts), grouped by part."""
    package = REPO / "posttrain"
    modules = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") for p in parts[1:]) or "configs" in parts:
            continue
        modules.append(".".join(parts))
    lines = ["# Python API", "",
             "Generated from the docstrings of every public module (`docs/hooks.py`). The contracts between",
             "modules (tensor layouts, `Batch`, losses, workers) are in [Internals](../internals.md).", ""]
    for module in modules:
        if module.count(".") == 1 and module != "posttrain":
            lines += [f"## `{module}`", ""]
        lines += [f"::: {module}", "    options:", "      heading_level: 3", "      show_submodules: false",
                  "      members: true", ""]
    return "\n".join(lines)


def on_files(files: Files, config) -> Files:
    if str(REPO) not in sys.path:  # the docs build may run from an environment without posttrain installed
        sys.path.insert(0, str(REPO))
    from posttrain.config.reference import config_reference_markdown

    pages = {"index.md": front_page_markdown(), "reference/config.md": config_reference_markdown(),
             "reference/api.md": api_reference_markdown()}
    for path, content in pages.items():
        existing = files.get_file_from_path(path)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, path, content=content))
    return files
