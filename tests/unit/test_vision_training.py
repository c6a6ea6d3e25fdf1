"""Vision-language models through training and generation (models/vision_inputs.py): rows with
images become prompt messages carrying `pixel_values`, a `Batch` carries them per row, the policy
worker's logprobs (plain, fused, packed) equal the native engine's on the same images, and the
options a VLM does not take yet are one line each. The worker runs in this thread (one rank, as
the local backend runs it); tests/functional/test_vision_workers.py has the FSDP2 pair."""

from __future__ import annotations

import pytest
import torch

from posttrain.data.message_log import flatten_message_logs
from posttrain.distributed.batch import Batch
from posttrain.errors import DataError, UserError
from posttrain.models import hf
from posttrain.models.generation.engine import NativeGenerationEngine, distinct_prompts, image_groups
from posttrain.data.image_prompts import image_prompt

IMAGE_ID = 103  # tiny-vl's <image>


@pytest.fixture(scope="module")
def tokenizer():
    return hf.load_tokenizer("tiny-vl")


@pytest.fixture(scope="module")
def rows():
    from posttrain.data.generators import VISUAL_TASK_GENERATORS
    from posttrain.data.images import image_rows

    train, _ = VISUAL_TASK_GENERATORS["shape_count"](num_train=3, num_validation=1, seed=0)
    return image_rows(train)


@pytest.fixture(scope="module")
def prompts(tokenizer, rows) -> Batch:
    logs = []
    for row in rows:
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
        ids, pixels = image_prompt(tokenizer, text, row["images"])
        logs.append([{"role": "user", "content": text, "token_ids": ids, "pixel_values": pixels}])
    return flatten_message_logs(logs, tokenizer.pad_token_id)


@pytest.fixture
def worker(monkeypatch):
    from posttrain.distributed import actors
    from posttrain.models.policy.worker import PolicyWorker

    monkeypatch.setattr(actors._identity, "values", {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, raising=False)

    def make(**overrides):
        cfg = dict(model_name="tiny-vl", train_global_batch_size=3, train_micro_batch_size=3, max_grad_norm=None,
                   optimizer=dict(name="sgd", lr=0.5, weight_decay=0.0), **overrides)
        return PolicyWorker(cfg, init_reference_model=False)

    return make


def test_a_prompt_expands_each_image_and_the_batch_keeps_images_with_their_rows(tokenizer, prompts):
    assert [int((ids == IMAGE_ID).sum()) for ids in prompts["input_ids"]] == [64, 64, 64]
    assert [tuple(p.shape) for p in prompts["pixel_values"]] == [(1, 3, 64, 64)] * 3
    text_log = [{"role": "user", "content": "hi", "token_ids": torch.tensor([5, 9, 10])}]
    mixed = flatten_message_logs([text_log, [{**text_log[0], "pixel_values": prompts["pixel_values"][1]}]], 0)
    assert mixed["pixel_values"][0] is None and torch.equal(mixed["pixel_values"][1], prompts["pixel_values"][1])
    assert "pixel_values" not in flatten_message_logs([text_log], 0)
    repeated = prompts.repeat_interleave(2).select([5, 0])
    assert torch.equal(repeated["pixel_values"][0], prompts["pixel_values"][2])
    assert torch.equal(repeated["pixel_values"][1], prompts["pixel_values"][0])
    # Prompt sharing in the engine: identical tokens with other images are other prompts.
    groups = image_groups([prompts["pixel_values"][0], prompts["pixel_values"][0].clone(), None,
                           prompts["pixel_values"][1]])
    assert groups.tolist() == [0, 0, -1, 1]
    same_ids = prompts["input_ids"][[0, 0, 0]]
    first, row_map = distinct_prompts(same_ids, prompts["input_lengths"][[0, 0, 0]], torch.tensor([0, 1, 0]))
    assert row_map[0] == row_map[2] != row_map[1] and len(first) == 2


def test_image_rows_become_prompts_and_sft_examples_with_their_pixels(tokenizer):
    from posttrain.config.schema import DataConfig
    from posttrain.data.datasets import load_records
    from posttrain.data.processors import build_prompt_message_log, build_sft_example

    data = DataConfig(dataset="generated", generator="shape_count", num_train=4, num_validation=2, seed=0)
    records = load_records(data, "train")
    assert records[0]["env_name"] == "math" and records[0]["prompt"].startswith("How many shapes")
    sample = build_prompt_message_log(records[0], tokenizer, 256)
    prompt = sample.message_log[0]
    assert tuple(prompt["pixel_values"].shape) == (1, 3, 64, 64) and int((prompt["token_ids"] == IMAGE_ID).sum()) == 64
    assert prompt["content"].startswith("<|user|><image>How many shapes")
    assert len(sample.extra_env_info["images"]) == 1  # environments (reward functions) get the row's images
    example = build_sft_example(records[0], tokenizer, 256)
    assert example["message_log"][1]["content"] == records[0]["answer"] + "<|end|>"
    assert torch.equal(example["message_log"][0]["token_ids"], prompt["token_ids"])
    cut = build_prompt_message_log(records[0], tokenizer, 16)
    assert "pixel_values" not in cut.message_log[0] and not (cut.message_log[0]["token_ids"] == IMAGE_ID).any()


def test_a_bad_image_in_a_data_file_is_one_line(tmp_path):
    from posttrain.config.schema import DataConfig
    from posttrain.data.datasets import load_records

    (tmp_path / "train.jsonl").write_text('{"prompt": "How many?", "images": ["missing.png"], "answer": "2"}\n')
    data = DataConfig(dataset="jsonl", train_path=str(tmp_path / "train.jsonl"))
    with pytest.raises(DataError, match=r"train.jsonl:1: images\[0\] 'missing.png': no such file$"):
        load_records(data, "train")


def test_worker_logprobs_equal_the_engines_on_the_same_images(worker, tokenizer, prompts):
    """Generated tokens' logprobs from the engine (prefill with the images, decode from the KV cache)
    equal the policy worker's forward over prompt + generation, unpacked and packed (1e-4); both
    leave the image token out of the distribution (the engine never samples it)."""
    policy = worker()
    assert policy.is_vision and not policy.fused_logprobs  # the fused head would keep the image token
    engine = NativeGenerationEngine(hf.load_policy_lm("tiny-vl"), tokenizer, pad_token_id=tokenizer.pad_token_id,
                                    eos_token_id=tokenizer.eos_token_id)
    rows = prompts.repeat_interleave(2)
    out = engine.generate(rows["input_ids"], rows["input_lengths"], max_new_tokens=8, seeds=torch.arange(6),
                          pixel_values=rows["pixel_values"])
    batch = Batch(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"],
                  pixel_values=rows["pixel_values"])
    generated = out["logprobs"] != 0
    assert int(generated.sum()) > 12 and not (out["output_ids"][generated] == IMAGE_ID).any()
    logprobs = policy.get_logprobs(batch)["logprobs"]
    torch.testing.assert_close(logprobs[generated], out["logprobs"][generated], atol=1e-4, rtol=0)
    assert (logprobs[batch["input_ids"] == IMAGE_ID] == 0).all() and logprobs.isfinite().all()  # text tokens only
    policy.cfg.sequence_packing.enabled, policy.cfg.sequence_packing.logprob_mb_tokens = True, 2048
    torch.testing.assert_close(policy.get_logprobs(batch)["logprobs"], logprobs, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="the prompts hold image tokens but no pixel_values came with them"):
        engine.generate(rows["input_ids"], rows["input_lengths"], max_new_tokens=2)
    # The images matter: the rows' images swapped give other logprobs.
    swapped = Batch({**batch, "pixel_values": batch["pixel_values"][2:] + batch["pixel_values"][:2]})
    assert (policy.get_logprobs(swapped)["logprobs"] - logprobs).abs().max() > 1e-3


def train_once(policy, prompts: Batch) -> set[str]:
    """One NLL step on the prompts' text tokens; the names of the parameters it changed."""
    from posttrain.algorithms.loss import NLLLoss

    before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    batch = Batch({**prompts, "sample_mask": torch.ones(3)})
    batch["token_mask"] = (batch["input_ids"] != IMAGE_ID).float() * (
        torch.arange(batch["input_ids"].shape[1])[None] < batch["input_lengths"][:, None])
    policy.train(batch, NLLLoss())
    return {name for name, p in policy.model.named_parameters() if not torch.equal(p, before[name])}


def test_freeze_vision_tower_trains_the_projector_and_the_language_model_only(worker, prompts):
    changed = train_once(worker(freeze_vision_tower=True), prompts)
    assert changed and not any(".vision_tower." in name for name in changed)
    assert any(".multi_modal_projector." in name for name in changed)
    assert any(".language_model." in name for name in changed)


def test_lora_trains_adapters_on_the_language_model_and_exports_the_merged_llava(worker, prompts):
    """LoRA on tiny-vl (models/lora.py): by default the language model's adapters and the projector
    train, the vision tower and the base weights stay (LLaVA-1.5's LoRA recipe); what leaves the
    trainer (export, refit) is the plain LLaVA's names with the adapters merged, and gives the
    trained model's logits. freeze_vision_tower=false trains the tower in full beside the adapters."""
    from posttrain.models.vision_inputs import image_inputs

    policy = worker(lora={"enabled": True, "dim": 4, "alpha": 8})
    changed = train_once(policy, prompts)
    assert all(".lora_" in name or ".multi_modal_projector." in name for name in changed)
    adapted = {name.split(".layers.")[0] for name in changed if ".lora_B." in name}
    assert adapted == {"base_model.model.model.language_model"}
    assert any(".multi_modal_projector." in name for name in changed)
    export = policy.state_dict_for_export()
    plain = hf.load_policy_lm("tiny-vl")
    assert list(export) == list(plain.state_dict()) == [name for name, _, _ in policy.refit_info()]
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(export[q], plain.state_dict()[q])  # the adapter, merged
    assert torch.equal(policy._exported_tensor_getter()(q), export[q])  # refit's streamed tensors: the same
    plain.load_state_dict(export)
    valid = (torch.arange(prompts["input_ids"].shape[1])[None] < prompts["input_lengths"][:, None]).long()
    inputs = dict(input_ids=prompts["input_ids"], attention_mask=valid, **image_inputs(prompts, torch.device("cpu")))
    with torch.no_grad():
        torch.testing.assert_close(plain(**inputs).logits, policy.model(**inputs).logits, atol=1e-5, rtol=0)

    changed = train_once(worker(lora={"enabled": True}, freeze_vision_tower=False), prompts)
    assert any(".vision_tower." in name and ".lora_" not in name for name in changed)


def test_options_a_vision_language_model_does_not_train_with_are_one_line():
    from posttrain.config.schema import PolicyConfig
    from posttrain.models.vision_inputs import check_vision_policy

    cfg = PolicyConfig(model_name="tiny-vl", num_workers=2, train_global_batch_size=2, context_parallel_size=2)
    with pytest.raises(UserError, match=r"context_parallel_size > 1 is not supported for a vision-language model "
                                        r"\('tiny-vl'\) yet"):
        check_vision_policy(cfg)
    for allowed in (dict(tensor_parallel_size=2), dict(lora={"enabled": True})):  # the language model split / adapted
        check_vision_policy(PolicyConfig(model_name="tiny-vl", num_workers=2, train_global_batch_size=2, **allowed))


def test_a_visual_generator_with_a_text_model_is_one_line():
    from posttrain.config.loader import load_config
    from posttrain.preflight import check_vision_language

    cfg = load_config("grpo", overrides=["data.dataset=generated", "data.generator=shape_count"])
    with pytest.raises(UserError, match=r"^data.generator='shape_count' makes rows with images, and policy.model_name="):
        check_vision_language(cfg)


def test_a_checkpoint_and_its_export_reload_as_the_vision_language_model(worker, prompts, tmp_path):
    """save / load_checkpoint and the HF export (what an SFT warm start hands GRPO) keep the vision
    tower and the processor: the export loads through the policy loader and the processor."""
    policy = worker()
    logprobs = policy.get_logprobs(prompts)["logprobs"]
    policy.save_checkpoint(str(tmp_path / "ckpt"))
    out = policy.export_hf(str(tmp_path / "hf"))
    assert hf.load_processor(out).image_processor.crop_size == {"height": 64, "width": 64}
    model = hf.load_policy_lm(out)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    for name, value in model.state_dict().items():
        assert torch.equal(value, policy.model.state_dict()[name]), name
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.01)
    policy.load_checkpoint(str(tmp_path / "ckpt"))
    assert torch.equal(policy.get_logprobs(prompts)["logprobs"], logprobs)


def test_a_reward_function_receives_the_images_of_its_rows(tokenizer):
    """What an environment gets for an image row (the sample's `extra_env_info`) carries its images:
    a reward function of the Python API receives them as the `images` column."""
    from posttrain.config.schema import DataConfig
    from posttrain.data.datasets import load_records
    from posttrain.data.processors import build_prompt_message_log
    from posttrain.environments.registry import resolve_env
    from posttrain.environments.reward_fn_env import reward_fn_section

    records = load_records(DataConfig(dataset="generated", generator="shape_count", num_train=2, num_validation=1,
                                      seed=0), "train")
    samples = [build_prompt_message_log(r, tokenizer, 256) for r in records]
    seen = {}

    def brightness(completions, images, answer):
        seen["sizes"] = [image[0].size for image in images]
        return [float(c == a) for c, a in zip(completions, answer)]

    cls, cfg = resolve_env("rewards", reward_fn_section([brightness]))
    logs = [[{"role": "user", "content": s.message_log[0]["content"]}, {"role": "assistant", "content": r["answer"]}]
            for s, r in zip(samples, records)]
    result = cls(cfg).step(logs, [s.extra_env_info for s in samples])
    assert seen["sizes"] == [(64, 64), (64, 64)] and result.rewards.tolist() == [1.0, 1.0]
