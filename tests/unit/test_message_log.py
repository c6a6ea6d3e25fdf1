"""Message logs: append helpers and the flatten into training tensors."""

from __future__ import annotations

import pytest
import torch

from posttrain.data.message_log import append_message, flatten_message_logs
from posttrain.distributed.batch import Batch

PAD = 0


def two_turn_log() -> list[dict]:
    """user (3 tokens), assistant (2, generated), environment (2), assistant (3, generated)."""
    log: list[dict] = []
    append_message(log, "user", "abc", [11, 12, 13])
    append_message(log, "assistant", "de", [14, 15], generation_logprobs=[-0.5, -1.0], weight_version=3)
    append_message(log, "environment", "fg", torch.tensor([16, 17]))
    append_message(log, "assistant", "hij", [18, 19, 20], generation_logprobs=[-0.25, -2.0, -0.125], weight_version=4)
    return log


def test_append_message_fields():
    log = two_turn_log()
    assert [m["role"] for m in log] == ["user", "assistant", "environment", "assistant"]
    assert log[1]["token_ids"].dtype == torch.long and log[1]["generation_logprobs"].dtype == torch.float32
    assert log[1]["weight_version"] == 3 and "weight_version" not in log[0] and "generation_logprobs" not in log[2]
    assert "".join(m["content"] for m in log) == "abcdefghij"
    with pytest.raises(ValueError, match="1 generation_logprobs for 2 tokens"):
        append_message([], "assistant", "xy", [1, 2], generation_logprobs=[-1.0])


def test_flatten_two_turn_log_masks_and_values():
    short = [{"role": "user", "content": "a", "token_ids": torch.tensor([21, 22])}]
    flat = flatten_message_logs([two_turn_log(), short], pad_token_id=PAD)
    assert isinstance(flat, Batch) and flat.size == 2
    assert flat["input_ids"].tolist() == [
        [11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
        [21, 22, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD],
    ]
    assert flat["input_lengths"].tolist() == [10, 2]
    assert flat["token_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 0, 1, 1, 1], [0] * 10]
    assert flat["generation_logprobs"].tolist() == [
        [0, 0, 0, -0.5, -1.0, 0, 0, -0.25, -2.0, -0.125],
        [0] * 10,
    ]
    assert flat["input_ids"].dtype == torch.long and flat["input_lengths"].dtype == torch.long
    assert flat["token_mask"].dtype == torch.float32 and flat["generation_logprobs"].dtype == torch.float32


def test_flatten_loss_flag_loss_roles_and_padding_multiple():
    log = [
        {"role": "user", "content": "q", "token_ids": torch.tensor([1, 2])},
        {"role": "assistant", "content": "a", "token_ids": torch.tensor([3]), "loss": True},
        {"role": "tool", "content": "t", "token_ids": torch.tensor([4])},
    ]
    flat = flatten_message_logs([log], pad_token_id=9, pad_to_multiple_of=8)
    assert flat["input_ids"].tolist() == [[1, 2, 3, 4, 9, 9, 9, 9]]
    assert flat["input_lengths"].tolist() == [4]
    assert flat["token_mask"].tolist() == [[0, 0, 1, 0, 0, 0, 0, 0]]
    flat = flatten_message_logs([log], pad_token_id=9, loss_roles=("tool",))
    assert flat["token_mask"].tolist() == [[0, 0, 1, 1]]


def test_flatten_rejects_misaligned_logprobs():
    log = [{"role": "assistant", "content": "x", "token_ids": torch.tensor([1, 2]),
            "generation_logprobs": torch.tensor([-1.0])}]
    with pytest.raises(ValueError, match=r"message_logs\[0\]\[0\] \(assistant\): 1 generation_logprobs for 2"):
        flatten_message_logs([log], pad_token_id=0)
