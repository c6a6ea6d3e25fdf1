"""docs/python-api.md's examples run as written, in the page's order (later ones reuse earlier
ones' data and checkpoints), each trainer's metric moving the right way. The GRPO example is the
README's (`api_example.py`, run by test_api.py) with other sizes; it is not run again here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_ppo import ASYNC_TEST_WARM_START

from posttrain.config.loader import load_config
from posttrain.run_config import warm_start_export_dir

pytestmark = pytest.mark.functional

PAGE = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"


def examples() -> dict[str, str]:
    """The page's Python blocks by the `## heading` they sit under."""
    found = {}
    for section in re.split(r"^## ", PAGE.read_text(), flags=re.M)[1:]:
        title, _, body = section.partition("\n")
        blocks = re.findall(r"```python\n(.*?)```", body, flags=re.S)
        if blocks:
            found[title.strip()] = "\n".join(blocks)
    return found


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_the_pages_examples_run_and_learn(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = examples()
    assert list(blocks) == ["GRPO", "SFT", "DPO", "Reward model", "Distillation", "PPO"]
    for title in ("SFT", "DPO", "Reward model", "Distillation", "PPO"):  # as written: no line changed
        assert len(blocks[title].splitlines()) <= 20, title
    scope: dict = {"__name__": "__main__"}

    exec(compile(blocks["SFT"], f"{PAGE}:SFT", "exec"), scope)
    sft = scope["sft_result"]
    assert sft.metrics["validation/loss"] < sft.history[0]["validation/loss"] - 0.5  # SFT loss falls
    assert type(scope["model"]).__name__ == "LlamaForCausalLM" and scope["tokenizer"]("1+1=")["input_ids"]
    assert 0.0 <= scope["sft_eval"]["validation/accuracy_greedy"] <= 1.0

    exec(compile(blocks["DPO"], f"{PAGE}:DPO", "exec"), scope)
    dpo = scope["dpo_result"]
    assert dpo.history[0]["validation/accuracy"] == 0.5  # the reference itself: every pair a tie
    assert dpo.metrics["validation/accuracy"] > 0.6 and dpo.metrics["validation/reward_margin"] > 0

    exec(compile(blocks["Reward model"], f"{PAGE}:Reward model", "exec"), scope)
    rm = scope["rm_result"]
    assert rm.metrics["validation/accuracy"] > rm.history[0]["validation/accuracy"]
    assert type(scope["reward_model"]).__name__ == "LlamaForSequenceClassification"

    exec(compile(blocks["Distillation"], f"{PAGE}:Distillation", "exec"), scope)
    kl = [m["train/loss"] for _, m in sorted(scope["distill_result"].history.items()) if "train/loss" in m]
    assert len(kl) == 8 and mean(kl[-2:]) < mean(kl[:2])  # the KL to the teacher falls

    exec(compile(blocks["PPO"], f"{PAGE}:PPO", "exec"), scope)
    ppo = scope["result"]
    # The example's warm start is test_ppo.py's, so the suite trains it once (the cache's key).
    assert warm_start_export_dir(scope["trainer"].config.sft_warmup) == warm_start_export_dir(
        load_config("ppo", overrides=list(ASYNC_TEST_WARM_START)).sft_warmup)
    assert sorted(step for step in ppo.history if step > 0) == [1, 2, 3, 4]
    assert all("train/critic/value_loss" in ppo.history[step] for step in (1, 2, 3, 4))  # the critic trained
