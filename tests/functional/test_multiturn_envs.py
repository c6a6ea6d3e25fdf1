"""Multi-turn environments through the real rollout loop and real GRPO runs.

- Scripted moves (a generation stand-in that replays fixed responses) against the sliding-puzzle
  and tools environments as Ray actors: per-turn observations rendered as chat turns, loss mask 1
  exactly on generated tokens, rewards only on solving / on the final answer.
- `posttrain grpo` from a user's directory on a blend of the sliding puzzle (rows made by the
  environment), tool calling on arithmetic, a textarena game, NeMo-Gym rows sent to our own
  resources server (started here on loopback), a reward model and a pairwise LLM judge, with
  max_rollout_turns > 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.distributed.batch import Batch

pytestmark = pytest.mark.functional
REPO = Path(__file__).resolve().parents[2]


class ScriptedGeneration:
    """Replays `scripts[key]` (one response per turn), `key` being a substring of the prompt."""

    LOGPROB = -0.5

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tokenizer, self.scripts = tokenizer, scripts
        self.turns: dict[str, int] = {}
        self.stop_strings_seen: list = []

    def prepare_for_generation(self) -> bool:
        return True

    def finish_generation(self) -> bool:
        return True

    def generate_shards(self, batch: Batch, greedy: bool = False, params=None):
        yield list(range(batch.size)), self.generate(batch, greedy, params)

    def generate(self, batch: Batch, greedy: bool = False, params=None) -> Batch:
        rows, lengths = [], []
        self.stop_strings_seen.append(list(batch["stop_strings"]))
        for b in range(batch["input_ids"].shape[0]):
            n = int(batch["input_lengths"][b])
            text = self.tokenizer.decode(batch["input_ids"][b, :n].tolist())
            key = next(k for k in self.scripts if k in text)
            turn = self.turns.get(key, 0)
            self.turns[key] = turn + 1
            ids = self.tokenizer(self.scripts[key][turn], add_special_tokens=False)["input_ids"]
            rows.append(batch["input_ids"][b, :n].tolist() + ids)
            lengths.append(len(ids))
        width = max(len(r) for r in rows)
        output_ids = torch.zeros(len(rows), width, dtype=torch.long)
        logprobs = torch.zeros(len(rows), width)
        for b, row in enumerate(rows):
            output_ids[b, : len(row)] = torch.tensor(row)
            logprobs[b, len(row) - lengths[b]: len(row)] = self.LOGPROB
        return Batch(output_ids=output_ids, logprobs=logprobs, generation_lengths=torch.tensor(lengths),
                     unpadded_sequence_lengths=torch.tensor([len(r) for r in rows]),
                     truncated=torch.zeros(len(rows), dtype=torch.bool))


def test_scripted_moves_give_chat_turns_masks_and_rewards(ray_cluster):
    from posttrain.data.message_log import flatten_message_logs
    from posttrain.data.processors import build_prompt_message_log
    from posttrain.environments.registry import EnvRouter, create_env
    from posttrain.environments.sliding_puzzle_env import instructions
    from posttrain.environments.tools.tool_env import ToolEnvironment
    from posttrain.models.tiny import build_tokenizer
    from posttrain.rollouts import run_multi_turn_rollout

    tokenizer = build_tokenizer()
    boards = {"A": [[1, 2, 3], [4, 5, 6], [7, 0, 8]], "B": [[1, 2, 3], [4, 5, 6], [0, 7, 8]]}
    records = [{"prompt": f"Puzzle {k}. " + instructions(b), "board": b, "stop_strings": ["</action>"],
                "task_name": "sliding_puzzle"} for k, b in boards.items()]
    records.append({"prompt": "Tools C: what is 6*7?", "answer": "42", "task_name": "tools",
                    "tools": ToolEnvironment.prompt_tools({"tools": ["calculator"]})})
    datums = [build_prompt_message_log(r, tokenizer, 2048, idx=i) for i, r in enumerate(records)]
    assert "You may call tools" in datums[2].prompt  # the tiny template's fallback
    scripts = {
        # A: a wrong-way move, then two moves that solve it (generation stops at </action>: no eos).
        "Puzzle A": ["<action>down</action>", "<action>up</action>", "<action>left</action>"],
        # B: never solved within the turn limit.
        "Puzzle B": ["<action>right</action>", "<action>left</action>", "<action>right</action>",
                     "<action>left</action>"],
        # C: a calculator call, then the final answer (each turn ends with the eos token).
        "Tools C": ['<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call><|end|>',
                    "It is \\boxed{42}<|end|>"],
    }
    generation = ScriptedGeneration(tokenizer, scripts)
    envs = {"sliding_puzzle": create_env("sliding_puzzle", {"max_moves": 10}),
            "tools": create_env("tools", {"tools": ["calculator"]})}
    try:
        result = run_multi_turn_rollout(generation, datums, tokenizer, envs, max_seq_len=2048, max_rollout_turns=4)
    finally:
        EnvRouter(envs).shutdown()
    assert result.rewards.tolist() == [1.0, 0.0, 1.0]
    assert result.answers[2] == "42"
    assert result.metrics["avg_turns_per_sample"] == (3 + 4 + 2) / 3
    assert result.metrics["max_turns_reached_rate"] == pytest.approx(1 / 3)
    assert result.metrics["env/tools/tool_calls"] == 1.0 and result.metrics["env/tools/tool_errors"] == 0.0
    # Stop strings: the puzzle rows stop at </action> on every turn; the tools row uses the default.
    assert generation.stop_strings_seen[0] == [["</action>"], ["</action>"], None]
    assert generation.stop_strings_seen[1] == [["</action>"], ["</action>"], None]

    logs = [d.message_log for d in datums]
    assert [m["role"] for m in logs[0]] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    observation = logs[0][2]
    assert observation["content"] == "Moved down.\nBoard:\n1 2 3\n4 _ 6\n7 5 8"
    # Rendered as the next chat turn; the assistant turn that stopped at </action> is closed first.
    assert tokenizer.decode(observation["token_ids"].tolist()) == (
        "<|end|><|user|>Moved down.\nBoard:\n1 2 3\n4 _ 6\n7 5 8<|end|><|assistant|>")
    tool_turn = logs[2][2]
    assert tool_turn["role"] == "tool" and tool_turn["content"] == "42"
    # The tiny template has no tool role: a <tool_response> user turn; the model's eos already closed its turn.
    assert tokenizer.decode(tool_turn["token_ids"].tolist()) == "<|user|><tool_response>\n42\n</tool_response><|end|><|assistant|>"

    batch = flatten_message_logs(logs, pad_token_id=tokenizer.pad_token_id)
    for row, log in enumerate(logs):
        expected = torch.cat([torch.full((len(m["token_ids"]),), float(m["role"] == "assistant")) for m in log])
        assert torch.equal(batch["token_mask"][row, : len(expected)], expected)
        assert batch["token_mask"][row, len(expected):].sum() == 0
        generated = batch["generation_logprobs"][row][batch["token_mask"][row] == 1]
        assert torch.all(generated == ScriptedGeneration.LOGPROB)


def tiny_reward_model(out: Path) -> Path:
    """A tiny sequence-classification model (random score head) saved like `posttrain rm` exports."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from posttrain.models.tiny import build_tiny_model

    lm_dir = build_tiny_model(out.parent / "rm_lm")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(lm_dir, num_labels=1)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(lm_dir).save_pretrained(out)
    return out


CONFIG = f"""
defaults: {REPO}/examples/configs/grpo_math_tiny.yaml
sft_warmup: null
grpo:
  num_prompts_per_step: 6
  num_generations_per_prompt: 4
  max_num_steps: 2
  max_rollout_turns: 3
  val_period: 0
  val_at_start: false
  val_at_end: false
  max_val_samples: 2
policy:
  train_global_batch_size: 24
  train_micro_batch_size: 24
  logprob_batch_size: 24
  max_total_sequence_length: 900
  generation:
    max_new_tokens: 8
data:
  num_train: 6
  num_validation: 2
  blend:
    - {{name: sliding_puzzle, dataset: env}}
    - {{name: calc, env: tools, dataset: arithmetic, num_train: 16, num_validation: 2}}
    - {{name: guess, env: textarena, dataset: env}}
    - {{name: gym, env: http, dataset: jsonl, train_path: gym.jsonl}}
    - {{name: rm, env: reward_model, dataset: arithmetic, num_train: 8, num_validation: 2}}
    - {{name: judged, env: judge, dataset: arithmetic, num_train: 8, num_validation: 2}}
env:
  sliding_puzzle: {{size: 2, shuffle_moves: 3, max_moves: 3}}
  tools: {{tools: [calculator], max_tool_calls: 2, math: {{answer_format: last_number}}}}
  textarena: {{game: GuessTheNumber-v0}}
  http: {{servers: {{calc: URL}}, timeout_s: 120, retries: 1}}
  reward_model: {{model_path: RM_DIR}}
  judge: {{judge_model: tiny, mode: pairwise, comparison_strategy: circular, max_new_tokens: 4}}
logger:
  log_dir: logs/games
  progress_bar: false
  report: false
  tensorboard_enabled: false
checkpointing:
  enabled: false
"""


def test_grpo_trains_on_games_tools_and_a_resources_server_with_several_turns(tmp_path):
    pytest.importorskip("textarena")
    pytest.importorskip("fastapi")
    from posttrain.environments.resources_server import ServerThread, make_app

    app = make_app()
    gym_rows = [{"responses_create_params": {"input": [{"role": "user", "content": f"{a}+{a}="}],
                                             "tools": [{"type": "function", "name": "calculator"}]},
                 "agent_ref": {"type": "responses_api_agents", "name": "calc"}, "expected_answer": str(2 * a)}
                for a in range(6)]
    (tmp_path / "gym.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gym_rows))
    rm_dir = tiny_reward_model(tmp_path / "rm")
    with ServerThread(app) as url:
        (tmp_path / "games.yaml").write_text(CONFIG.replace("URL", url).replace("RM_DIR", str(rm_dir)))
        result = subprocess.run([sys.executable, "-m", "posttrain", "grpo", "--config", "games.yaml"], cwd=tmp_path,
                                capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "logs/games/metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if "train/loss" in row]
    assert len(train) == 2
    for row in train:
        assert torch.isfinite(torch.tensor(row["train/loss"]))
        counts = [row.get(f"train/reward_count/{task}", 0.0)
                  for task in ("sliding_puzzle", "calc", "guess", "gym", "rm", "judged")]
        assert sum(counts) == 24
        if counts[0]:  # a puzzle episode lasts more than one turn unless its first move solves it
            assert row["train/avg_turns_per_sample"] > 1.0
        if counts[1]:  # the tools environment reports its counts (zero calls is fine for the tiny model)
            assert row["train/env/calc/tool_calls"] >= 0 and "train/env/calc/tool_errors" in row
        if counts[4]:  # reward-model scores of an untrained head: real numbers, not the 0 of a failure
            assert row["train/env/rm/scored"] == counts[4] and row["train/reward/rm"] != 0.0
        if counts[5]:  # pairwise GenRM: circular, one comparison per response in groups of 4
            assert row["train/env/judged/judgements"] == counts[5]
    assert any(row.get("train/reward_count/sliding_puzzle") for row in train)  # seeded: drawn at step 1
    gym_samples = sum(row.get("train/reward_count/gym", 0.0) for row in train)
    # Each gym episode seeded a session on the server and the HTTP environment counted nothing failing.
    assert len(app.state.sessions) >= gym_samples / 4  # at least one session per gym prompt drawn
    seeded_rows = [s["row"] for s in app.state.sessions.values() if "row" in s]
    assert seeded_rows and all(r["agent_ref"]["name"] == "calc" and "responses_create_params" in r for r in seeded_rows)
    if gym_samples:
        assert all(row.get("train/env/gym/seed_failures", 0.0) == 0 and row.get("train/env/gym/verify_failures", 0.0) == 0
                   for row in train)
        assert any("train/env/gym/reward/correct" in row for row in train)
