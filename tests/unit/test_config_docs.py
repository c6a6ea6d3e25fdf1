"""Every config key says what it does: the schema describes each key (and each section), and
`--print-config` shows those descriptions as comments in YAML that loads back to the same config."""

from __future__ import annotations

import re
import typing

import pytest
from pydantic import BaseModel

from posttrain.config import config_to_yaml, load_config
from posttrain.config.schema import SCHEMAS


def sections_and_keys():
    seen, sections, keys = set(), [], []

    def models(annotation):
        return [u for t in (annotation, *typing.get_args(annotation)) for u in (t, *typing.get_args(t))
                if isinstance(u, type) and issubclass(u, BaseModel)]

    def walk(cls):
        if cls in seen:
            return
        seen.add(cls)
        sections.append(cls)
        for name, field in cls.model_fields.items():
            nested = models(field.annotation)
            for model in nested:
                walk(model)
            if not nested:
                keys.append((cls, name, field))

    for schema in SCHEMAS.values():
        walk(schema)
    return sections, keys


def test_every_key_and_section_is_described():
    sections, keys = sections_and_keys()
    assert len(keys) > 150
    assert [f"{cls.__name__}.{name}" for cls, name, field in keys if not (field.description or "").strip()] == []
    assert [cls.__name__ for cls in sections if not (cls.__doc__ or "").strip()] == []


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
