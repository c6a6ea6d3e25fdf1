"""textarena's single-player games as a multi-turn environment (optional extra: `posttrain[textarena]`).

`env.textarena.game` names a game id (`GuessTheNumber-v0`, `TowerOfHanoi-v0-medium`, ...) from an
allow-list of games that run offline and work in textarena 0.7.4 (`OFFLINE_GAMES`; Wordle, Hangman
and the other NLTK games download data, FifteenPuzzle and Klondike are broken there).

Rows (`data.dataset=env`, `make_rows`) carry the game id and a seed; the prompt is the game's first
observation for that seed. Each episode (one sample) gets its own game instance, made at its first
step and reset with the row's seed, so its first observation is the prompt the model saw. Each turn
the model's last message is the action (textarena parses its own format, e.g. `[5]`); the game's new
messages (not the whole history; at most `max_observation_chars`, the end kept) come back as the
next user turn. Reward at the end only: the game's reward for player 0 (1.0 for a win; some games
give partial credit, which `win_only` turns into 0).

textarena's `reset` seeds the global `random`; episodes of one actor interleave, so a game whose
later moves draw random numbers is reproducible only per actor call order (the board itself is).
Episodes the rollout stops (token limit, max turns) end in `finish`: their games are dropped, reward
0 (an unfinished game is not won); abandoned ones are dropped oldest first beyond `max_live_games`.
"""

from __future__ import annotations

import itertools
import re
from collections import OrderedDict
from typing import Any, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from posttrain.environments.interface import Environment, EnvironmentReturn, MessageLog, ended, last_assistant_text
from posttrain.environments.registry import register_env

# Single-player games that need no download and run in textarena 0.7.4 (variants such as
# `-hard` or `-small` of these are allowed too).
OFFLINE_GAMES = (
    "GuessTheNumber-v0", "TowerOfHanoi-v0", "FrozenLake-v0", "Mastermind-v0", "ThreeCardMonte-v0",
    "Blackjack-v0", "LightsOut-v0", "Minesweeper-v0", "Sudoku-v0", "Sokoban-v0", "Countdown-v0",
)
_WRAPPER_SUFFIX = re.compile(r"-(raw|train)$")


def _import_textarena():
    try:
        import textarena
    except ImportError:
        raise ImportError("env.textarena needs the textarena extra: pip install 'posttrain[textarena]'") from None
    return textarena


class TextArenaConfig(BaseModel):
    """`env.textarena.*`."""

    model_config = ConfigDict(extra="forbid")

    game: str = Field("GuessTheNumber-v0", description="textarena game id from the offline allow-list (OFFLINE_GAMES).")
    max_observation_chars: int = Field(2000, ge=100, description="Longest observation sent back (its end is kept). Default 2000.")
    win_only: bool = Field(False, description="Reward 1 only for a win (drop textarena's partial credit). Default False.")
    max_live_games: int = Field(4096, ge=1, description="Open game instances kept; older abandoned ones are dropped.")
    max_action_chars: int = Field(1000, ge=1, description="Longest action passed to the game (its end is kept).")

    @field_validator("game")
    @classmethod
    def _allowed(cls, game: str) -> str:
        base = _WRAPPER_SUFFIX.sub("", game)
        if not any(base == g or base.startswith(g + "-") for g in OFFLINE_GAMES):
            raise ValueError(f"game {game!r} is not in the offline allow-list: {', '.join(OFFLINE_GAMES)} (and their variants)")
        return base


def _raw_id(game: str) -> str:
    return game + "-raw"  # the raw wrapper gives the new messages, not the whole history


def new_messages(observation: Any, limit: int) -> str:
    """The game's messages in a raw observation (the player's own echoed actions left out), as text
    of at most `limit` characters (the end kept)."""
    if isinstance(observation, str):
        text = observation
    else:
        parts = []
        for item in observation or []:
            sender, message = item[0], item[1]
            kind = getattr(item[2], "name", "") if len(item) > 2 else ""
            if kind != "PLAYER_ACTION" and sender != 0:
                parts.append(str(message))
        text = "\n".join(parts)
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


@register_env("textarena")
class TextArenaEnvironment(Environment):
    """One textarena game per episode. Config: `TextArenaConfig`; rows carry `game` and `game_seed`."""

    config_class = TextArenaConfig
    live_episode_state = True  # the games live in this actor (`_game_key`)

    def __init__(self, cfg: TextArenaConfig | dict | None = None):
        self.cfg = cfg if isinstance(cfg, TextArenaConfig) else TextArenaConfig.model_validate(cfg or {})
        self.ta = _import_textarena()
        self.games: OrderedDict[str, Any] = OrderedDict()
        self._ids = itertools.count()
        self.dropped_games = 0

    @classmethod
    def make_rows(cls, cfg, count: int, seed: int) -> list[dict]:
        cfg = cfg if isinstance(cfg, TextArenaConfig) else TextArenaConfig.model_validate(cfg or {})
        ta = _import_textarena()
        rows = []
        for i in range(count):
            game = ta.make(_raw_id(cfg.game))
            game.reset(num_players=1, seed=seed + i)
            _, observation = game.get_observation()
            # The rules are not cut (an over-long prompt is masked out like any other).
            rows.append({"prompt": new_messages(observation, 10**9), "answer": None,
                         "game": cfg.game, "game_seed": seed + i})
            game.close()
        return rows

    @classmethod
    def metadata_problem(cls, metadata: dict) -> Optional[str]:
        if not isinstance(metadata.get("game_seed"), int):
            return "textarena rows need an integer 'game_seed' (make them with data.dataset=env)"
        return None

    def _start(self, meta: dict) -> tuple[str, Any]:
        game = self.ta.make(_raw_id(meta.get("game") or self.cfg.game))
        game.reset(num_players=1, seed=int(meta["game_seed"]))
        game.get_observation()  # the prompt the model already saw
        key = f"{next(self._ids)}"
        self.games[key] = game
        while len(self.games) > self.cfg.max_live_games:
            self.games.popitem(last=False)
            self.dropped_games += 1
        return key, game

    def step(self, message_logs: list[MessageLog], metadata: list[dict]) -> EnvironmentReturn:
        observations, out_meta, rewards, done = [], [], [], []
        for log_, meta in zip(message_logs, metadata, strict=True):
            problem = self.metadata_problem(meta)
            if problem:
                raise ValueError(f"textarena environment: {problem}")
            key = meta.get("_game_key")
            game = self.games.get(key) if key is not None else None
            if game is None:
                key, game = self._start(meta)
            action = last_assistant_text(log_)[-self.cfg.max_action_chars:]
            reward, finished, text = 0.0, False, ""
            try:
                finished, _ = game.step(action)
                if finished:
                    scores, info = game.close()
                    reward = float(scores.get(0, 0.0))
                    reason = (info.get(0) or {}).get("reason", "") if isinstance(info, dict) else ""
                    text = f"Game over. {reason}".strip()
                else:
                    _, observation = game.get_observation()
                    text = new_messages(observation, self.cfg.max_observation_chars)
            except Exception as e:  # a game that fails on some input ends the episode, not the run
                finished, text = True, f"Game error: {type(e).__name__}: {str(e)[:200]}"
            if finished:
                self.games.pop(key, None)
                if self.cfg.win_only:
                    reward = float(reward >= 1.0)
            observations.append({"role": "user", "content": text or "(no message)", "chat_template": True})
            out_meta.append({**meta, "_game_key": key})
            rewards.append(reward)
            done.append(finished)
        n = len(message_logs)
        return EnvironmentReturn(
            observations=observations, metadata=out_meta, next_stop_strings=[None] * n,
            rewards=torch.tensor(rewards, dtype=torch.float32), terminateds=torch.tensor(done, dtype=torch.bool),
            answers=[None] * n,
        )

    def finish(self, message_logs: list[MessageLog], metadata: list[dict]) -> EnvironmentReturn:
        for meta in metadata:
            self.games.pop(meta.get("_game_key"), None)
        return ended(len(message_logs), metadata)

    def shutdown(self) -> None:
        self.games.clear()
