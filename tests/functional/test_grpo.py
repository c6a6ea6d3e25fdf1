"""GRPO end to end with real Ray workers and a real tiny model (a few steps each)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import torch

from posttrain.config.loader import load_config, save_config
from posttrain.environments.interface import Environment, EnvironmentReturn

pytestmark = pytest.mark.functional

REPO = Path(__file__).resolve().parents[2]
PLUGIN_ENVS = Path(__file__).with_name("plugin_envs.py")


def plugin_env(name: str) -> str:
    """The override that serves the math task with `name` from plugin_envs.py, as a user would."""
    return f"env.math.class_path={PLUGIN_ENVS}:{name}"

# Small but real: 4 prompts x 4 generations, 8 new tokens, tiny llama built locally.
SMALL = [
    "sft_warmup=null",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.max_num_steps=3",
    "grpo.val_period=0",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "grpo.max_val_samples=8",
    "policy.model_name=tiny",
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=8",
    "policy.logprob_batch_size=8",
    "policy.max_total_sequence_length=32",
    "policy.generation.max_new_tokens=6",
    "policy.generation.verify_refit=true",
    "data.num_train=64",
    "data.num_validation=8",
    "logger.progress_bar=false",
    "logger.report=false",
    "logger.tensorboard_enabled=false",
]


def small_cfg(tmp_path: Path, *extra: str):
    return load_config(
        "grpo",
        overrides=[*SMALL, f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt", *extra],
    )


def read_metrics(log_dir: Path) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row["step"], {}).update(row)
    return steps


class TwoTurnEnv(Environment):
    """Turn 1: answer with an observation and continue; turn 2: reward 1 and stop."""

    OBSERVATION = "<|user|>again<|end|><|assistant|>"

    def step(self, message_logs, metadata):
        n = len(message_logs)
        turns = [sum(m["role"] == "assistant" for m in log) for log in message_logs]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": self.OBSERVATION if t == 1 else ""} for t in turns],
            metadata=list(metadata), next_stop_strings=[None] * n,
            rewards=torch.tensor([0.0 if t == 1 else 1.0 for t in turns]),
            terminateds=torch.tensor([t >= 2 for t in turns]), answers=[None] * n,
        )


@pytest.fixture
def grpo_context(ray_cluster, tmp_path):
    """A set-up GRPO run (policy, generation, math env) torn down after the test."""
    from posttrain.algorithms import grpo

    contexts = []

    def make(*extra: str):
        ctx = grpo.setup(small_cfg(tmp_path, *extra))
        contexts.append(ctx)
        return ctx

    yield make
    for ctx in contexts:
        ctx.shutdown()


REQUIRED = [
    "train/reward", "train/loss", "train/grad_norm", "train/kl_penalty", "train/approx_entropy",
    "train/token_mult_prob_error", "train/gen_kl_error", "train/advantages/mean", "train/advantages/min",
    "train/advantages/max", "train/mean_gen_tokens_per_sample", "train/lr",
    "timing/train/generation", "timing/train/refit", "timing/train/logprobs", "timing/train/policy_training",
    "timing/train/reward", "timing/train/total_step_time",
]


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_grpo_steps_report_metrics_and_logprobs_agree(grpo_context, tmp_path, backend):
    from posttrain.algorithms import grpo

    ctx = grpo_context("grpo.val_at_start=true", "grpo.val_at_end=true", "loss_fn.reference_policy_kl_penalty=0.01",
                       f"cluster.backend={backend}")
    grpo.grpo_train(ctx)
    metrics = read_metrics(tmp_path / "logs")
    assert sorted(metrics) == [0, 1, 2, 3]
    assert 0.0 <= metrics[0]["validation/accuracy_greedy"] <= 1.0
    for step in (1, 2, 3):
        row = metrics[step]
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, f"step {step} lacks {missing}"
        # Same weights in the generation engine and the trainer: the mismatch is numerical only.
        assert 1.0 <= row["train/token_mult_prob_error"] < 1.001
        assert abs(row["train/gen_kl_error"]) < 1e-3
        assert row["train/num_samples"] == 16
        parts = ["generation", "refit", "logprobs", "policy_training", "reward"]
        # The breakdown's parts are disjoint sections of the step: they add up to at most the total.
        assert sum(row[f"timing/train/{p}"] for p in parts) <= row["timing/train/total_step_time"] + 1e-6
    assert "validation/accuracy_greedy" in metrics[3]
    assert (tmp_path / "logs" / "config.yaml").exists()
    assert (tmp_path / "ckpt" / "step_3" / "training_info.json").exists()


def test_previous_logprobs_are_recomputed_only_for_several_optimizer_steps(grpo_context, tmp_path):
    from posttrain.algorithms import grpo

    # CoinEnv: rewards with variance, so non-zero advantages, so updates move the policy.
    # A constant lr: the run is extended to a second step below, past a decay horizon of one step.
    ctx = grpo_context("grpo.max_num_steps=1", "policy.optimizer.lr=1e-3", "policy.scheduler.name=constant",
                       plugin_env("CoinEnv"))
    calls = []
    get_logprobs = ctx.policy.get_logprobs
    ctx.policy.get_logprobs = lambda *a, **k: calls.append(1) or get_logprobs(*a, **k)

    grpo.grpo_train(ctx)  # 16 rows, train_global_batch_size 16: one optimizer step, no recompute
    assert calls == []
    one = read_metrics(tmp_path / "logs")[1]
    assert one["train/probs_ratio_min"] == one["train/probs_ratio_max"] == 1.0

    ctx.cfg.grpo.max_num_steps, ctx.cfg.policy.train_global_batch_size = 2, 8  # two optimizer steps
    grpo.grpo_train(ctx)
    assert calls == [1]
    two = read_metrics(tmp_path / "logs")[2]
    # The second optimizer step sees a policy one update away from the one that generated.
    assert two["train/probs_ratio_min"] < 1.0 < two["train/probs_ratio_max"], two
    assert 1.0 <= two["train/token_mult_prob_error"] < 1.001  # prev from the trainer, before any update


def test_dynamic_sampling_refills_a_full_batch(grpo_context):
    from posttrain.algorithms import grpo
    from posttrain.utils.timer import Timer

    ctx = grpo_context("grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=8",
                       plugin_env("CoinEnv"))
    train_data, metrics = grpo.collect_experience(ctx, 1, Timer())
    # About half of every generation batch (even answers) has zero variance and is dropped, so
    # a full batch needs at least two generation batches; it is then exactly full.
    assert metrics["train/dynamic_sampling_num_gen_batches"] >= 2
    assert train_data.size == 16
    assert train_data["sample_mask"].sum() == 16
    # Every kept group has reward variance, so its advantages are not all zero.
    adv = (train_data["advantages"].sum(dim=1) / train_data["token_mask"].sum(dim=1).clamp(min=1)).view(4, 4)
    assert (adv.abs().sum(dim=1) > 0).all(), adv


def test_multi_turn_rollout_masks_only_generated_tokens(grpo_context):
    from posttrain.data.message_log import flatten_message_logs
    from posttrain.rollouts import run_multi_turn_rollout

    ctx = grpo_context()
    datums = [d.fresh_copy() for d in ctx.train_loader.items[:3]]
    result = run_multi_turn_rollout(
        ctx.generation, datums, ctx.tokenizer, {"math": TwoTurnEnv()}, max_seq_len=64, max_rollout_turns=4,
        seeds=torch.arange(3),
    )
    assert result.rewards.tolist() == [1.0, 1.0, 1.0]
    assert result.metrics["avg_turns_per_sample"] == 2.0
    assert [d.reward for d in datums] == [1.0, 1.0, 1.0]
    batch = flatten_message_logs([d.message_log for d in datums], pad_token_id=ctx.tokenizer.pad_token_id)
    for row, d in enumerate(datums):
        roles = [m["role"] for m in d.message_log]
        assert roles == ["user", "assistant", "environment", "assistant"]
        expected = torch.cat([
            torch.full((len(m["token_ids"]),), 1.0 if m["role"] == "assistant" else 0.0) for m in d.message_log
        ])
        n = len(expected)
        assert torch.equal(batch["token_mask"][row, :n], expected)
        assert batch["token_mask"][row, n:].sum() == 0
        env_msg = d.message_log[2]
        assert env_msg["content"] == TwoTurnEnv.OBSERVATION and "generation_logprobs" not in env_msg
        # Generated tokens keep their ids and logprobs (never re-tokenised).
        for m in d.message_log[1::2]:
            assert len(m["generation_logprobs"]) == len(m["token_ids"])
            assert (m["generation_logprobs"] <= 0).all()


def _run_cli(cfg_path: Path, log: Path, **env_vars: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_vars}
    return subprocess.Popen(
        [sys.executable, "-m", "posttrain", "grpo", "--config", str(cfg_path)],
        cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
    )


# An uninterrupted reference run goes in this process (the local backend) with the one torch thread a
# Ray worker computes with (`cluster.cpus_per_worker`'s default with Ray): the same code at world
# size 1, so the same weights and metrics bit for bit (measured), less the `recovery/*` counters the
# local backend does not log, without starting a policy, a generation and an environment actor.
IN_PROCESS = ["cluster.backend=local", "cluster.cpus_per_worker=1"]


@contextmanager
def keeping_torch_threads():
    """This process's torch thread count, put back after an in-process run set its own."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _comparable(metrics: dict[int, dict]) -> dict[int, dict]:
    return {s: {k: v for k, v in row.items() if not k.startswith(("timing/", "memory/"))} for s, row in metrics.items()}


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_kill_and_resume_reproduces_uninterrupted_metrics(tmp_path, capfd, request, backend):
    """SIGKILL a `posttrain grpo` process after its step-2 checkpoint; rerunning the same command
    resumes and logs exactly the metrics an uninterrupted run logs. With Ray, the killed controller's
    Ray processes go too; the local backend starts none. Only the killed run needs a process (and,
    with Ray, a cluster) of its own: the uninterrupted run and the rerun run in this process
    (`cli.main`, the rerun on the session's Ray), two interpreters and Ray clusters fewer to start.
    With Ray, the uninterrupted run is the same command on the local backend with a Ray worker's one
    torch thread (`IN_PROCESS`): bit for bit a Ray run's metrics, less its `recovery/*` counters
    (all 0 without a failure, checked on the rerun), without a set of actors to start."""
    from posttrain import cli

    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    runs = {}
    for name in ("straight", "killed"):
        in_process = IN_PROCESS if backend == "ray" and name == "straight" else []
        cfg = small_cfg(tmp_path / name, "grpo.max_num_steps=4", "checkpointing.save_period=2",
                        f"cluster.backend={backend}", *in_process, plugin_env("HoldAfterCheckpointEnv"))
        path = tmp_path / f"{name}.yaml"
        save_config(cfg, path)
        runs[name] = (path, tmp_path / name)

    step2 = runs["killed"][1] / "ckpt" / "step_2" / "training_info.json"
    # The killed run's step 3 waits while `hold` exists, so the kill lands between the step-2
    # checkpoint and step 3 on any machine (a fast run once finished step 4 before the kill).
    # Without the two variables (this process's runs) the environment is the math environment.
    hold = tmp_path / "hold"
    hold.touch()
    killed = _run_cli(runs["killed"][0], tmp_path / "killed.log", HOLD=str(hold), HOLD_AFTER=str(step2))
    # The uninterrupted run meanwhile: the killed one cannot get past its step-2 checkpoint.
    with keeping_torch_threads():
        assert cli.main(["grpo", "--config", str(runs["straight"][0])]) == 0
    deadline = time.time() + 400
    while not step2.exists():
        assert killed.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
        assert time.time() < deadline, "no step-2 checkpoint in time"
        time.sleep(0.2)
    ray_processes = [p for p in psutil.Process(killed.pid).children(recursive=True)]
    assert any("raylet" in " ".join(p.cmdline()) for p in ray_processes) == (backend == "ray")
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    # The reaper takes the killed controller's Ray processes down within seconds (Ray's own
    # agents would linger for about a minute; 40 s leaves a busy machine room and still tells them apart).
    _, alive = psutil.wait_procs(ray_processes, timeout=40)
    assert not alive, [" ".join(p.cmdline())[:80] for p in alive]
    assert sorted(read_metrics(runs["killed"][1] / "logs")) == [1, 2]  # held at step 3
    hold.unlink()
    capfd.readouterr()
    assert cli.main(["grpo", "--config", str(runs["killed"][0])]) == 0
    assert "resumed from" in "".join(capfd.readouterr()).lower()

    expected = _comparable(read_metrics(runs["straight"][1] / "logs"))
    got = _comparable(read_metrics(runs["killed"][1] / "logs"))
    assert sorted(expected) == [1, 2, 3, 4]
    if backend == "ray":  # the in-process uninterrupted run logs no recovery counters; the rerun's are 0
        counters = {k: v for row in got.values() for k, v in row.items() if k.startswith("recovery/")}
        assert counters and all(value == 0 for value in counters.values()), counters
        got = {step: {k: v for k, v in row.items() if not k.startswith("recovery/")} for step, row in got.items()}
    assert got == expected


PRESETS = ["grpo_dapo_tiny", "grpo_gspo_tiny", "grpo_drgrpo_tiny", "grpo_cispo_tiny"]


def test_loss_presets_run_from_their_example_configs(grpo_context, tmp_path):
    """One GRPO step with each preset's loss and algorithm settings (workers shared to save time:
    the presets differ only in the grpo / loss_fn / reward_shaping sections)."""
    from posttrain.algorithms import grpo
    from posttrain.algorithms.loss import ClippedPGLoss

    ctx = grpo_context()
    for i, preset in enumerate(PRESETS, start=1):
        cfg = load_config(
            "grpo", REPO / "examples" / "configs" / f"{preset}.yaml",
            overrides=[*SMALL, f"grpo.max_num_steps={i}", f"logger.log_dir={tmp_path}/logs",
                       f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
                       # An untrained model earns no reward, so dynamic sampling (tested above)
                       # would drop every group: keep the batch to check the loss itself.
                       "grpo.use_dynamic_sampling=false"],
        )
        assert cfg.policy.model_dump(exclude={"scheduler"}) == ctx.cfg.policy.model_dump(exclude={"scheduler"})
        ctx.cfg, ctx.loss_fn = cfg, ClippedPGLoss(cfg.loss_fn)
        ctx.loop.cfg, ctx.loop.schedule = cfg, cfg.grpo
        grpo.grpo_train(ctx)
        row = read_metrics(tmp_path / "logs")[i]
        assert 1.0 <= row["train/token_mult_prob_error"] < 1.001, preset
        # Each step's first pass is on-policy: ratios are 1 up to float error.
        assert row["train/probs_ratio_min"] > 0.99 and row["train/probs_ratio_max"] < 1.01, preset
    dapo, gspo, drgrpo, cispo = (load_config("grpo", REPO / "examples" / "configs" / f"{p}.yaml") for p in PRESETS)
    assert dapo.loss_fn.ratio_clip_max == 0.28 and dapo.reward_shaping.enabled and dapo.grpo.use_dynamic_sampling
    assert gspo.loss_fn.sequence_level_importance_ratios and not gspo.loss_fn.token_level_loss
    assert not drgrpo.grpo.normalize_rewards and drgrpo.loss_fn.token_level_loss
    assert cispo.loss_fn.use_cispo and cispo.loss_fn.token_level_loss


def test_nan_loss_stops_the_run_and_keeps_the_last_checkpoint(grpo_context, tmp_path):
    from posttrain.algorithms import grpo

    ctx = grpo_context("grpo.max_num_steps=1", "checkpointing.save_period=1", plugin_env("NaNAfterFirstCallEnv"))
    grpo.grpo_train(ctx)
    step1 = tmp_path / "ckpt" / "step_1"
    info_before = (step1 / "training_info.json").read_text()
    weights_before = ctx.policy.weights_checksum()

    ctx.cfg.grpo.max_num_steps = 2  # the environment's rewards are NaN from now on
    with pytest.raises(Exception, match=r"(?i)non-finite|nan"):
        grpo.grpo_train(ctx)
    assert ctx.policy.weights_checksum() == weights_before  # no optimizer step on a NaN loss
    assert (step1 / "training_info.json").read_text() == info_before
    assert not (tmp_path / "ckpt" / "step_2").exists()
    assert ctx.loop.checkpointer.latest() == step1


PARTIAL = [
    "cluster.backend=local", "grpo.max_num_steps=4", "checkpointing.save_period=2",
    "loss_fn.use_importance_sampling_correction=true", "grpo.partial_rollouts.enabled=true",
    "grpo.partial_rollouts.chunk_tokens=2", "grpo.partial_rollouts.min_complete_fraction=0.25",
    # An untrained tiny model rarely samples eos: a fifth of its vocabulary ends a sequence too,
    # so lengths vary and groups finish at different chunks.
    "policy.generation.stop_token_ids=[" + ",".join(str(i) for i in range(40, 60)) + "]",
]


def _partial_run_resumes_exactly(tmp_path, monkeypatch, *extra: str) -> list[dict]:
    """Four steps with partial rollouts (`PARTIAL` and `extra`), then the same run stopped after
    its step-2 checkpoint and resumed: the resumed run logs exactly the uninterrupted run's
    metrics. The uninterrupted run's rows."""
    from posttrain.algorithms import grpo

    straight = grpo.setup(small_cfg(tmp_path / "straight", *PARTIAL, *extra))
    try:
        grpo.grpo_train(straight)
    finally:
        straight.shutdown()
    expected = _comparable(read_metrics(tmp_path / "straight" / "logs"))
    assert sorted(expected) == [1, 2, 3, 4]
    rows = [expected[step] for step in (1, 2, 3, 4)]
    assert sum(r["train/partial_rollouts/carried_over_sequences"] for r in rows) > 0
    assert sum(r["train/partial_rollouts/mixed_version_sequences"] for r in rows) > 0
    for before, after in zip(rows, rows[1:]):  # what a step carries over, the next resumes (none too old)
        assert after["train/partial_rollouts/resumed_sequences"] == before["train/partial_rollouts/carried_over_sequences"]
    assert all(r["train/partial_rollouts/dropped_too_old_sequences"] == 0 for r in rows)
    assert (tmp_path / "straight" / "ckpt" / "step_2" / "partial_rollouts.pt").exists()

    step_fn = grpo.grpo_step

    def stops_at_step_3(ctx, step, timer):
        if step == 3:
            raise KeyboardInterrupt("stopped after the step-2 checkpoint")
        return step_fn(ctx, step, timer)

    stopped = grpo.setup(small_cfg(tmp_path / "stopped", *PARTIAL, *extra))
    monkeypatch.setattr(grpo, "grpo_step", stops_at_step_3)
    try:
        with pytest.raises(KeyboardInterrupt):
            grpo.grpo_train(stopped)
    finally:
        stopped.shutdown()
    monkeypatch.setattr(grpo, "grpo_step", step_fn)
    resumed = grpo.setup(small_cfg(tmp_path / "stopped", *PARTIAL, *extra))
    try:
        assert resumed.step == 2
        assert len(resumed.partial_rollouts.carried) == expected[2]["train/partial_rollouts/carried_over_groups"]
        grpo.grpo_train(resumed)
    finally:
        resumed.shutdown()
    assert _comparable(read_metrics(tmp_path / "stopped" / "logs")) == expected
    return rows


def test_partial_rollouts_carry_sequences_over_and_resume_exactly(tmp_path, monkeypatch):
    """Carried-over sequences' tokens span two weight versions; a resumed run continues exactly."""
    _partial_run_resumes_exactly(tmp_path, monkeypatch)


def test_partial_rollouts_carry_multi_turn_episodes_over_and_resume_exactly(tmp_path, monkeypatch):
    """Three-turn episodes (`ThreeTurnEnv`, its turn count in the metadata) paused inside their
    later turns carry over with their conversation so far, continue under the new weights and
    resume exactly from a checkpoint."""
    rows = _partial_run_resumes_exactly(tmp_path, monkeypatch, "grpo.max_rollout_turns=3", plugin_env("ThreeTurnEnv"),
                                        "policy.max_total_sequence_length=96", "grpo.partial_rollouts.max_age_steps=4",
                                        "grpo.partial_rollouts.min_complete_fraction=0.5")
    # The step-2 checkpoint holds episodes paused after their first turn (the resume goes through them).
    assert rows[1]["train/partial_rollouts/carried_over_later_turn_sequences"] > 0
    assert all(r["train/avg_turns_per_sample"] > 1 for r in rows)
