"""Every config key says what it does: the schema describes each key (and each section), and
`--print-config` shows those descriptions as comments in YAML that loads back to the same config."""

from __future__ import annotations

import re

import pytest

from posttrain.config import all_keys, config_to_yaml, load_config
from posttrain.config.reference import config_reference_markdown, walk_schemas
from posttrain.config.schema import SCHEMAS


def test_every_key_and_section_is_described():
    sections, keys = walk_schemas()
    assert len(keys) > 150
    assert [f"{cls.__name__}.{name}" for cls, name, field in keys if not (field.description or "").strip()] == []
    assert [doc.cls.__name__ for doc in sections if not (doc.cls.__doc__ or "").strip()] == []


def reference_tables() -> dict[str, set[str]]:
    """Heading id -> the keys in that section's table, read back from the generated page."""
    tables, current = {}, None
    for line in config_reference_markdown().splitlines():
        heading = re.match(r"## .*\{#([\w-]+)\}$", line)
        if heading:
            current = tables.setdefault(heading.group(1), set())
        elif current is not None and (row := re.match(r"\| `(\w+)` \|", line)):
            current.add(row.group(1))
    return tables


def test_the_reference_page_lists_every_key_of_every_command_in_its_section():
    sections, _ = walk_schemas()
    tables = reference_tables()
    anchor_at = {}
    for doc in sections:
        for command in doc.commands:
            for path in doc.paths:
                anchor_at.setdefault((command, path), doc.anchor)
    missing = []
    for command, schema in SCHEMAS.items():
        for key in all_keys(schema):
            if key.split(".")[0] in ("sft_warmup", "teacher_warmup"):
                continue  # a whole `posttrain sft` config: its own command's keys
            parent, _, name = key.rpartition(".")
            anchor = anchor_at.get((command, parent)) if parent else None
            table = tables.get(anchor) if anchor else {n for n in schema.model_fields}
            if table is None or name not in table:
                missing.append(f"{command}: {key}")
    assert missing == []
    # Two classes at one path, GRPO's and distillation's `loss_fn`, get a table each.
    assert "ratio_clip_max" in tables["cfg-loss-fn"] and "ratio_clip_max" not in tables["cfg-loss-fn-distill"]
    assert "kl_type" in tables["cfg-loss-fn-distill"]


@pytest.mark.parametrize("algo", sorted(SCHEMAS))
def test_print_config_comments_every_key_and_loads_back(algo, tmp_path):
    cfg = load_config(algo, overrides=["logger.log_dir=somewhere"])
    text = config_to_yaml(cfg, comments=True)
    path = tmp_path / "printed.yaml"
    path.write_text(text)
    assert load_config(algo, path) == cfg
    # A key's line follows its description.
    assert re.search(r"\n( +)# Tokens generated per turn at most[^\n]*\n\1max_new_tokens: \d+\n", text)
    assert "# Directory of metrics.jsonl" in text and "log_dir: somewhere" in text
    assert text == config_to_yaml(load_config(algo, path), comments=True)


def test_the_embedded_default_configs_ship_in_the_wheel(tmp_path):
    """Default YAMLs are package data (posttrain/configs), not found through the repository layout."""
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    from posttrain.config.loader import DEFAULT_CONFIGS, EXAMPLE_CONFIG_DIR

    repo = Path(__file__).resolve().parents[2]
    assert EXAMPLE_CONFIG_DIR.parent.name == "posttrain"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(repo)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("posttrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"posttrain/configs/{name}" for name in DEFAULT_CONFIGS.values()} <= names
