"""Whole jobs, run as `posttrain <command>` is (in this process, local backend): every start-up
phase that the clock times was said when it began (issue 29: no long silent start-up).

The threshold is 0, so every phase says itself at once and the lines do not depend on how fast
this machine is; with the default (a few seconds) only the slow ones would.
"""

from __future__ import annotations

import pytest

from posttrain import cli
from posttrain.utils import startup
from posttrain.utils.progress import Announcer
from posttrain.utils.startup import StartupClock

pytestmark = pytest.mark.functional

QUIET = ["logger.progress_bar=false", "logger.report=false", "logger.tensorboard_enabled=false",
         "checkpointing.enabled=false", "cluster.backend=local"]

JOBS = {
    "sft": (["sft.max_num_steps=1", "sft.val_at_end=false"],
            ["config", "preflight", "imports", "backend", "data", "workers"],
            ["loading the tokenizer tiny", "reading the train data", "loading the policy model tiny",
             "running SFT step 1"]),
    "dpo": (["dpo.max_num_steps=1", "dpo.val_at_start=true", "dpo.val_at_end=false", "dpo.max_val_samples=4",
             "data.num_train=64"],
            ["config", "preflight", "imports", "backend", "data", "workers", "other", "validation"],
            ["loading the policy model tiny and its reference copy", "validating before the first step"]),
    "grpo": (["sft_warmup=null", "grpo.max_num_steps=1", "grpo.val_at_start=false", "grpo.val_at_end=false",
              "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "policy.generation.max_new_tokens=4",
              "policy.train_global_batch_size=4", "data.num_train=16", "data.num_validation=4"],
            ["config", "preflight", "imports", "backend", "data", "workers", "environments"],
            ["loading the policy model tiny and the native generation engine", "starting the environments (math)",
             "preparing the weight transfer to generation", "running GRPO step 1"]),
}


@pytest.mark.parametrize("command", sorted(JOBS))
def test_every_start_up_phase_was_said_when_it_began(command, tmp_path, monkeypatch):
    overrides, phases, said = JOBS[command]
    # Right after `./run.sh`'s install (a fresh clone's first `./run.sh pytest`) the suite inherits
    # its install time, which the clock would show as a first phase "install".
    monkeypatch.delenv(startup.INSTALL_DONE_ENV, raising=False)
    lines: list[str] = []
    clock = StartupClock(announcer=Announcer(write=lines.append, after=0.0, every=3600.0))
    monkeypatch.setattr(startup, "CLOCK", clock)
    argv = [command, *QUIET, *overrides, f"logger.log_dir={tmp_path}/logs"]
    assert cli.main(argv) == 0, lines
    assert [name for name, _ in clock.marks] == phases
    assert clock.unannounced == [], lines  # a phase nobody said had begun: silent, however long
    assert lines[:3] == ["[posttrain] reading the config...",
                         "[posttrain] checking the model, data and environments (preflight)...",
                         f"[posttrain] importing the {command} job (torch, transformers)..."]
    for text in said:
        assert f"[posttrain] {text}..." in lines, lines
    assert clock.announcer.current is None  # the job ended every phase it began
