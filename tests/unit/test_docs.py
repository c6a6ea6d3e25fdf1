"""The documentation: the site builds with `mkdocs build --strict` (a broken link, a missing page or
a bad anchor fails), the README stays a front page, and pointers from code to the docs land."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GENERATED_PAGES = {"index.md", "reference/config.md", "reference/api.md"}  # written by docs/hooks.py


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    suffixes = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".sbatch", ""}
    return [REPO / n for n in names if Path(n).suffix in suffixes and (REPO / n).is_file()
            and not (REPO / n).is_symlink()]


def headings(page: Path) -> list[str]:
    """A page's heading texts without Markdown (backticks, `{#id}` attributes)."""
    found = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return [re.sub(r"\s*\{#[^}]*\}$", "", h).replace("`", "") for h in found]


def test_the_site_builds_in_strict_mode(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    home = (site / "index.html").read_text()
    assert 'id="quick-start"' in home and 'href="getting-started/' in home  # README, links made relative
    config = (site / "reference" / "config" / "index.html").read_text()
    assert 'id="cfg-policy-generation"' in config and "Tokens generated per turn at most" in config
    api = (site / "reference" / "api" / "index.html").read_text()
    assert "posttrain.algorithms.loop.TrainingLoop" in api
    assert (site / "benchmarks" / "index.html").read_text().count("generation_vs_hf.py") >= 1


def test_the_readme_is_a_front_page_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    quick_start = text.split("## Quick start", 1)[1]
    assert re.match(r"\s*```bash\n\./run\.sh posttrain grpo\n\./run\.sh pytest\n```", quick_start)
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links and [link for link in links if not (REPO / link).exists()] == []


def test_pointers_from_code_to_the_docs_name_real_pages_and_sections():
    pointer = re.compile(r'docs/([\w/-]+\.md)(?:,\s+"([^"]+)")?')
    missing = []
    for path in tracked_text_files():
        for page, section in pointer.findall(path.read_text(errors="replace").replace("\n", " ")):
            target = REPO / "docs" / page
            if page in GENERATED_PAGES:
                continue
            if not target.exists():
                missing.append(f"{path.relative_to(REPO)}: docs/{page}")
            elif section and not any(h.startswith(" ".join(section.split())) for h in headings(target)):
                missing.append(f'{path.relative_to(REPO)}: docs/{page}, "{section}"')
    assert missing == []


def test_nothing_points_outside_the_repository():
    outside = [re.escape(s) for s in ("shared/" + "reference", "../" + "shared", "DESIGN" + ".md")]
    pattern = re.compile("|".join(outside))
    found = [f"{p.relative_to(REPO)}: {m.group(0)}" for p in tracked_text_files()
             for m in pattern.finditer(p.read_text(errors="replace"))]
    assert found == []


def gpu_table_rows() -> list[str]:
    text = (REPO / "docs" / "scaling.md").read_text()
    table = text.split("## GPU-only paths", 1)[1]
    return [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| GPU path")]


def test_gpu_only_paths_are_one_table_whose_files_exist():
    rows = gpu_table_rows()
    assert len(rows) >= 10
    named = {name for row in rows for name in re.findall(r"`([\w/]+\.(?:py|sbatch|yaml))", row.split(" | ")[1])}
    assert named
    assert sorted(n for n in named if not any(REPO.glob(f"**/{n}"))) == []
    # The table replaced comments saying "not run here: no GPU ..." all over the package.
    scattered = re.compile("not run " + r"here\W+no GPU", re.I)
    assert [str(p.relative_to(REPO)) for p in (REPO / "posttrain").rglob("*.py") if scattered.search(p.read_text())] == []
