"""What the on-policy algorithms (GRPO, async GRPO, on-policy distillation) share at run level.

First step of issue 27's "one on-policy runtime": the training loader (`train_loader`, so a
`data.blend` is sampled by its weights in every algorithm) and the shutdown (`shutdown_run`,
which also releases the run-directory lock). The rest of the set-up still lives in each
algorithm's `setup`.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from posttrain.data.dataloader import make_loader

log = logging.getLogger(__name__)


def train_loader(train_samples, num_prompts_per_step: int, *, shuffle: bool, seed: int):
    """The prompt loader of an on-policy run: a blend (or several reasoning-gym tasks) is sampled
    by its components' weights (`make_loader`), a single source in (shuffled) order."""
    return make_loader(train_samples, num_prompts_per_step, shuffle=shuffle, seed=seed)


def shutdown_run(cfg: Any, loop: Any, envs: dict[str, Any], parts: Iterable[Any]) -> None:
    """End a run: shut down the environments and `parts` (generation engines, policies, clusters,
    in that order), close the loop's logger and release the run-directory locks `start_run` took,
    so a later run in the same directories can start. A part that fails to shut down is logged,
    not raised: shutting down must not mask the error that ended the run."""
    from posttrain.environments.registry import EnvRouter
    from posttrain.utils.run_dirs import release_run_dirs

    routers = (EnvRouter(envs),) if envs else ()  # a run may have no environment to stop
    for part in (*routers, *parts):
        try:
            part.shutdown()
        except Exception as e:
            log.warning("shutdown failed: %s", e)
    loop.close()
    release_run_dirs(cfg)
