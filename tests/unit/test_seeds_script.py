"""`benchmarks/seeds.py`: what it reads from a run's metrics, how it summarises seeds, and the
commands it runs (every showcase's config loads with `seed=S`)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

from posttrain.config.loader import load_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def seeds():
    spec = importlib.util.spec_from_file_location("seeds_script", REPO / "benchmarks" / "seeds.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["seeds_script"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_validation_metrics_are_the_first_and_last_validation_per_metric(seeds, tmp_path):
    rows = [
        {"step": 0, "validation/accuracy_greedy": 0.4, "validation/accuracy_greedy/arith": 0.25,
         "validation_unseen/accuracy_greedy": 0.3, "validation/teacher_accuracy": 0.9, "validation/loss": 1.25,
         "validation/accuracy_greedy_count": 64, "validation/avg_length": 3.0},
        {"step": 1, "train/reward": 0.5},
        {"step": 25, "validation/accuracy_greedy": 0.6, "validation/accuracy_greedy/arith": 0.5,
         "validation_unseen/accuracy_greedy": 0.45, "train/loss": 1.0, "validation/loss": 0.5},
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in rows))
    got = seeds.validation_metrics(metrics)
    assert got["validation/accuracy_greedy@first"] == pytest.approx(40.0)
    assert got["validation/accuracy_greedy@last"] == pytest.approx(60.0)
    assert got["validation/accuracy_greedy@gain"] == pytest.approx(20.0)
    assert got["validation/accuracy_greedy/arith@gain"] == pytest.approx(25.0)
    assert got["validation_unseen/accuracy_greedy@last"] == pytest.approx(45.0)
    assert got["validation/teacher_accuracy@last"] == pytest.approx(90.0)  # a distillation's, measured once
    assert got["validation/loss@first"] == pytest.approx(1.25)  # SFT's loss: as logged, not a percent
    assert got["validation/loss@gain"] == pytest.approx(-0.75)
    assert not any(k.startswith("train/") or "_count" in k or "avg_length" in k for k in got)


def test_summary_is_mean_sample_sd_min_max(seeds):
    values = [61.8, 63.6, 65.4, 84.2]
    got = seeds.summary(values)
    assert got == {"mean": pytest.approx(statistics.fmean(values)), "sd": pytest.approx(statistics.stdev(values)),
                   "min": 61.8, "max": 84.2, "n": 4}
    assert seeds.summary([50.0])["sd"] == 0.0


@pytest.mark.parametrize("name", ["main", "vl", "custom", "ppo", "ppo_async", "dpo", "rm", "distill", "distill_xtok",
                                  "cispo", "grpo_two_steps", "reasoning_gym", "lora", "grpo_v1", "grpo_async", "main_vllm", "vl_vllm",
                                  "length_penalty", "sft", "sft_muon",
                                  "recipe", "gemma_base", "gemma_sft", "gemma_smollm2"])
def test_every_showcase_command_takes_the_seed(seeds, name, tmp_path):
    showcase = seeds.SHOWCASES[name]
    argv = showcase.argv(7, tmp_path)
    assert argv[1:3] == ["-m", "posttrain"] and "seed=7" in argv
    config = argv[argv.index("--config") + 1] if "--config" in argv else None
    overrides = [a for a in argv[3:] if "=" in a]
    cfg = load_config(showcase.command, config, overrides)
    assert cfg.seed == 7
    section = {"grpo": "grpo", "ppo": "grpo", "dpo": "dpo", "rm": "rm", "distill": "distillation",
               "sft": "sft"}[showcase.command]
    assert getattr(cfg, section).seed == 7
    assert cfg.logger.log_dir == f"{tmp_path}/logs"
    if name == "gemma_sft":  # the warm start is reseeded too
        assert cfg.sft_warmup.sft.seed == 7 and cfg.sft_warmup.policy.model_name == "gemma3-270m"
    if name == "gemma_smollm2":
        assert cfg.policy.model_name == "smollm2-135m-instruct" and cfg.sft_warmup is None
    if name == "lora":
        assert cfg.policy.lora.enabled and cfg.policy.optimizer.lr == 1e-3
    if name == "sft_muon":
        assert cfg.policy.optimizer.name == "muon"
    if name == "length_penalty":
        assert cfg.reward_shaping.length_penalty.enabled and cfg.reward_shaping.length_penalty.weight == 0.5
    if name == "grpo_async":
        assert cfg.grpo.async_grpo.enabled and not cfg.policy.generation.colocated.enabled
    if name in ("main_vllm", "vl_vllm"):
        assert cfg.policy.generation.backend == "vllm"
    if name == "vl_vllm":
        assert cfg.policy.model_name == "tiny-vl"


def test_a_keep_directory_holding_a_seed_is_refused_before_any_run(tmp_path):
    """The refusal names the directory and the seed, in one line, and nothing runs (no cache made)."""
    import subprocess

    (tmp_path / "seed_2").mkdir()
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "seeds.py"), "main", "--seeds", "1", "2",
                          "--keep", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip() == (f"[seeds] --keep {tmp_path} already holds seed_2: give another directory or "
                                  "remove them")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seed_2"]


def test_train_means_average_the_first_and_last_steps_that_logged_the_metric(seeds, tmp_path):
    rows = [{"step": 0, "validation/accuracy_greedy": 0.4}]
    rows += [{"step": i, "train/approx_entropy": float(i), "train/reward": 0.5} for i in range(1, 26)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in rows))
    got = seeds.train_means(metrics, ("train/approx_entropy", "train/missing"))
    assert got == {"train/approx_entropy@first": pytest.approx(5.5),   # steps 1-10
                   "train/approx_entropy@last": pytest.approx(20.5)}   # steps 16-25
    assert seeds.train_means(metrics, ("train/approx_entropy",), window=3)["train/approx_entropy@last"] == 24.0


def saved_runs(path: Path, seeds_to_gains: dict[int, float], kernels: str = "avx2") -> Path:
    path.write_text(json.dumps({"showcase": "recipe", "cpu": "x", "kernels": kernels, "seeds": list(seeds_to_gains),
                                "overrides": [], "failed": [], "summary": {},
                                "runs": {str(s): {"seconds": 100.0 * s, "validation/accuracy_greedy@gain": g}
                                         for s, g in seeds_to_gains.items()}}))
    return path


def test_combine_summarises_the_runs_of_several_json_files(seeds, tmp_path):
    import subprocess

    one = saved_runs(tmp_path / "one.json", {1: 32.0})
    two = saved_runs(tmp_path / "two.json", {3: 30.0, 2: 28.0})
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "seeds.py"), "--combine", str(one), str(two),
                          "--json", str(tmp_path / "all.json")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    written = json.loads((tmp_path / "all.json").read_text())
    assert written["seeds"] == [1, 2, 3]
    gain = written["summary"]["validation/accuracy_greedy@gain"]
    assert gain["n"] == 3 and gain["mean"] == pytest.approx(30.0) and gain["sd"] == pytest.approx(2.0)
    assert written["summary"]["seconds"]["max"] == 300.0
    assert "validation/accuracy_greedy@gain" in out.stdout and "30.0" in out.stdout
    again = saved_runs(tmp_path / "four.json", {4: 30.0})  # a combined file combines again
    assert list(seeds.combined_runs([tmp_path / "all.json", again])[1]) == [1, 2, 3, 4]


@pytest.mark.parametrize("second, says", [
    ({1: 30.0}, "seeds [1] are in an earlier file too"),
    ({2: 30.0, "kernels": "native"}, "differs from the first file's"),
])
def test_combine_refuses_files_that_do_not_add_up(seeds, tmp_path, second, says):
    kernels = second.pop("kernels", "avx2")
    one = saved_runs(tmp_path / "one.json", {1: 32.0})
    two = saved_runs(tmp_path / "two.json", second, kernels=kernels)
    with pytest.raises(SystemExit) as refused:
        seeds.combined_runs([one, two])
    assert str(two) in str(refused.value) and says in str(refused.value)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match="bad.json: not a --json file of this script"):
        seeds.combined_runs([tmp_path / "bad.json"])
    with pytest.raises(SystemExit, match="missing.json: cannot read it \\(No such file or directory\\)"):
        seeds.combined_runs([tmp_path / "missing.json"])
