"""Code environment: extract the program from a response and run it against test cases in a sandbox.

Reward: the fraction of tests passed (`reward: fraction`) or 1.0 only when all pass (`all_pass`,
the default: partial credit for trivial tests invites reward hacking). A test passes only when its
process exits normally within every limit and its output matches: a program that prints the right
answer and then misbehaves (forks, loops, allocates) still fails that test. Every run happens in a
fresh OS-level sandbox (`posttrain.environments.sandbox`, docs/sandbox.md); expected outputs
never enter it.

Data fields (per row, reaching the environment as metadata):
- `tests`: a list of `{"input": <stdin text>, "output": <expected stdout>}` (stdin/stdout style),
  or, with `fn_name`, `{"input": <args list | kwargs dict | value>, "output": <expected return>}`;
- `fn_name`: the function to call (function-call style), optional;
- NeMo-Gym's `verifier_metadata: {"unit_tests": {"inputs": [...], "outputs": [...], "fn_name"?}}`
  (LiveCodeBench style: a function test's input is one JSON value per line, its output JSON text).
"""

from __future__ import annotations

import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from posttrain.environments.interface import Environment, EnvironmentReturn, MessageLog, last_assistant_text
from posttrain.environments.registry import register_env

log = logging.getLogger(__name__)


class CodeEnvConfig(BaseModel):
    """`env.code.*`: how programs are extracted, run and rewarded."""

    model_config = ConfigDict(extra="forbid")

    sandbox: Literal["auto", "bwrap", "unshare", "rlimits"] = Field(
        "auto", description="Isolation: auto (bwrap, else unshare, else rlimits, with a loud warning) or one mode (fails if unavailable).")
    reward: Literal["all_pass", "fraction"] = Field("all_pass", description="1 only when every test passes, or the fraction passed.")
    code_format: Literal["auto", "fenced", "tags", "raw"] = Field(
        "auto", description="auto: last ```python block, else last ``` block, else <code>...</code>; raw: the whole response.")
    timeout_s: float = Field(5.0, gt=0, description="Wall-clock seconds per test.")
    cpu_s: int = Field(4, ge=1, description="CPU seconds per test (each process is killed at it; all of them together fail the test at it).")
    memory_mb: int = Field(512, ge=32, description=(
        "Memory of the whole sandbox (MiB): where a cgroup can be made, all its processes together and each one's "
        "address space; else each process's address space is memory_mb / max_processes, at least 64 MiB."))
    max_processes: int = Field(32, ge=2, description="Processes and threads of the sandboxed program.")
    max_file_size_mb: float = Field(4, gt=0, description="Largest file the program may write (MiB).")
    disk_mb: int = Field(16, ge=1, description="Size of its private /tmp and working directory (MiB each).")
    max_open_files: int = Field(64, ge=16, description="File descriptors per process.")
    max_output_kb: int = Field(64, ge=1, description="Stdout kept per test; more fails the test (output_limit).")
    num_workers: int = Field(2, ge=1, description="Sandboxes run in parallel.")
    max_tests: Optional[int] = Field(None, ge=1, description="Run at most this many tests per sample (None: all).")

    def limits(self):
        from posttrain.environments.sandbox import Limits

        return Limits(
            wall_s=self.timeout_s, cpu_s=self.cpu_s, memory_bytes=self.memory_mb * 2**20, processes=self.max_processes,
            file_size_bytes=int(self.max_file_size_mb * 2**20), disk_bytes=self.disk_mb * 2**20,
            open_files=self.max_open_files, output_bytes=self.max_output_kb * 2**10,
        )


_FENCED_PY = re.compile(r"```(?:python|py|python3)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_FENCED = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
_TAGS = re.compile(r"<code>(.*?)</code>", re.DOTALL)


def extract_code(text: str, code_format: str = "auto") -> Optional[str]:
    """The program in a response (the last match), or None. See `CodeEnvConfig.code_format`."""
    if code_format == "raw":
        return text if text.strip() else None
    patterns = {"fenced": (_FENCED_PY, _FENCED), "tags": (_TAGS,), "auto": (_FENCED_PY, _FENCED, _TAGS)}[code_format]
    for pattern in patterns:
        matches = pattern.findall(text)
        if matches and matches[-1].strip():
            return matches[-1]
    return None


def normalize_stdout(text: str) -> str:
    """Compare outputs line by line, ignoring trailing spaces and trailing blank lines."""
    return "\n".join(line.rstrip() for line in str(text).strip("\n").splitlines()).rstrip()


def _values_equal(actual: Any, expected: Any) -> bool:
    if isinstance(expected, float) or isinstance(actual, float):
        try:
            return abs(float(actual) - float(expected)) <= 1e-6 * max(1.0, abs(float(expected)))
        except (TypeError, ValueError):
            return False
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        return len(actual) == len(expected) and all(_values_equal(a, e) for a, e in zip(actual, expected))
    if isinstance(expected, dict) and isinstance(actual, dict):
        return actual.keys() == expected.keys() and all(_values_equal(actual[k], expected[k]) for k in expected)
    return actual == expected and isinstance(actual, bool) == isinstance(expected, bool)  # True is not 1


def _json_or_text(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def parse_tests(meta: dict) -> tuple[list[Any], list[Any], Optional[str]]:
    """(inputs, expected outputs, fn_name) of a row, from `tests` or NeMo-Gym's `unit_tests`."""
    unit_tests = (meta.get("verifier_metadata") or {}).get("unit_tests") if isinstance(meta.get("verifier_metadata"), dict) else None
    if unit_tests:
        fn_name = unit_tests.get("fn_name") or None
        inputs, outputs = list(unit_tests.get("inputs", [])), list(unit_tests.get("outputs", []))
        if fn_name:  # LiveCodeBench: one JSON argument per line; the output is JSON text
            inputs = [[_json_or_text(line) for line in x.splitlines()] if isinstance(x, str) else x for x in inputs]
            outputs = [_json_or_text(x) for x in outputs]
        return inputs, outputs, fn_name
    tests = meta.get("tests")
    if isinstance(tests, str):
        tests = json.loads(tests)
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"no 'tests' list (or verifier_metadata.unit_tests) in {sorted(meta)}")
    return [t["input"] for t in tests], [t["output"] for t in tests], meta.get("fn_name") or None


def grade(program: Optional[str], inputs: list, outputs: list, fn_name: Optional[str], cfg: CodeEnvConfig,
          mode: str) -> tuple[int, int, str]:
    """(tests passed, tests run, reason of the first failure or "") for one program."""
    from posttrain.environments.sandbox import run_tests

    if cfg.max_tests is not None:
        inputs, outputs = inputs[: cfg.max_tests], outputs[: cfg.max_tests]
    if program is None:
        return 0, len(inputs), "no_code"
    if fn_name:
        results = run_tests(program, inputs, style="function", fn_name=fn_name, limits=cfg.limits(), mode=mode)
    else:
        results = run_tests(program, [str(x) for x in inputs], limits=cfg.limits(), mode=mode)
    passed, first_failure = 0, ""
    for result, expected in zip(results, outputs):
        if result["status"] != "ok":
            first_failure = first_failure or result["reason"] or result["status"]
            continue
        ok = _values_equal(result.get("value"), expected) if fn_name else \
            normalize_stdout(result.get("stdout", "")) == normalize_stdout(expected)
        passed += ok
        if not ok:
            first_failure = first_failure or "wrong_answer"
    return passed, len(inputs), first_failure


@register_env("code")
class CodeEnvironment(Environment):
    """Single-turn code grading in a sandbox. Config: `CodeEnvConfig` (`env.code.*`)."""

    config_class = CodeEnvConfig

    def __init__(self, cfg: CodeEnvConfig | dict | None = None):
        from posttrain.environments.sandbox import resolve_mode

        self.cfg = cfg if isinstance(cfg, CodeEnvConfig) else CodeEnvConfig.model_validate(cfg or {})
        self.mode = resolve_mode(self.cfg.sandbox)
        self.failure_counts: dict[str, int] = {}
        self._pool = ThreadPoolExecutor(max_workers=self.cfg.num_workers, thread_name_prefix="code-sandbox")

    @classmethod
    def metadata_problem(cls, metadata: dict) -> Optional[str]:
        try:
            inputs, outputs, _ = parse_tests(metadata)
        except (ValueError, KeyError, TypeError) as e:
            return f"code rows need tests: {e}"
        if len(inputs) != len(outputs) or not inputs:
            return f"code rows need as many test inputs as outputs (got {len(inputs)} and {len(outputs)})"
        return None

    def step(self, message_logs: list[MessageLog], metadata: list[dict]) -> EnvironmentReturn:
        if len(message_logs) != len(metadata):
            raise ValueError(f"got {len(message_logs)} message logs but {len(metadata)} metadata entries")
        programs = [extract_code(last_assistant_text(m), self.cfg.code_format) for m in message_logs]
        tests = [parse_tests(meta) for meta in metadata]
        graded = list(self._pool.map(lambda pt: grade(pt[0], *pt[1], self.cfg, self.mode), zip(programs, tests)))
        rewards, observations = [], []
        for passed, total, reason in graded:
            if self.cfg.reward == "fraction":
                rewards.append(passed / total if total else 0.0)
            else:
                rewards.append(1.0 if total and passed == total else 0.0)
            if reason:
                self.failure_counts[reason] = self.failure_counts.get(reason, 0) + 1
            detail = f" (first failure: {reason})" if reason else ""
            observations.append({"role": "environment", "content": f"Environment: {passed}/{total} tests passed{detail}"})
        n = len(message_logs)
        return EnvironmentReturn(
            observations=observations, metadata=list(metadata), next_stop_strings=[None] * n,
            rewards=torch.tensor(rewards, dtype=torch.float32), terminateds=torch.ones(n, dtype=torch.bool),
            answers=[p if p is None else p[:2000] for p in programs],
        )

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
