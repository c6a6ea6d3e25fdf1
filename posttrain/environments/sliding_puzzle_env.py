"""Sliding puzzle: a multi-turn game. The model moves tiles until the board reads 1, 2, ..., blank.

Each turn the model writes one move in `<action>...</action>` (generation stops at `</action>`):
- `up`, `down`, `left`, `right`: the tile next to the blank slides that way into it (`up` moves
  the tile below the blank up);
- `slide R C`: slide the tile at row R, column C (1-based) into the blank, which must be next to it.
The environment answers with the board after the move (or says why the move was not legal),
rendered as the next user turn of the chat template. Reward `reward_solved` (default 1.0) when the
board is solved; the episode also ends, with reward 0, after `max_moves` moves.

Boards are made from the solved one by `shuffle_moves` random legal moves, so every board is
solvable (`make_rows`, `data.dataset=env`); the row carries the board, and the state of the
episode (the board, the moves made) travels in the sample's metadata: the environment keeps none.
"""

from __future__ import annotations

import random
import re
from typing import Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from posttrain.environments.interface import Environment, EnvironmentReturn, MessageLog, last_assistant_text
from posttrain.environments.registry import register_env

Board = list[list[int]]  # 0 is the blank

ACTION = re.compile(r"<action>(.*?)</action>", re.DOTALL | re.IGNORECASE)
STOP_STRINGS = ["</action>"]
# Where the blank goes when the tile on that side slides in: "up" brings the tile below (+1 row) up.
DIRECTIONS = {"up": (1, 0), "down": (-1, 0), "left": (0, 1), "right": (0, -1)}


class SlidingPuzzleConfig(BaseModel):
    """`env.sliding_puzzle.*`."""

    model_config = ConfigDict(extra="forbid")

    size: int = Field(3, ge=2, le=6, description="Board side (size x size tiles, one blank). Default 3.")
    shuffle_moves: int = Field(8, ge=1, le=10_000, description="Random legal moves that scramble each board. Default 8.")
    max_moves: int = Field(20, ge=1, description="Moves (legal or not) before an unsolved episode ends with reward 0.")
    reward_solved: float = Field(1.0, description="Reward of the turn that solves the board. Default 1.0.")


def solved_board(size: int) -> Board:
    return [[(r * size + c + 1) % (size * size) for c in range(size)] for r in range(size)]


def find_blank(board: Board) -> tuple[int, int]:
    for r, row in enumerate(board):
        for c, tile in enumerate(row):
            if tile == 0:
                return r, c
    raise ValueError("board has no blank (0)")


def legal_moves(board: Board) -> list[str]:
    size = len(board)
    r, c = find_blank(board)
    return [name for name, (dr, dc) in DIRECTIONS.items() if 0 <= r + dr < size and 0 <= c + dc < size]


def apply_move(board: Board, move: str) -> Optional[Board]:
    """The board after `move` (`up`/`down`/`left`/`right` or `slide R C`), or None if it is not legal."""
    size = len(board)
    r, c = find_blank(board)
    words = move.strip().lower().split()
    if len(words) == 1 and words[0] in DIRECTIONS:
        dr, dc = DIRECTIONS[words[0]]
        tr, tc = r + dr, c + dc
    elif len(words) == 3 and words[0] == "slide" and words[1].isdigit() and words[2].isdigit():
        tr, tc = int(words[1]) - 1, int(words[2]) - 1
        if abs(tr - r) + abs(tc - c) != 1:
            return None
    else:
        return None
    if not (0 <= tr < size and 0 <= tc < size):
        return None
    new = [row[:] for row in board]
    new[r][c], new[tr][tc] = new[tr][tc], 0
    return new


def shuffled_board(size: int, moves: int, rng: random.Random) -> Board:
    """A board `moves` random legal moves from solved (never undoing the previous move), not solved."""
    undo = {"up": "down", "down": "up", "left": "right", "right": "left"}
    board, last = solved_board(size), None
    for _ in range(moves):
        options = [m for m in legal_moves(board) if m != undo.get(last)]
        last = rng.choice(options)
        board = apply_move(board, last)
    while board == solved_board(size):  # rare: the walk came back; one more move
        board = apply_move(board, rng.choice(legal_moves(board)))
    return board


def render_board(board: Board) -> str:
    width = len(str(len(board) ** 2 - 1))
    return "\n".join(" ".join("_".rjust(width) if t == 0 else str(t).rjust(width) for t in row) for row in board)


def instructions(board: Board) -> str:
    size = len(board)
    return (
        f"Solve the {size}x{size} sliding puzzle: order the tiles 1 to {size * size - 1} row by row with the blank (_) "
        "last. Each turn, make one move: <action>up</action>, down, left or right slides the tile next to the blank "
        "that way into it, or <action>slide R C</action> slides the tile at row R, column C (from 1).\n"
        f"Board:\n{render_board(board)}"
    )


@register_env("sliding_puzzle")
class SlidingPuzzleEnvironment(Environment):
    """Multi-turn sliding puzzle. Config: `SlidingPuzzleConfig`; rows from `make_rows` carry `board`."""

    config_class = SlidingPuzzleConfig

    def __init__(self, cfg: SlidingPuzzleConfig | dict | None = None):
        self.cfg = cfg if isinstance(cfg, SlidingPuzzleConfig) else SlidingPuzzleConfig.model_validate(cfg or {})

    @classmethod
    def make_rows(cls, cfg, count: int, seed: int) -> list[dict]:
        cfg = cfg if isinstance(cfg, SlidingPuzzleConfig) else SlidingPuzzleConfig.model_validate(cfg or {})
        rows = []
        for i in range(count):
            board = shuffled_board(cfg.size, cfg.shuffle_moves, random.Random(seed + i))
            rows.append({"prompt": instructions(board), "answer": None, "board": board, "stop_strings": STOP_STRINGS})
        return rows

    @classmethod
    def metadata_problem(cls, metadata: dict) -> Optional[str]:
        board = metadata.get("board")
        if not (isinstance(board, list) and board and all(isinstance(row, list) and len(row) == len(board) for row in board)):
            return "sliding_puzzle rows need 'board': a square list of rows of tiles (0 = blank)"
        tiles = sorted(t for row in board for t in row)
        if tiles != list(range(len(board) ** 2)):
            return f"'board' must hold each of 0..{len(board) ** 2 - 1} once, got {tiles}"
        return None

    def step(self, message_logs: list[MessageLog], metadata: list[dict]) -> EnvironmentReturn:
        observations, out_meta, rewards, done, answers = [], [], [], [], []
        for log_, meta in zip(message_logs, metadata, strict=True):
            problem = self.metadata_problem(meta)
            if problem:
                raise ValueError(f"sliding_puzzle environment: {problem}")
            board, moves = meta["board"], int(meta.get("moves", 0)) + 1
            actions = ACTION.findall(last_assistant_text(log_))
            move = actions[-1].strip() if actions else None
            new = apply_move(board, move) if move else None
            if move is None:
                feedback = "No move found: write one move as <action>up</action> (or down, left, right, slide R C)."
            elif new is None:
                feedback = f"Illegal move {move[:40]!r}; legal: {', '.join(legal_moves(board))}, or slide R C next to the blank."
            else:
                board, feedback = new, f"Moved {move}."
            solved = board == solved_board(len(board))
            out_of_moves = not solved and moves >= self.cfg.max_moves
            if solved:
                feedback += " Solved!"
            elif out_of_moves:
                feedback += f" Out of moves ({self.cfg.max_moves})."
            observations.append({"role": "user", "content": f"{feedback}\nBoard:\n{render_board(board)}", "chat_template": True})
            out_meta.append({**meta, "board": board, "moves": moves, "solved": solved})
            rewards.append(self.cfg.reward_solved if solved else 0.0)
            done.append(solved or out_of_moves)
            answers.append(move)
        n = len(message_logs)
        return EnvironmentReturn(
            observations=observations, metadata=out_meta, next_stop_strings=[list(STOP_STRINGS)] * n,
            rewards=torch.tensor(rewards, dtype=torch.float32), terminateds=torch.tensor(done, dtype=torch.bool),
            answers=answers,
        )
