"""The local backend (`cluster.backend: local`): a whole GRPO job in one process, without Ray."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from test_grpo import read_metrics, small_cfg

pytestmark = pytest.mark.functional

REPO = Path(__file__).resolve().parents[2]


def test_a_local_job_imports_no_ray_and_starts_no_process(tmp_path):
    """GRPO steps, checkpoint and validation run in this one process: Ray is never imported and no
    child process is left (the workers and the environment are threads)."""
    script = textwrap.dedent(f"""
        import sys, psutil
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_grpo import small_cfg
        from posttrain.algorithms import grpo
        from pathlib import Path
        cfg = small_cfg(Path({str(tmp_path)!r}), "grpo.max_num_steps=2", "checkpointing.save_period=2",
                        "grpo.val_at_end=true")
        ctx = grpo.setup(cfg)
        names = {{type(w).__name__ for w in ctx.policy.worker_group.workers + ctx.generation.worker_group.workers}}
        grpo.grpo_train(ctx)
        ctx.shutdown()
        print("RAY" if "ray" in sys.modules else "NO RAY", names,
              [p.name() for p in psutil.Process().children(recursive=True)])
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "NO RAY {'LocalActor'} []"
    metrics = read_metrics(tmp_path / "logs")
    assert sorted(metrics) == [1, 2] and 0.0 <= metrics[2]["validation/accuracy_greedy"] <= 1.0
    assert (tmp_path / "ckpt" / "step_2" / "policy" / "model" / ".metadata").is_file()
    assert metrics[1]["timing/startup/to_first_step"] > 0  # the start-up is timed


def test_generation_reads_the_policys_weights_in_place(tmp_path):
    """Refit in one process shares the policy's tensors with the engine: after training the engine
    holds the new weights (checksums equal) without a byte copied, and samples stay on-policy."""
    from posttrain.algorithms import grpo

    ctx = grpo.setup(small_cfg(tmp_path, "cluster.backend=local", "grpo.max_num_steps=2"))
    try:
        grpo.grpo_train(ctx)  # refits before each step's generation (verify_refit=true: checksums)
        weights = ctx.policy.worker_group.run_rank0("live_weights")
        assert ctx.generation.worker_group.run_rank0("share_weights", weights, 3) == 0  # nothing left to copy
        assert ctx.generation.get_weights_checksums() == [ctx.policy.weights_checksum()]
        metrics = read_metrics(tmp_path / "logs")
        assert all(1.0 <= metrics[s]["train/token_mult_prob_error"] < 1.001 for s in (1, 2))
    finally:
        ctx.shutdown()


def test_a_worker_error_names_the_worker_and_the_cause(tmp_path):
    from posttrain.algorithms import grpo
    from posttrain.distributed.worker_group import WorkerError

    ctx = grpo.setup(small_cfg(tmp_path, "cluster.backend=local"))
    try:
        with pytest.raises(WorkerError, match=r"WorkerGroup 'policy': rank 0 \(load_checkpoint, node local, "
                                              r"actor local-\d+\) failed: FileNotFoundError"):
            ctx.policy.load_checkpoint(str(tmp_path / "nowhere"))
    finally:
        ctx.shutdown()


def test_an_int8_engine_requantizes_at_each_refit_and_training_sees_its_gap(tmp_path):
    """`policy.generation.precision=int8`: the importance-sampling correction is on by default; the
    engine keeps the policy's weights beside its int8 copy (verify_refit's checksums pass) and
    quantizes them again at every refit; its logprobs are the int8 engine's, so the mismatch metrics
    exceed the float32 engine's."""
    from posttrain.algorithms import grpo
    from posttrain.models.generation.low_precision import Int8Linear
    from posttrain.models.generation.quantization import quantize_int8_rows

    runs = {}
    for precision in ("float32", "int8"):
        ctx = grpo.setup(small_cfg(tmp_path / precision, "cluster.backend=local", "grpo.max_num_steps=2",
                                   f"policy.generation.precision={precision}"))
        try:
            assert ctx.cfg.loss_fn.use_importance_sampling_correction is (precision == "int8")
            grpo.grpo_train(ctx)  # verify_refit=true: checksums before each step's generation
            runs[precision] = read_metrics(tmp_path / precision / "logs")
            if precision == "int8":
                engine = ctx.generation.worker_group.workers[0]._instance.model  # the local actor's worker
                layers = [m for m in engine.modules() if isinstance(m, Int8Linear)]
                # Move the weights the engine shares with the policy, as an optimizer step does (this
                # tiny run's steps hardly move them: few rewards, so near-zero advantages).
                generator = torch.Generator().manual_seed(0)
                with torch.no_grad():
                    for m in layers:
                        m.weight.add_(0.1 * m.weight.abs().max() * torch.randn(m.weight.shape, generator=generator))
                assert layers and not any(torch.equal(m.weight_q, quantize_int8_rows(m.weight)[0]) for m in layers)
                ctx.generation.worker_group.run_rank0("share_weights", ctx.policy.worker_group.run_rank0("live_weights"), 3)
                for m in layers:  # a refit quantizes them again
                    weight_q, scale = quantize_int8_rows(m.weight)
                    assert torch.equal(m.weight_q, weight_q) and torch.equal(m.weight_scale, scale)
        finally:
            ctx.shutdown()
    for step in (1, 2):
        f32, int8 = runs["float32"][step], runs["int8"][step]
        print(f"\n[step {step}] token_mult_prob_error float32 {f32['train/token_mult_prob_error']:.7f}, int8 "
              f"{int8['train/token_mult_prob_error']:.7f}; gen_kl_error {f32['train/gen_kl_error']:.2e}, "
              f"{int8['train/gen_kl_error']:.2e}")
        assert 1.0 <= f32["train/token_mult_prob_error"] < 1.0001 < int8["train/token_mult_prob_error"]
        assert int8["train/gen_kl_error"] > 100 * abs(f32["train/gen_kl_error"])
