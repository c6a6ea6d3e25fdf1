"""The mean prompt and response lengths the time plan rests on: given (`--prompt-length`,
`--response-length`), read from a previous run's metrics.jsonl (`train/mean_prompt_length`,
`train/mean_gen_tokens_per_sample`, means over its logged steps), or bounded by the config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from posttrain.errors import UserError
from posttrain.plan.timing import Lengths

PROMPT_METRIC = "train/mean_prompt_length"
RESPONSE_METRIC = "train/mean_gen_tokens_per_sample"


def lengths_from_metrics(path: str | Path) -> tuple[Optional[float], Optional[float]]:
    """(mean prompt, mean response) tokens over the steps of a run's metrics.jsonl (a file, or the
    run's `logger.log_dir`); a metric the run did not log is None."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"--metrics {path}: no such file (a run's metrics.jsonl or its logger.log_dir)")
    values: dict[str, list[float]] = {PROMPT_METRIC: [], RESPONSE_METRIC: []}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"--metrics {path}: line {number} is not JSON") from None
        for key, seen in values.items():
            if isinstance(record.get(key), (int, float)):
                seen.append(float(record[key]))
    if not values[RESPONSE_METRIC]:
        raise UserError(f"--metrics {path}: no step logs {RESPONSE_METRIC} (a GRPO or distillation run's metrics)")
    return tuple(sum(v) / len(v) if v else None for v in values.values())  # type: ignore[return-value]


def plan_lengths(cfg: Any, prompt: Optional[float] = None, response: Optional[float] = None,
                 metrics: Optional[str] = None, longest_prompt: Optional[int] = None) -> Lengths:
    """The lengths to plan for: each given one, else the run's `metrics`, else the bounds: the
    longest prompt (or half of `policy.max_total_sequence_length`) and `max_new_tokens`."""
    for name, value in (("--prompt-length", prompt), ("--response-length", response)):
        if value is not None and value <= 0:
            raise UserError(f"{name}={value:g}: give a positive number of tokens")
    sources = []
    if metrics is not None:
        from_prompt, from_response = lengths_from_metrics(metrics)
        if prompt is None and from_prompt is not None:
            prompt, _ = from_prompt, sources.append("prompt from metrics")
        if response is None:
            response, _ = from_response, sources.append("response from metrics")
    gen = cfg.policy.generation
    if response is None:
        response = gen.max_new_tokens
        sources.append("response = max_new_tokens (an upper bound: pass --response-length or --metrics)")
    if prompt is None:
        room = cfg.policy.max_total_sequence_length - gen.max_new_tokens
        prompt = longest_prompt or max(1, room)
        sources.append("prompt = the longest prompt" if longest_prompt else
                       "prompt = max_total_sequence_length - max_new_tokens" if room > 0 else
                       "prompt unknown (the data could not be read here): 1 token, pass --prompt-length")
    if prompt + response > cfg.policy.max_total_sequence_length:
        response = max(1.0, cfg.policy.max_total_sequence_length - prompt)
    return Lengths(float(prompt), float(response), "; ".join(sources) or "given")
