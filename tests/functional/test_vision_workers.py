"""The tiny vision-language model (`tiny-vl`) on two real policy workers (Ray, gloo, CPU): logprobs
on image rows, and one SGD step equal to plain transformers' step on the whole batch at once in
one process, with the two workers FSDP2 data-parallel, tensor-parallel (the language model split,
the vision tower and projector replicated), or data-parallel with LoRA on the language model.
Under FSDP rank 1's rows have no images, so its forward runs the vision tower on a blank image
(`vision_inputs.keep_vision_tower_in_step`) to keep the sharded units' collectives in step with rank 0."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from posttrain.algorithms.loss import NLLLoss
from posttrain.config.schema import LoraConfig, PolicyConfig
from posttrain.data.message_log import flatten_message_logs
from posttrain.distributed.batch import Batch
from posttrain.distributed.cluster import VirtualCluster
from posttrain.models import hf
from posttrain.models.policy.policy import Policy
from posttrain.data.image_prompts import image_prompt
from posttrain.models.lora import apply_lora, merged_state_dict, scaling
from posttrain.models.vision_inputs import image_inputs, set_vision_training

pytestmark = [pytest.mark.functional, pytest.mark.timeout(900)]

LR = 1.0  # SGD with lr 1: the weight change is minus the gradient
IMAGE_ID = 103  # tiny-vl's <image>


@pytest.fixture(scope="module")
def batch() -> Batch:
    """Rows 0-1: a shape_count prompt with its image and an answer; rows 2-3: text only (rank 1's shard)."""
    from posttrain.data.generators import VISUAL_TASK_GENERATORS
    from posttrain.data.images import image_rows

    tokenizer = hf.load_tokenizer("tiny-vl")
    train, _ = VISUAL_TASK_GENERATORS["shape_count"](num_train=2, num_validation=1, seed=3)
    logs = []
    for row in image_rows(train):
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
        ids, pixels = image_prompt(tokenizer, text, row["images"])
        logs.append([{"role": "user", "content": text, "token_ids": ids, "pixel_values": pixels},
                     {"role": "assistant", "content": row["answer"], "token_ids": torch.tensor([40, 41, 6]), "loss": True}])
    for seed in (0, 1):
        ids = torch.randint(7, 100, (12,), generator=torch.Generator().manual_seed(seed))
        logs.append([{"role": "user", "content": "", "token_ids": ids[:8]},
                     {"role": "assistant", "content": "", "token_ids": ids[8:], "loss": True}])
    batch = flatten_message_logs(logs, tokenizer.pad_token_id)
    batch["sample_mask"] = torch.ones(4)
    assert batch["pixel_values"][2] is None and batch["pixel_values"][0] is not None
    return batch


def logprobs_of(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Plain transformers' logprobs: the image token out of the distribution, its positions 0."""
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    valid = torch.arange(ids.shape[1])[None] < lengths[:, None]
    logits = model(input_ids=ids, attention_mask=valid.long(), **image_inputs(batch, torch.device("cpu"))).logits
    logits[..., IMAGE_ID] = float("-inf")
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (torch.nn.functional.pad(logprobs, (1, 0)) * valid).masked_fill(ids == IMAGE_ID, 0.0)


def reference(batch: Batch, lora: Optional[LoraConfig] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
    """Logprobs with plain transformers in this process, the weights (LoRA merged, in LLaVA's names)
    after one SGD step of NLL on the whole batch, and its loss. With `lora`, the worker's set-up:
    adapters on the language model, the projector trained, the tower fixed (freeze_vision_tower's default)."""
    model = hf.load_policy_lm("tiny-vl").train()
    if lora is not None:
        model = apply_lora(model, lora)
        set_vision_training(model, train_tower=False)
    logprobs = logprobs_of(model, batch)
    mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
    loss, _ = NLLLoss()(logprobs, batch, batch["sample_mask"].sum(), mask.sum())
    loss.backward()
    # CLIP's post_layernorm is not used (LLaVA takes the last layer's patch features): no gradient.
    weights = {name: (p - LR * (p.grad if p.grad is not None else 0.0)).detach()
               for name, p in model.named_parameters()}
    if lora is not None:
        weights = merged_state_dict(weights, scaling(lora))
    return logprobs.detach(), weights, float(loss.detach())


def check_one_step(policy: Policy, batch: Batch, lora: Optional[LoraConfig] = None) -> dict[str, torch.Tensor]:
    """The workers' logprobs, loss and weights after one SGD step equal `reference`'s (1e-5), and
    their logprobs after it the updated model's; returns the workers' weights."""
    expected_logprobs, expected_weights, expected_loss = reference(batch, lora)
    torch.testing.assert_close(policy.get_logprobs(batch)["logprobs"], expected_logprobs, atol=1e-5, rtol=0)
    metrics = policy.train(batch, NLLLoss())
    assert metrics["global_valid_toks"] == 3 + 3 + 4 + 4 and metrics["grad_norm"] > 0
    assert metrics["loss"] == pytest.approx(expected_loss, abs=1e-5)
    weights = policy.state_dict_for_export()
    assert set(weights) == set(expected_weights)
    for name, value in expected_weights.items():  # the vision tower's and the projector's too
        torch.testing.assert_close(weights[name], value, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
    updated = hf.load_policy_lm("tiny-vl")
    updated.load_state_dict(weights)
    with torch.no_grad():
        expected_after = logprobs_of(updated, batch)
    torch.testing.assert_close(policy.get_logprobs(batch)["logprobs"], expected_after, atol=1e-5, rtol=0)
    return weights


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    # One policy at a time, each in the processes of the one before (worker_host.py).
    cluster = VirtualCluster([2], max_colocated_worker_groups=2, reuse_worker_processes=True)
    yield cluster
    cluster.shutdown()


def policy_cfg(**overrides) -> PolicyConfig:
    return PolicyConfig.model_validate(dict(
        model_name="tiny-vl", num_workers=2, optimizer=dict(name="sgd", lr=LR, weight_decay=0.0), max_grad_norm=None,
        train_global_batch_size=4, train_micro_batch_size=2, logprob_batch_size=2, **overrides))


def test_two_fsdp_workers_give_one_workers_logprobs_and_sgd_step(cluster, batch):
    policy = Policy(cluster, policy_cfg(), init_reference_model=False, name="vl_dp2")
    try:
        weights = check_one_step(policy, batch)
        tower = "model.vision_tower.encoder.layers.0.mlp.fc1.weight"
        initial = hf.load_policy_lm("tiny-vl").state_dict()[tower]
        assert not torch.equal(weights[tower], initial)  # the images' gradient reached the tower
    finally:
        policy.shutdown()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_splits_the_language_model_and_replicates_the_vision_tower(cluster, batch, sequence_parallel):
    """TP=2 (and with SP: the residual stream split by sequence, image features included): both
    ranks hold all four rows (rows 0-1 with images); the tower's gradient, which flows back through
    the split attention, is still one worker's."""
    cfg = policy_cfg(tensor_parallel_size=2, sequence_parallel=sequence_parallel)
    policy = Policy(cluster, cfg, init_reference_model=False, name="vl_tp2")
    try:
        weights = check_one_step(policy, batch)
        tower = "model.vision_tower.encoder.layers.0.mlp.fc1.weight"
        assert not torch.equal(weights[tower], hf.load_policy_lm("tiny-vl").state_dict()[tower])
    finally:
        policy.shutdown()


def test_lora_on_two_fsdp_workers_gives_one_workers_step(cluster, batch):
    """LoRA (dim 4) on the language model's q/k/v/o_proj, the projector trained, the tower fixed."""
    lora = LoraConfig(enabled=True, dim=4, alpha=8)
    policy = Policy(cluster, policy_cfg(lora=lora.model_dump()), init_reference_model=False, name="vl_lora")
    try:
        weights = check_one_step(policy, batch, lora)
        initial = hf.load_policy_lm("tiny-vl").state_dict()
        for name in ("model.vision_tower.encoder.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
            assert torch.equal(weights[name], initial[name]), name  # fixed: no adapter, not trained
        for name in ("model.language_model.layers.1.self_attn.q_proj.weight",
                     "model.multi_modal_projector.linear_1.weight"):
            assert not torch.equal(weights[name], initial[name]), name  # adapter merged / trained in full
    finally:
        policy.shutdown()
