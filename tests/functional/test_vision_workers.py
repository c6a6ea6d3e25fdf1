"""The tiny vision-language model (`tiny-vl`) on two real FSDP2 policy workers (Ray, gloo, CPU):
logprobs on image rows, and one SGD step equal to plain transformers' step on the whole batch at
once. Rank 1's rows have no images, so its forward runs the vision tower on a blank image
(`vision_inputs.keep_vision_tower_in_step`) to keep the sharded units' collectives in step with rank 0."""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithms.loss import NLLLoss
from posttrain.config.schema import PolicyConfig
from posttrain.data.message_log import flatten_message_logs
from posttrain.distributed.batch import Batch
from posttrain.distributed.cluster import VirtualCluster
from posttrain.models import hf
from posttrain.models.policy.policy import Policy
from posttrain.data.image_prompts import image_prompt
from posttrain.models.vision_inputs import image_inputs

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


def reference(batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logprobs with plain transformers (the image token out of the distribution, its positions 0), and
    the weights after one SGD step of NLL on the whole batch."""
    model = hf.load_policy_lm("tiny-vl").train()
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    valid = torch.arange(ids.shape[1])[None] < lengths[:, None]
    logits = model(input_ids=ids, attention_mask=valid.long(), **image_inputs(batch, torch.device("cpu"))).logits
    logits[..., IMAGE_ID] = float("-inf")
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    logprobs = (torch.nn.functional.pad(logprobs, (1, 0)) * valid).masked_fill(ids == IMAGE_ID, 0.0)
    mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
    loss, _ = NLLLoss()(logprobs, batch, batch["sample_mask"].sum(), mask.sum())
    loss.backward()
    # CLIP's post_layernorm is not used (LLaVA takes the last layer's patch features): no gradient.
    weights = {name: (p - LR * (p.grad if p.grad is not None else 0.0)).detach() for name, p in model.named_parameters()}
    return logprobs.detach(), weights


def test_two_fsdp_workers_give_one_workers_logprobs_and_sgd_step(ray_cluster, batch):
    cluster = VirtualCluster([2], max_colocated_worker_groups=2)
    cfg = PolicyConfig.model_validate(dict(
        model_name="tiny-vl", num_workers=2, optimizer=dict(name="sgd", lr=LR, weight_decay=0.0), max_grad_norm=None,
        train_global_batch_size=4, train_micro_batch_size=2, logprob_batch_size=2))
    policy = Policy(cluster, cfg, init_reference_model=False, name="vl_dp2")
    try:
        expected_logprobs, expected_weights = reference(batch)
        torch.testing.assert_close(policy.get_logprobs(batch)["logprobs"], expected_logprobs, atol=1e-5, rtol=0)
        metrics = policy.train(batch, NLLLoss())
        assert metrics["global_valid_toks"] == 3 + 3 + 4 + 4 and metrics["grad_norm"] > 0
        weights = policy.state_dict_for_export()
        assert set(weights) == set(expected_weights)
        for name, value in expected_weights.items():  # the vision tower's and the projector's too
            torch.testing.assert_close(weights[name], value, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
        tower = "model.vision_tower.encoder.layers.0.mlp.fc1.weight"
        initial = hf.load_policy_lm("tiny-vl").state_dict()[tower]
        assert not torch.equal(weights[tower], initial)  # the images' gradient reached the tower
    finally:
        policy.shutdown()
        cluster.shutdown()
