"""`posttrain plan` against what a run takes (issue 24, item 6): the plan's CPU peak of the tiny
default job is within 25% of the peak resident set the job measures of itself
(`memory/controller_peak_rss_gib`: the default job runs policy and engine in its own process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config.loader import load_config
from posttrain.plan import GiB, check_memory

# The timeout is a hang guard, not a speed test.
pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]


def test_plan_of_the_default_job_is_within_25_percent_of_its_peak_rss(tmp_path):
    """Two steps of the default job without its SFT warm start (whose own peak would count too), so
    the untrained policy writes all 16 new tokens: rows as long as the plan assumes."""
    overrides = ["sft_warmup=null", "grpo.max_num_steps=2", "grpo.val_at_start=false", "grpo.val_at_end=false",
                 "logger.progress_bar=false", f"logger.log_dir={tmp_path / 'logs'}", "checkpointing.enabled=false"]
    plan, problem = check_memory(load_config("grpo", overrides=overrides))
    assert problem is None and not plan.on_gpu and plan.process_counts == [1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "posttrain", "grpo", *overrides], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    measured = max(step.get("memory/controller_peak_rss_gib", 0.0) for step in steps) * GiB
    planned = plan.node_peak()
    print(f"plan {planned / GiB:.3f} GiB ({plan.devices[0].peak()[0]}, rows of {plan.row_tokens} tokens), "
          f"measured peak RSS {measured / GiB:.3f} GiB: {planned / measured - 1:+.0%}")
    assert measured > 0
    assert abs(planned / measured - 1) <= 0.25
