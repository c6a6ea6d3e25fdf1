"""The `posttrain` command: dispatch, exit codes, and no heavy imports before a job starts."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest

from posttrain import cli
from posttrain.config import config_to_yaml, load_config
from posttrain.config.loader import EXAMPLE_CONFIG_DIR


def without_phase_lines(err: str) -> str:
    """stderr without the lines of start-up phases that happened to last (`posttrain.utils.progress`)."""
    return "".join(line for line in err.splitlines(keepends=True) if not line.startswith("[posttrain] "))


def run_posttrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain", *args], capture_output=True, text=True, timeout=120)


def test_print_config_reloads_to_an_equal_config(capsys, tmp_path):
    overrides = ["grpo.max_num_steps=7", "policy.optimizer.lr=2e-5", "loss_fn.ratio_clip_max=0.28"]
    assert cli.main(["grpo", "--print-config", *overrides]) == 0
    printed = capsys.readouterr().out
    expected = load_config("grpo", overrides=overrides)
    assert printed == config_to_yaml(expected, comments=True)
    (tmp_path / "printed.yaml").write_text(printed)
    reloaded = load_config("grpo", tmp_path / "printed.yaml")
    assert reloaded == expected
    assert (reloaded.grpo.max_num_steps, reloaded.policy.optimizer.lr) == (7, 2e-5)


def test_print_config_with_config_file(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("defaults: " + str(EXAMPLE_CONFIG_DIR / "grpo_dapo_tiny.yaml") + "\ngrpo: {seed: 3}\n")
    assert cli.main(["grpo", "--config", str(path), "--print-config"]) == 0
    cfg = load_config("grpo", path)
    assert capsys.readouterr().out == config_to_yaml(cfg, comments=True)
    assert (cfg.grpo.seed, cfg.loss_fn.ratio_clip_max) == (3, 0.28)


def test_config_error_exits_2_with_message_on_stderr(capsys):
    assert cli.main(["sft", "sft.max_num_step=3", "policy.optimizer.lr=abc"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert without_phase_lines(captured.err) == (
        "posttrain sft: 2 config problems:\n"  # in schema order: policy before sft
        "  - Config key 'policy.optimizer.lr' expects a number, got 'abc' (str) (from command line)\n"
        "  - Unknown config key 'sft.max_num_step' (from command line). Did you mean 'sft.max_num_steps'?\n"
    )


def test_job_gets_the_validated_config(monkeypatch):
    received = []
    fake = types.ModuleType("fake_posttrain_job")
    fake.run = received.append
    monkeypatch.setitem(sys.modules, "fake_posttrain_job", fake)
    monkeypatch.setitem(cli.JOBS, "dpo", ("fake_posttrain_job", "run"))
    assert cli.main(["dpo", "dpo.max_num_steps=3"]) == 0
    assert received == [load_config("dpo", overrides=["dpo.max_num_steps=3"])]


def test_async_grpo_is_run_by_its_own_module():
    """The CLI picks the loop (grpo does not import async_grpo, which builds on it), and each
    module's entry point refuses the other's config instead of training the wrong way."""
    from posttrain.algorithms import async_grpo, grpo

    sync = load_config("grpo")
    asynchronous = load_config("grpo", overrides=[
        "grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true",
        "policy.generation.colocated.enabled=false",
    ])
    assert cli.job_target("grpo", sync) == ("posttrain.algorithms.grpo", "run")
    assert cli.job_target("grpo", asynchronous) == ("posttrain.algorithms.async_grpo", "run")
    with pytest.raises(ValueError, match="async_grpo.run needs grpo.async_grpo.enabled=true"):
        async_grpo.run(sync)
    with pytest.raises(ValueError, match="grpo.async_grpo.enabled=true: train with posttrain.algorithms.async_grpo"):
        grpo.grpo_train(types.SimpleNamespace(cfg=asynchronous))


def test_missing_target_module_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(cli.JOBS, "rm", ("posttrain.algorithms.no_such_module", "run"))
    assert cli.main(["rm"]) == 1
    assert without_phase_lines(capsys.readouterr().err) == (
        "posttrain rm is not available yet: module posttrain.algorithms.no_such_module does not exist\n"
    )
    with pytest.raises(cli.Unavailable, match=r"posttrain x is not available yet: posttrain.config has no nope\(\)"):
        cli.load_target("posttrain.config", "nope", "x")


def test_missing_dependency_inside_target_keeps_its_traceback(tmp_path, monkeypatch):
    (tmp_path / "posttrain_broken_job.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        cli.load_target("posttrain_broken_job", "run", "x")


def test_bad_usage_exits_2(capsys):
    for argv in ([], ["trpo"], ["init-model"], ["convert", "--out", "x"], ["init-model", "--out", "x", "--preset", "huge"]):
        with pytest.raises(SystemExit) as excinfo:
            cli.main(argv)
        assert excinfo.value.code == 2, argv
    capsys.readouterr()


def test_subprocess_exit_codes_and_no_heavy_imports(tmp_path):
    result = run_posttrain("--help")
    assert result.returncode == 0 and "init-model" in result.stdout and "grpo" in result.stdout

    result = run_posttrain("grpo", "grpo.num_prompt_per_step=4")
    assert result.returncode == 2
    assert without_phase_lines(result.stderr) == (
        "posttrain grpo: Unknown config key 'grpo.num_prompt_per_step' (from command line). "
        "Did you mean 'grpo.num_prompts_per_step'?\n"
    )

    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("grpo:\n  seed: [1\n")
    result = run_posttrain("grpo", "--config", str(bad_yaml))
    assert result.returncode == 2 and "YAML syntax error in" in result.stderr and "Traceback" not in result.stderr

    # Parsing, validating, printing and failing on config must not import the heavy libraries.
    script = textwrap.dedent("""
        import contextlib, io, sys
        from posttrain.cli import main
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            codes = [main(["grpo", "--print-config", "grpo.max_num_steps=3"]), main(["sft", "bad.key=1"])]
            try:
                main(["--help"])
            except SystemExit as e:
                codes.append(e.code)
        heavy = sorted(m for m in ("torch", "transformers", "ray", "datasets", "math_verify", "matplotlib")
                       if m in sys.modules)
        print(codes, heavy)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[0, 2, 0] []"


def test_init_model_writes_a_loadable_model(tmp_path, capsys):
    pytest.importorskip("posttrain.models.tiny")
    out = tmp_path / "tiny"
    assert cli.main(["init-model", "--preset", "tiny", "--arch", "llama", "--out", str(out), "--seed", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"Wrote llama-tiny model (seed 1) to {out}"
    num_params, completion = cli.greedy_sample(out, cli.SAMPLE_PROMPT)
    assert lines[1] == f"{num_params:,} parameters. Greedy sample (untrained) for {cli.SAMPLE_PROMPT!r}: {completion!r}"
    assert num_params > 0 and (out / "config.json").is_file()


def test_bad_data_during_a_job_is_one_line_naming_file_and_line(tmp_path, monkeypatch, capsys):
    # The job itself is replaced: what is tested is how the CLI reports a DataError it raises.
    from posttrain import cli
    from posttrain.data import datasets

    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{not json\n')
    monkeypatch.setattr(datasets, "fake_job", lambda cfg: datasets.load_jsonl(bad), raising=False)
    monkeypatch.setitem(cli.JOBS, "sft", ("posttrain.data.datasets", "fake_job"))
    assert cli.main(["sft"]) == cli.EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert err.strip() == f"posttrain sft: {bad}:2: invalid JSON: Expecting property name enclosed in double quotes (column 2)"
