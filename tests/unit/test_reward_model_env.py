"""The reward-model environment scores a response exactly as the reward model scores the same
response laid out as `posttrain rm` trains it (a preference pair's row)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from posttrain.data.processors import build_prompt_message_log, build_sft_example
from posttrain.environments.reward_model_env import RewardModelEnvConfig, RewardModelEnvironment
from posttrain.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    lm_dir = build_tiny_model(tmp_path_factory.mktemp("lm"))
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(lm_dir, num_labels=1)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # a head whose scores differ per response
    out = tmp_path_factory.mktemp("rm")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(lm_dir).save_pretrained(out)
    return out


def test_scores_equal_the_reward_models_forward_on_the_training_layout(reward_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir, num_labels=1).eval()
    env = RewardModelEnvironment({"model_path": str(reward_model_dir), "batch_size": 2, "scale": 2.0, "shift": 0.5})
    responses = ["46", "45", "a much longer answer: 46"]
    logs, expected = [], []
    for response in responses:
        prompt = build_prompt_message_log({"prompt": "23+23=", "answer": "46"}, tokenizer, 256)
        # the rollout's view: the templated prompt, then the decoded response (eos dropped)
        logs.append([{"role": "user", "content": prompt.prompt},
                     {"role": "assistant", "content": response}])
        pair_row = build_sft_example({"prompt": "23+23=", "answer": response}, tokenizer, 256)
        ids = torch.cat([m["token_ids"] for m in pair_row["message_log"]])
        with torch.no_grad():
            expected.append(model(input_ids=ids[None]).logits[0, 0].item())
    out = env.step(logs, [{}] * 3)  # batches of 2 with right padding
    assert out.rewards.tolist() == pytest.approx([2.0 * (s - 0.5) for s in expected], abs=1e-5)
    assert len(set(round(s, 4) for s in expected)) == 3
    assert out.terminateds.tolist() == [True] * 3
    assert out.metrics["score_sum"] == pytest.approx(sum(expected), abs=1e-4)


def test_model_path_must_be_a_model_directory(tmp_path):
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        RewardModelEnvConfig(model_path=str(tmp_path))
