"""Multi-turn environments on scripted moves: sliding puzzle, textarena, tool calling (parsing,
calculator, BM25 search, budget, errors) and the chat rendering of tool descriptions and results."""

from __future__ import annotations

import json
import random

import pytest

from posttrain.data import chat
from posttrain.environments.sliding_puzzle_env import (
    SlidingPuzzleEnvironment,
    apply_move,
    render_board,
    shuffled_board,
    solved_board,
)
from posttrain.environments.tools.builtin import Calculator, DocumentSearch, ToolError, safe_eval
from posttrain.environments.tools.parsing import parse_tool_calls
from posttrain.environments.tools.tool_env import ToolEnvConfig, ToolEnvironment
from posttrain.models.tiny import build_tokenizer

# A Qwen-like template that supports tools= and the tool role (as Qwen2.5 / Hermes templates do).
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def user_log(*assistant_turns: str) -> list[dict]:
    log = [{"role": "user", "content": "q"}]
    for text in assistant_turns:
        log += [{"role": "assistant", "content": text}]
    return log


# ------------------------------------------------------------------------------------ sliding puzzle

def test_shuffled_boards_are_solvable_by_reversing_the_shuffle():
    for seed in range(20):
        rng = random.Random(seed)
        board = shuffled_board(3, 12, rng)
        assert board != solved_board(3)
        assert sorted(t for row in board for t in row) == list(range(9))
        # permutation parity + blank row distance is even for every board reachable from solved
        flat = [t for row in board for t in row if t]
        inversions = sum(1 for i in range(len(flat)) for j in range(i + 1, len(flat)) if flat[i] > flat[j])
        assert inversions % 2 == 0


def test_moves_slide_the_tile_into_the_blank():
    board = [[1, 2, 3], [4, 0, 6], [7, 5, 8]]
    assert apply_move(board, "up") == [[1, 2, 3], [4, 5, 6], [7, 0, 8]]
    assert apply_move(board, "slide 3 2") == [[1, 2, 3], [4, 5, 6], [7, 0, 8]]
    assert apply_move(board, "right") == [[1, 2, 3], [0, 4, 6], [7, 5, 8]]
    assert apply_move(board, "slide 1 1") is None  # not next to the blank
    assert apply_move([[1, 2], [3, 0]], "up") is None  # nothing below the blank
    assert apply_move(board, "jump") is None
    assert render_board(board) == "1 2 3\n4 _ 6\n7 5 8"


def test_sliding_puzzle_rewards_only_the_solving_move_and_keeps_state_in_metadata():
    env = SlidingPuzzleEnvironment({"max_moves": 3})
    meta = {"board": [[1, 2, 3], [4, 5, 6], [7, 0, 8]]}
    out = env.step([user_log("<action>down</action>")], [meta])  # tile above moves down: wrong way
    assert out.rewards.tolist() == [0.0] and out.terminateds.tolist() == [False]
    assert out.metadata[0]["board"] == [[1, 2, 3], [4, 0, 6], [7, 5, 8]] and out.metadata[0]["moves"] == 1
    assert out.next_stop_strings == [["</action>"]] and out.observations[0]["chat_template"]
    out = env.step([user_log("<action>up</action>")], out.metadata)
    out = env.step([user_log("thinking... <action>left</action>")], out.metadata)
    assert out.rewards.tolist() == [1.0] and out.terminateds.tolist() == [True]
    assert "Solved" in out.observations[0]["content"]
    assert meta == {"board": [[1, 2, 3], [4, 5, 6], [7, 0, 8]]}  # input untouched


def test_sliding_puzzle_ends_unsolved_after_max_moves_and_reports_illegal_moves():
    env = SlidingPuzzleEnvironment({"max_moves": 2})
    out = env.step([user_log("no tags here")], [{"board": [[1, 2], [0, 3]]}])
    assert "No move found" in out.observations[0]["content"] and not out.terminateds[0]
    out = env.step([user_log("<action>slide 1 2</action>")], out.metadata)
    assert "Illegal move" in out.observations[0]["content"]
    assert out.terminateds.tolist() == [True] and out.rewards.tolist() == [0.0]


def test_sliding_puzzle_rows_depend_on_seed_and_index_only():
    rows = SlidingPuzzleEnvironment.make_rows({"size": 3, "shuffle_moves": 6}, 4, seed=7)
    again = SlidingPuzzleEnvironment.make_rows({"size": 3, "shuffle_moves": 6}, 2, seed=9)
    assert rows[2]["board"] == again[0]["board"]
    assert render_board(rows[0]["board"]) in rows[0]["prompt"] and rows[0]["stop_strings"] == ["</action>"]
    assert SlidingPuzzleEnvironment.metadata_problem({"board": [[1, 1], [0, 3]]}) is not None


# ----------------------------------------------------------------------------------------- textarena

def test_textarena_guess_the_number_episode_ends_with_the_game_reward():
    pytest.importorskip("textarena")
    from posttrain.environments.textarena_env import TextArenaConfig, TextArenaEnvironment

    with pytest.raises(ValueError, match="allow-list"):
        TextArenaConfig(game="Wordle-v0")
    cfg = TextArenaConfig(game="GuessTheNumber-v0", max_observation_chars=200)
    row = TextArenaEnvironment.make_rows(cfg, 1, seed=3)[0]
    assert "Guess The Number" in row["prompt"] and row["game_seed"] == 3
    env = TextArenaEnvironment(cfg)
    meta = {"game": row["game"], "game_seed": 3}
    low, high = 1, 20
    for turn in range(10):  # binary search on the hints
        guess = (low + high) // 2
        out = env.step([user_log(f"My guess: [{guess}]")], [meta])
        meta = out.metadata[0]
        if out.terminateds[0]:
            break
        text = out.observations[0]["content"]
        assert len(text) <= 200 and f"[{guess}]" not in text  # our own action is not echoed
        if "higher" in text:
            low = guess + 1
        else:
            high = guess - 1
    assert out.terminateds.tolist() == [True] and out.rewards.tolist() == [1.0]
    assert env.games == {}  # the finished game is closed
    # A game the rollout stops (turn or token limit) is released by finish, unwon: reward 0
    out = env.step([user_log("My guess: [1]")], [{"game": row["game"], "game_seed": 4}])
    assert len(env.games) == 1 and not out.terminateds[0]
    assert env.finish([user_log("My guess: [1]")], out.metadata).rewards.tolist() == [0.0] and env.games == {}


def test_every_allow_listed_textarena_game_runs_offline():
    pytest.importorskip("textarena")
    from posttrain.environments.textarena_env import OFFLINE_GAMES, TextArenaEnvironment

    for game in OFFLINE_GAMES:
        row = TextArenaEnvironment.make_rows({"game": game}, 1, seed=1)[0]
        env = TextArenaEnvironment({"game": game})
        out = env.step([user_log("[1]")], [{"game": row["game"], "game_seed": 1}])
        assert row["prompt"] and out.observations[0]["content"] and not out.observations[0]["content"].startswith("Game error"), game


# ------------------------------------------------------------------------------------- tool calling

def test_parse_tool_calls_forms_and_errors():
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> and '
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3\\"}"}</tool_call>'
            "<tool_call>{oops}</tool_call><tool_call>[1]</tool_call>"
            '<tool_call>{"name": "x", "arguments": 5}</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("calculator", {"expression": "1+2"}, True), ("calculator", {"expression": "3"}, True)]
    assert "not valid JSON" in calls[2].error and "string \"name\"" in calls[3].error
    assert "must be a JSON object" in calls[4].error
    custom = parse_tool_calls('CALL calculator {"name": "calculator", "arguments": {}} END', r"CALL \w+ (\{.*?\}) END")
    assert custom[0].name == "calculator"
    assert parse_tool_calls("no calls") == []


def test_calculator_evaluates_arithmetic_without_eval():
    assert safe_eval("(12.5 * 4) / 2 - 2**3") == 17.0
    assert Calculator()("sqrt(16) + abs(-2) * pi / pi") == "6"
    assert Calculator()("7 // 2 + 7 % 2 + 2^3") == "12"
    for bad, message in [("__import__('os').system('x')", "unsupported"), ("().__class__", "unsupported"),
                         ("9**9**9", "exponent"), ("1/0", "division"), ("x", "unsupported"),
                         ("'a' * 3", "unsupported"), ("10**999", "too large"), ("1 +", "not an arithmetic")]:
        with pytest.raises(ToolError, match=message):
            safe_eval(bad)


def test_search_ranks_documents_with_bm25(tmp_path):
    pytest.importorskip("rank_bm25")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps(d) for d in [
        {"title": "Paris", "text": "Paris is the capital of France."},
        {"title": "Rome", "text": "Rome is the capital of Italy."},
        {"title": "Bread", "text": "Bread is made from flour and water."},
    ]))
    search = DocumentSearch(ToolEnvConfig(tools=["search"], documents=str(docs), search_top_k=1))
    assert search("capital of Italy") == "[1] Rome: Rome is the capital of Italy."
    assert search("zebra") == "No document matches."
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"title": "no text"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        DocumentSearch(ToolEnvConfig(tools=["search"], documents=str(bad)))


def test_tool_env_runs_calls_reports_errors_enforces_budget_and_grades_the_answer():
    env = ToolEnvironment({"tools": ["calculator"], "max_tool_calls": 2})
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    logs = [
        user_log(call),
        user_log('<tool_call>{"name": "weather", "arguments": {}}</tool_call>'),
        user_log('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'),
        user_log("<tool_call>not json</tool_call>"),
        user_log("The answer is \\boxed{42}"),
    ]
    out = env.step(logs, [{"ground_truth": "42"}] * 5)
    contents = [o["content"] for o in out.observations]
    assert contents[0] == "42" and out.observations[0]["role"] == "tool" and out.observations[0]["chat_template"]
    assert "unknown tool 'weather'" in contents[1]
    assert "bad arguments" in contents[2] and "not valid JSON" in contents[3]
    assert out.terminateds.tolist() == [False, False, False, False, True]
    assert out.rewards.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0] and out.answers[4] == "42"
    assert out.metadata[0]["tool_calls_used"] == 1
    # budget: two calls in one message spend it; the next call ends the episode with reward 0
    out = env.step([user_log(call + call + call)], [out.metadata[0]])
    assert out.observations[0]["content"].count("42") == 1 and "budget" in out.observations[0]["content"]
    out = env.step([user_log(call)], out.metadata)
    assert out.terminateds.tolist() == [True] and out.rewards.tolist() == [0.0]
    assert env.metrics() == {"tool_calls": 5, "tool_errors": 3, "over_budget": 1}
    env.shutdown()


def test_tool_env_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown tool 'calculater'.*did you mean 'calculator'"):
        ToolEnvConfig(tools=["calculater"])
    with pytest.raises(ValueError, match="needs a group"):
        ToolEnvConfig(tool_call_pattern="<call>.*</call>")


# -------------------------------------------------------------------------------------- chat render

def test_tools_fall_back_to_the_system_message_when_the_template_ignores_them():
    tokenizer = build_tokenizer()
    text = chat.render_prompt(tokenizer, [{"role": "user", "content": "2+2?"}], [Calculator.schema])
    assert text.startswith("<|system|>You may call tools.") and '"name": "calculator"' in text
    assert text.endswith("<|user|>2+2?<|end|><|assistant|>")


def test_native_tool_template_and_tool_turn_rendering():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = QWEN_LIKE
    text = chat.render_prompt(tokenizer, [{"role": "user", "content": "hi"}], [Calculator.schema])
    assert text.startswith("<|im_start|>system\n# Tools\n") and "You may call tools" not in text
    # The tool result follows the generated turn exactly as the template renders a whole conversation.
    generated = tokenizer("<tool_call>{}</tool_call><|im_end|>", add_special_tokens=False)["input_ids"]
    turn_text, ids = chat.chat_turn_ids(tokenizer, {"role": "tool", "content": "42"}, generated)
    assert turn_text.startswith("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>")
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
             {"role": "tool", "content": "42"}]
    whole = tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.apply_chat_template(convo[:1], tokenize=False, add_generation_prompt=True)
    assert prompt + "<tool_call>{}</tool_call><|im_end|>" + turn_text == whole


def test_tool_turn_falls_back_to_a_user_message_and_closes_an_unfinished_turn():
    tokenizer = build_tokenizer()
    finished = tokenizer("<action>up</action><|end|>", add_special_tokens=False)["input_ids"]
    text, _ = chat.chat_turn_ids(tokenizer, {"role": "tool", "content": "42"}, finished)
    assert text == "<|user|><tool_response>\n42\n</tool_response><|end|><|assistant|>"
    unfinished = tokenizer("<action>up</action>", add_special_tokens=False)["input_ids"]  # stopped at a stop string
    text, ids = chat.observation_ids(tokenizer, {"role": "user", "content": "B", "chat_template": True}, unfinished)
    assert text == "<|end|><|user|>B<|end|><|assistant|>" and ids[0] == tokenizer.eos_token_id
    text, _ = chat.observation_ids(tokenizer, {"role": "environment", "content": "raw"}, finished)
    assert text == "raw"
