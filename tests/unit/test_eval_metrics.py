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
