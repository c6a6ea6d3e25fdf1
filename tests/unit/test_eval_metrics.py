"""Evaluation metrics computed on the controller: cons@k (majority vote)."""

import torch

from posttrain.evals.eval import consensus_accuracy


def test_consensus_picks_the_majority_answer_per_prompt():
    # Prompt 0: majority "4" (rewarded) -> correct. Prompt 1: majority "7" (wrong) although one
    # sample was right -> wrong. Prompt 2: no answers -> wrong. Prompt 3: tie "1"/"2", first seen
    # ("2") wins and it was rewarded -> correct.
    answers = ["4", "4", "5", "7", "7", "3", None, None, None, "2", "1", None]
    rewards = torch.tensor([1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0], dtype=torch.float)
    assert consensus_accuracy(answers, rewards, 3) == 0.5


def test_a_multi_task_eval_prints_one_row_per_task_beside_the_previous_one(tmp_path, capsys):
    """`posttrain eval` on a blend: one table row per environment, the overall row, and the previous
    evaluation of the same split (another checkpoint) with the change."""
    import json

    from posttrain.evals.eval import previous_result, print_metrics

    def metrics(calc, quiz):
        return {"validation/accuracy_greedy": (calc + quiz) / 2, "validation/avg_length": 12.0,
                "validation/accuracy_greedy_count/calc": 30.0, "validation/accuracy_greedy/calc": calc,
                "validation/accuracy_greedy_count/quiz": 30.0, "validation/accuracy_greedy/quiz": quiz}

    results = tmp_path / "eval_results.jsonl"
    assert previous_result(results, "validation") is None
    results.write_text(json.dumps({"model": "smollm2", "split": "validation", "metrics": metrics(0.1, 0.2)}) + "\n"
                       + json.dumps({"model": "x", "split": "train", "metrics": metrics(0.9, 0.9)}) + "\n")
    print_metrics(metrics(0.3, 0.2), previous_result(results, "validation"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["validation/accuracy_greedy: 0.2500", "validation/avg_length: 12.0000"]
    assert lines[2].split() == ["task", "n", "accuracy_greedy", "previous", "change"]
    assert lines[3].split() == ["calc", "30", "0.300", "0.100", "+0.200"]
    assert lines[4].split() == ["quiz", "30", "0.200", "0.200", "+0.000"]
    assert lines[5].split() == ["all", "60", "0.250", "0.150", "+0.100"]
    assert lines[6] == "(previous: smollm2)"
    print_metrics({"validation/accuracy_greedy": 0.5})  # one task: no table
    assert capsys.readouterr().out == "validation/accuracy_greedy: 0.5000\n"
