"""Multi-teacher distillation (`teachers: {<task>: ...}`): the config's refusals (one line naming
the key) and the routing of each row to its task's teacher, with fake teachers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.algorithms.distill_teachers import assign_teachers, per_task_kl, route_rows, teachers_topk
from posttrain.config import ConfigError, load_config
from posttrain.distributed.batch import Batch
from posttrain.errors import UserError
from posttrain.preflight import check_distill_vocabularies

BLEND = ("data.blend=[{name: easy, env: math, num_train: 8, num_validation: 2}, "
         "{name: hard, env: math, num_train: 8, num_validation: 2}]")


def _cfg(*overrides: str):
    return load_config("distill", overrides=["sft_warmup=null", "teacher_warmup=null", "teacher.model_name=tiny",
                                             BLEND, *overrides])


def test_teachers_name_a_task_each_and_teacher_serves_the_others():
    cfg = _cfg("teachers={hard: {model_name: small}}")
    assert assign_teachers(cfg, ["easy", "hard", "easy"]) == {"easy": "teacher", "hard": "teachers.hard"}
    assert assign_teachers(_cfg(), ["easy", "hard"]) == {"easy": "teacher", "hard": "teacher"}  # today's run


def test_a_task_without_a_teacher_is_refused_naming_the_key():
    cfg = _cfg("teacher=null", "teachers={hard: {model_name: small}}")
    with pytest.raises(UserError, match=r"^teachers: task 'easy' has no teacher and teacher=null: add teachers.easy"):
        assign_teachers(cfg, ["easy", "hard"])


def test_a_teacher_of_a_task_the_data_lacks_is_refused():
    cfg = _cfg("teachers={hadr: {model_name: small}}")
    with pytest.raises(UserError, match=r"^teachers.hadr: the training data has no task 'hadr' \(its tasks: easy, hard\)"):
        assign_teachers(cfg, ["easy", "hard"])


@pytest.mark.parametrize("overrides,fragment", [
    (["teacher=null"], "teacher=null leaves no teacher"),
    (["teacher=null", "teachers={easy: {model_name: tiny}}", "teacher_warmup={}"], "teacher_warmup warm-starts teacher"),
    (["teachers={easy: {model_name: tiny, num_workers: 2}}"], "teachers.easy.num_workers=2 differs from teacher.num_workers=1"),
    (["cluster.backend=local", "teacher=null", "teachers={easy: {model_name: tiny, num_workers: 2}}"],
     "teachers.easy.num_workers=2: a local worker group has one worker"),
])
def test_bad_teachers_fail_when_the_config_loads(overrides, fragment):
    with pytest.raises(ConfigError) as error:
        _cfg(*overrides)
    assert fragment in str(error.value)


def test_each_teachers_vocabulary_is_checked(tmp_path: Path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 50257}))
    check_distill_vocabularies(_cfg("teachers={hard: {model_name: small-qwen2}}"))  # the shared characters
    with pytest.raises(UserError, match=r"^teachers.hard.model_name=.* has a vocabulary of 50257 tokens but "
                                        r"policy.model_name='tiny' has 103"):
        check_distill_vocabularies(_cfg(f"teachers={{hard: {{model_name: {other}}}}}", "distillation.tokenizer_alignment=never"))


def test_preflight_refuses_a_teacher_of_an_unknown_task():
    from posttrain.preflight import preflight

    with pytest.raises(UserError, match=r"^teachers.medium: the training data has no task 'medium'"):
        preflight(_cfg("teachers={medium: {model_name: tiny}}"), plan_memory=False)


class FakeTeacher:
    """Top-k logits that say which teacher scored a row and which row it was (its first token)."""

    def __init__(self, mark: float):
        self.mark, self.calls = mark, []

    def get_topk_logits(self, batch, k, temperature):
        self.calls.append(batch["input_ids"][:, 0].tolist())
        b, s = batch["input_ids"].shape
        first = batch["input_ids"][:, :1, None].float()
        return {"topk_logits": self.mark + first.expand(b, s, k).clone(),
                "topk_indices": torch.full((b, s, k), int(self.mark), dtype=torch.long)}


def test_rows_go_to_their_tasks_teacher_and_come_back_in_order():
    tasks = ["easy", "hard", "hard", "easy", "other"]
    assignment = {"easy": "teachers.easy", "hard": "teachers.hard", "other": "teacher"}
    assert route_rows(tasks, assignment) == {"teachers.easy": [0, 3], "teachers.hard": [1, 2], "teacher": [4]}
    teachers = {"teachers.easy": FakeTeacher(100), "teachers.hard": FakeTeacher(200), "teacher": FakeTeacher(300)}
    batch = Batch(input_ids=torch.arange(5)[:, None].repeat(1, 3), token_mask=torch.ones(5, 3))
    top = teachers_topk(batch, tasks, assignment, teachers, k=2, temperature=1.0)
    assert top["topk_logits"].shape == (5, 3, 2) and top["topk_indices"].shape == (5, 3, 2)
    assert top["topk_logits"][:, 0, 0].tolist() == [100, 201, 202, 103, 304]  # teacher + row, in row order
    assert top["topk_indices"][:, 2, 1].tolist() == [100, 200, 200, 100, 300]
    assert [t.calls for t in teachers.values()] == [[[0, 3]], [[1, 2]], [[4]]]  # one call each, its rows only


def test_one_teacher_for_every_row_scores_the_whole_batch():
    teacher = FakeTeacher(7)
    batch = Batch(input_ids=torch.arange(3)[:, None].repeat(1, 2))
    top = teachers_topk(batch, ["a", "b", "a"], {"a": "teacher", "b": "teacher"}, {"teacher": teacher}, 1, 1.0)
    assert teacher.calls == [[0, 1, 2]] and top["topk_logits"][:, 0, 0].tolist() == [7, 8, 9]


def test_per_task_kl_is_the_token_mean_of_each_task():
    metrics = {"kl_sum_task0": 3.0, "kl_tokens_task0": 6.0, "kl_sum_task1": 1.0, "kl_tokens_task1": 4.0}
    assert per_task_kl(metrics, ["easy", "hard", "none"]) == {"distill_loss/easy": 0.5, "distill_loss/hard": 0.25}


def test_the_loss_sums_its_kl_per_task():
    """`kl_sum_task<i>` / `kl_tokens_task<i>` from the loss give each task's token mean, and the
    two tasks' sums add up to the overall KL x tokens."""
    from posttrain.algorithms.distill_loss import DistillationLoss

    torch.manual_seed(0)
    b, s, v, k = 4, 5, 11, 3
    teacher = torch.randn(b, s, v)
    top = teacher.topk(k, dim=-1)
    batch = {"token_mask": torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 1, 1, 1, 0]]).float(),
             "sample_mask": torch.ones(b), "teacher_topk_logits": top.values, "teacher_topk_indices": top.indices,
             "task_index": torch.tensor([0, 1, 1, 0])}
    tokens = batch["token_mask"][:, 1:].sum()
    _, metrics = DistillationLoss()(torch.randn(b, s, v), batch, torch.tensor(float(b)), tokens)
    assert metrics["kl_tokens_task0"] == 7 and metrics["kl_tokens_task1"] == 5
    total = metrics["kl_sum_task0"] + metrics["kl_sum_task1"]
    assert total == pytest.approx(metrics["loss"] * float(tokens), rel=1e-5)
