"""Math environment: extract the final answer of a response and check it with math-verify.

Reward 1.0 when the extracted answer is mathematically equivalent to `metadata["ground_truth"]`
(numbers, fractions, decimals, LaTeX, simple expressions, as decided by Hugging Face's
`math-verify`), else 0.0. Every episode terminates after one turn. Follows NeMo-RL's
`MathEnvironment` (nemo_rl/environments/math_environment.py), with two differences:
- the answer is extracted by us first (`answer_format`), so the logged `answers` are exactly what
  was graded and a format can be enforced (e.g. only `\\boxed{}` answers count);
- only the **last** assistant message is graded (in a multi-turn episode earlier turns are
  drafts; for single-turn episodes this is the same as joining all assistant messages).

Why a process pool: math-verify's own timeout uses `signal.alarm`, which only works in the main
thread, and cannot interrupt long C-level work anyway (sympy evaluating `9^{9^{9^9}}` never yields
to Python). So verification runs in `num_workers` long-lived child processes with math-verify's
timeouts switched off; the parent waits at most `verify_timeout_s` per sample, kills a child that
overruns (the sample scores 0) and starts a fresh one. This works the same in the main thread,
in a worker thread and inside a Ray actor.
"""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from decimal import Decimal
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_ready
from pathlib import Path
from typing import Callable, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from posttrain.environments.interface import Environment, EnvironmentReturn, MessageLog, last_assistant_text
from posttrain.environments.registry import register_env

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------ answer extraction
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A number: 1,000 (thousands separators), 12, 3.5, .5. `(?!\d)` stops "1,0001" matching "1,000".
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"
# A minus directly before a number is a sign unless it follows something it could subtract from
# ("5-3" is 5 minus 3; "x=-3" and "is -3" are negative three).
_SIGN = r"(?:(?<![\w.)\]}])-)?"
_LAST_NUMBER_RE = re.compile(
    rf"\\[dt]?frac\{{\s*{_SIGN}\d+\s*\}}\{{\s*\d+\s*\}}"  # \frac{3}{4}, \dfrac{-1}{2}
    rf"|{_SIGN}(?:{_NUMBER})(?:\s*/\s*\d+(?![\d.]))?"  # 12, -3.5, 1,000, 3/4
)


_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def plain_numbers_equal(ground_truth: str, answer: str) -> Optional[bool]:
    """Exact comparison when both sides are plain decimal numbers ("46", "-3", "2.50"); else None.

    A fast path: such pairs need no symbolic parsing, and sending them through math-verify's
    subprocess costs ~1.5 ms each (most of a tiny model's GRPO step). Anything else (fractions,
    LaTeX, expressions, thousands separators) returns None and goes to math-verify.
    """
    a, b = ground_truth.strip(), answer.strip()
    if not (_PLAIN_NUMBER.fullmatch(a) and _PLAIN_NUMBER.fullmatch(b)):
        return None
    return Decimal(a) == Decimal(b)


def _matching_close_braces(text: str) -> dict[int, int]:
    """Map the index of every `{` to the index of its matching `}` (one O(n) pass).

    `\\{` and `\\}` are literal braces in LaTeX, not groups, so they are skipped.
    """
    matches: dict[int, int] = {}
    stack: list[int] = []
    for i, char in enumerate(text):
        if char not in "{}" or (i > 0 and text[i - 1] == "\\"):
            continue
        if char == "{":
            stack.append(i)
        elif stack:
            matches[stack.pop()] = i
    return matches


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last complete, non-empty `\\boxed{...}` (or `\\fbox{...}`), nested braces kept.

    An unterminated last box (a truncated response) is skipped in favour of the previous one.
    Runs in linear time, so adversarial inputs ("\\boxed{" x 10^5) cannot stall the caller.
    """
    starts = [m.end() - 1 for m in _BOXED_RE.finditer(text)]  # index of each box's "{"
    if not starts:
        return None
    closes = _matching_close_braces(text)
    for open_index in reversed(starts):
        close_index = closes.get(open_index)
        if close_index is not None:
            content = text[open_index + 1 : close_index].strip()
            if content:
                return content
    return None


def extract_hash(text: str) -> Optional[str]:
    """GSM8K style: what follows the last `####` on its line, without a trailing period."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    answer = tail.splitlines()[0].strip().rstrip(".").strip() if tail else ""
    return answer or None


def extract_last_number(text: str) -> Optional[str]:
    """The last integer, decimal or fraction (`3/4`, `\\frac{3}{4}`) in the text, commas removed."""
    last = None
    for last in _LAST_NUMBER_RE.finditer(text):
        pass
    if last is None:
        return None
    return re.sub(r"\s+", "", last.group(0)).replace(",", "")


def _extract_auto(text: str) -> Optional[str]:
    return extract_boxed(text) or extract_hash(text) or extract_last_number(text)


ANSWER_EXTRACTORS: dict[str, Callable[[str], Optional[str]]] = {
    "boxed": extract_boxed,
    "hash": extract_hash,
    "last_number": extract_last_number,
    "auto": _extract_auto,
}


def extract_answer(text: str, answer_format: str = "auto") -> Optional[str]:
    """Extract the final answer from a response; None when there is none.

    Args:
        text: the model's response.
        answer_format: `boxed` (last `\\boxed{...}`), `hash` (after `####`), `last_number`
            (last integer / decimal / fraction), or `auto` (boxed, then `####`, then last number).
            Defaults to `auto`.
    """
    try:
        extractor = ANSWER_EXTRACTORS[answer_format]
    except KeyError:
        raise ValueError(f"unknown answer_format {answer_format!r}; expected one of {sorted(ANSWER_EXTRACTORS)}") from None
    return extractor(text)


# ------------------------------------------------------------------------------- verification
_WORKER_SCRIPT = Path(__file__).with_name("_verify_worker.py")


class VerifierPool:
    """`num_workers` child processes that run math-verify, each call bounded by `timeout_s`.

    Args:
        num_workers: child processes verifying in parallel. Defaults to 1.
        timeout_s: longest one verification may take; an overrunning child is killed and
            replaced, and that sample scores 0. Defaults to 5.0.
        start_timeout_s: longest a fresh child may take to import math-verify. Defaults to 120.
    """

    def __init__(self, num_workers: int = 1, timeout_s: float = 5.0, start_timeout_s: float = 120.0):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._workers: list[Optional[tuple[subprocess.Popen, Connection]]] = [None] * num_workers
        self._lock = threading.Lock()
        self.num_timeouts = 0

    def _launch(self) -> tuple[subprocess.Popen, Connection]:
        # A fresh interpreter rather than fork (forking a process that holds threads, as Ray
        # actors and torch do, can deadlock the child) or multiprocessing's spawn (which
        # re-imports the parent's __main__).
        parent_sock, child_sock = socket.socketpair()
        with child_sock:
            process = subprocess.Popen(
                [sys.executable, str(_WORKER_SCRIPT), str(child_sock.fileno())],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        return process, Connection(parent_sock.detach())

    def _await_ready(self, index: int) -> None:
        process, conn = self._workers[index]
        exit_code = None
        try:
            ready = conn.poll(self.start_timeout_s) and conn.recv() == "ready"
        except (EOFError, OSError):  # the child closed its end: it is exiting (an import failed)
            ready = False
            try:
                exit_code = process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if not ready:
            self._kill(index)
            why = (f"exited with code {exit_code} before it was ready (its error is printed above)"
                   if exit_code is not None else f"did not start within {self.start_timeout_s}s")
            raise RuntimeError(f"math-verify worker process {why}; is math-verify installed, with its dependencies?")

    def _start_missing(self) -> None:
        missing = [i for i, worker in enumerate(self._workers) if worker is None]
        for i in missing:  # launch all, then wait, so the imports overlap
            self._workers[i] = self._launch()
        for i in missing:
            self._await_ready(i)

    def _kill(self, index: int) -> None:
        worker = self._workers[index]
        self._workers[index] = None
        if worker is None:
            return
        process, conn = worker
        conn.close()
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)

    def _restart(self, index: int) -> None:
        self._kill(index)
        self._workers[index] = self._launch()
        self._await_ready(index)

    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """1.0 / 0.0 per `(ground_truth, answer)` pair, in order; 0.0 on timeout or crash."""
        with self._lock:
            self._start_missing()
            results = [0.0] * len(pairs)
            pending = deque(range(len(pairs)))
            idle = list(range(self.num_workers))
            busy: dict[int, tuple[int, float]] = {}  # worker -> (sample, deadline)
            while pending or busy:
                while idle and pending:
                    worker, sample = idle.pop(), pending.popleft()
                    try:
                        self._workers[worker][1].send(pairs[sample])
                        busy[worker] = (sample, time.monotonic() + self.timeout_s)
                    except (BrokenPipeError, OSError):  # the child died between calls
                        self._restart(worker)
                        pending.appendleft(sample)
                        idle.append(worker)
                if not busy:
                    continue
                wait_s = max(0.0, min(deadline for _, deadline in busy.values()) - time.monotonic())
                ready = wait_for_ready([self._workers[w][1] for w in busy], timeout=wait_s)
                for worker, (sample, deadline) in list(busy.items()):
                    conn = self._workers[worker][1]
                    if conn in ready:
                        try:
                            results[sample] = float(conn.recv())
                        except (EOFError, OSError):  # crashed (e.g. out of memory): scores 0
                            self._restart(worker)
                    elif time.monotonic() >= deadline:
                        self.num_timeouts += 1
                        log.warning("math-verify timed out after %.1fs on answer %.200r", self.timeout_s, pairs[sample][1])
                        self._restart(worker)
                    else:
                        continue
                    del busy[worker]
                    idle.append(worker)
            return results

    def close(self) -> None:
        """Stop all child processes. Safe to call twice."""
        for i in range(self.num_workers):
            self._kill(i)


# ------------------------------------------------------------------------------ environment
class MathEnvConfig(BaseModel):
    """`env.math.*`."""

    model_config = ConfigDict(extra="forbid")

    num_workers: int = Field(1, ge=1, description="math-verify child processes verifying in parallel.")
    answer_format: Literal["auto", "boxed", "hash", "last_number"] = Field(
        "auto", description="How the final answer is extracted (see extract_answer).")
    verify_timeout_s: float = Field(5.0, gt=0, description="Longest one verification may take; then it scores 0.")


@register_env("math")
class MathEnvironment(Environment):
    """Single-turn math grading against `metadata[i]["ground_truth"]` (or NeMo-Gym's `expected_answer`).

    Args:
        cfg: `MathEnvConfig` (or a dict of its keys): `answer_format` (default `auto`),
            `verify_timeout_s` (default 5.0), `num_workers` verifier processes (default 1).
            None uses the defaults.
    """

    config_class = MathEnvConfig

    def __init__(self, cfg: MathEnvConfig | dict | None = None):
        self.cfg = cfg if isinstance(cfg, MathEnvConfig) else MathEnvConfig.model_validate(cfg or {})
        self.verifier = VerifierPool(self.cfg.num_workers, self.cfg.verify_timeout_s)

    def step(self, message_logs: list[MessageLog], metadata: list[dict]) -> EnvironmentReturn:
        if len(message_logs) != len(metadata):
            raise ValueError(f"got {len(message_logs)} message logs but {len(metadata)} metadata entries")
        ground_truths = []
        for i, meta in enumerate(metadata):
            truth = meta.get("ground_truth") if isinstance(meta, dict) else None
            truth = meta.get("expected_answer") if truth is None and isinstance(meta, dict) else truth
            if truth is None:
                raise ValueError(f"math environment: metadata[{i}] has no 'ground_truth' (got {meta!r})")
            ground_truths.append(str(truth))

        answers = [extract_answer(last_assistant_text(log_), self.cfg.answer_format) for log_ in message_logs]
        rewards = torch.zeros(len(message_logs), dtype=torch.float32)
        to_verify = []
        for i, answer in enumerate(answers):
            if answer is None:
                continue
            plain = plain_numbers_equal(ground_truths[i], answer)
            if plain is None:
                to_verify.append(i)
            else:
                rewards[i] = float(plain)
        if to_verify:
            scores = self.verifier.score([(ground_truths[i], answers[i]) for i in to_verify])
            rewards[to_verify] = torch.tensor(scores, dtype=torch.float32)

        observations = [
            {"role": "environment", "content": "Environment: correct" if r == 1.0 else "Environment: incorrect"}
            for r in rewards.tolist()
        ]
        return EnvironmentReturn(
            observations=observations,
            metadata=list(metadata),
            next_stop_strings=[None] * len(message_logs),
            rewards=rewards,
            terminateds=torch.ones(len(message_logs), dtype=torch.bool),
            answers=answers,
        )

    def shutdown(self) -> None:
        self.verifier.close()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass
