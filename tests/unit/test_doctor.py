"""`posttrain doctor` (`posttrain/doctor.py`): one line per cache entry, broken ones fail the
check, `--fix` removes exactly those, and a build in progress is left alone."""

from __future__ import annotations

import json
import os
from pathlib import Path

from posttrain import cli, doctor
from posttrain.utils.cache import write_manifest


def model_dir(path: Path) -> Path:
    """A complete model entry as the cache holds one: its files and, last, its manifest (the files'
    contents are not read)."""
    path.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (path / name).write_text("{}")
    write_manifest(path, {"kind": "test"})
    return path


def cache_lines(out: str) -> dict[str, tuple[str, str]]:
    """The cache's lines by entry: {"models/x": (status, the rest of the line)}."""
    rows = {}
    for line in out.splitlines():
        status, item, detail = line.split(maxsplit=2)
        if item == "cache" and not detail.startswith("/"):  # not the summary line naming the cache
            words = detail.split()
            entry = words[1] if status == doctor.FIXED else words[0]
            rows[entry.rstrip(":")] = (status, detail)
    return rows


def test_doctor_reports_each_entry_fails_on_broken_ones_and_fix_removes_exactly_those(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    healthy = model_dir(cache / "models" / "llama-tiny")
    (model_dir(cache / "models" / "llama-small") / "model.safetensors").unlink()
    leftover = cache / "models" / ".tmp-x"
    leftover.mkdir()
    env = cache / "envs" / "vllm-cpu-0123456789abcdef"
    env.mkdir(parents=True)
    (env / "posttrain-env.json").write_text("{}")  # no bin/python: an unfinished environment
    (cache / "envs" / "vllm-cpu-0123456789abcdef.lock").write_text("")  # files beside entries are not entries
    monkeypatch.setenv("POSTTRAIN_CACHE", str(cache))

    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert f"ok     cache         {cache}: 4 entries, 3 broken" in out.splitlines()
    rows = cache_lines(out)
    assert set(rows) == {"models/llama-tiny", "models/llama-small", "models/.tmp-x", "envs/vllm-cpu-0123456789abcdef"}
    assert rows["models/llama-tiny"][0] == doctor.OK
    assert rows["models/llama-small"] == (doctor.FAIL, "models/llama-small: model.safetensors is missing "
                                          "(posttrain doctor --fix removes it)")
    assert rows["models/.tmp-x"][0] == doctor.FAIL and "leftover of an interrupted build" in rows["models/.tmp-x"][1]
    assert rows["envs/vllm-cpu-0123456789abcdef"][0] == doctor.FAIL and "no bin/python" in rows["envs/vllm-cpu-0123456789abcdef"][1]
    # Every other check ran too, one line each (none fails on a machine that runs the tests).
    items = [line.split()[1] for line in out.splitlines()]
    assert {"python", "torch", "transformers", "ray", "sandbox", "gpus", "vllm", "disk"} <= set(items)
    assert [line for line in out.splitlines() if line.startswith(doctor.FAIL) and " cache " not in line] == []

    assert cli.main(["doctor", "--fix"]) == 0
    rows = cache_lines(capsys.readouterr().out)
    assert {entry for entry, (status, _) in rows.items() if status == doctor.FIXED} == \
        {"models/llama-small", "models/.tmp-x", "envs/vllm-cpu-0123456789abcdef"}
    assert rows["models/llama-small"][1].startswith("removed models/llama-small: model.safetensors is missing")
    assert sorted(p.name for p in cache.glob("*/*") if p.is_dir()) == ["llama-tiny"]
    assert healthy.is_dir() and (cache / "envs" / "vllm-cpu-0123456789abcdef.lock").is_file()
    assert cli.main(["doctor"]) == 0
    assert set(cache_lines(capsys.readouterr().out)) == {"models/llama-tiny"}


def test_a_build_of_a_live_process_is_left_alone_and_a_dead_ones_is_garbage(tmp_path):
    models = tmp_path / "models"
    live = models / f".tmp-llama-tiny-{os.getpid()}-0a1b2c3d"
    live.mkdir(parents=True)
    checkpoint = tmp_path / "checkpoint_hf" / f"0123456789abcdef.tmp{os.getpid()}"  # converted_checkpoint's name
    checkpoint.mkdir(parents=True)
    dead = models / ".tmp-llama-tiny-999999999-0a1b2c3d"  # no such process
    dead.mkdir()
    stale = models / ".stale-llama-tiny-0a1b2c3d"
    stale.mkdir()
    assert doctor.building_pid(live.name) == os.getpid() and doctor.entry_problem(live) is None
    assert doctor.building_pid(checkpoint.name) == os.getpid() and doctor.entry_problem(checkpoint) is None
    assert doctor.entry_problem(dead) == "leftover of an interrupted build"
    assert doctor.entry_problem(stale) == "leftover of a replaced entry"
    findings = doctor.check_cache(tmp_path, fix=True)
    assert [f.status for f in findings].count(doctor.FIXED) == 2
    assert live.is_dir() and checkpoint.is_dir() and not dead.exists() and not stale.exists()
    assert any(f"being built by process {os.getpid()}" in f.detail for f in findings)


def test_an_environments_links_to_the_main_one_are_checked_and_kept_while_it_lives(tmp_path):
    main = tmp_path / "main-site"
    (main / "torch").mkdir(parents=True)
    envs = tmp_path / "envs"

    def environment(name: str) -> Path:
        env, links = envs / name, envs / "shared" / name
        (env / "bin").mkdir(parents=True)
        (env / "bin" / "python").write_text("")
        links.mkdir(parents=True)
        (links / "torch").symlink_to(main / "torch")
        (env / "posttrain-env.json").write_text(json.dumps({"shared_links": str(links)}))
        return links

    healthy, broken = environment("vllm-cpu-0000000000000000"), environment("vllm-cpu-1111111111111111")
    (broken / "ray").symlink_to(main / "ray")  # the main environment no longer has it
    orphan = envs / "shared" / "vllm-cpu-2222222222222222"  # its environment was deleted
    orphan.mkdir()
    building = envs / "shared" / "vllm-cpu-3333333333333333"
    building.mkdir()
    (envs / f".vllm-cpu-3333333333333333.tmp-{os.getpid()}-0a1b2c3d").mkdir()
    assert doctor.entry_problem(envs / "vllm-cpu-0000000000000000") is None
    assert doctor.entry_problem(envs / "vllm-cpu-1111111111111111") == (
        "its links to the main environment are broken (ray): the main environment changed")
    assert doctor.shared_links_problem(healthy) is None and doctor.shared_links_problem(building) is None
    assert doctor.shared_links_problem(orphan) == "links of an environment that is gone"
    findings = doctor.check_cache(tmp_path, fix=True)
    fixed = sorted(f.detail.split()[1].rstrip(":") for f in findings if f.status == doctor.FIXED)
    # The broken environment goes, then its links (listed after the environments), and the orphan.
    assert fixed == ["envs/shared/vllm-cpu-1111111111111111", "envs/shared/vllm-cpu-2222222222222222",
                     "envs/vllm-cpu-1111111111111111"]
    assert healthy.is_dir() and building.is_dir() and (main / "torch").is_dir()
    assert sorted(p.name for p in (envs / "shared").iterdir()) == ["vllm-cpu-0000000000000000", "vllm-cpu-3333333333333333"]


def test_a_model_entry_is_judged_by_its_manifest_as_jobs_judge_it(tmp_path):
    path = tmp_path / "sft_warmup" / "0123456789ab"
    path.mkdir(parents=True)
    for name in ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "tokenizer.json"):
        (path / name).write_text("{}")
    assert doctor.entry_problem(path).startswith("no posttrain-entry.json")  # an unfinished export
    write_manifest(path, {"kind": "test"})
    assert doctor.entry_problem(path) is None
    (path / "model-00002-of-00002.safetensors").unlink()
    assert doctor.entry_problem(path) == "model-00002-of-00002.safetensors is missing"
    (path / "model-00002-of-00002.safetensors").write_text("")  # truncated
    assert doctor.entry_problem(path) == "model-00002-of-00002.safetensors has 0 bytes, 2 when it was published"


def test_doctor_fails_naming_the_install_when_an_essential_cannot_be_imported(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ModuleNotFoundError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(__import__("sys").modules, "ray", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_ray)
    ray = next(f for f in doctor.check_packages() if f.item == "ray")
    assert ray.status == doctor.FAIL and ray.detail.endswith("pip install ray==2.60.0")
