"""Saving a whole model from any process."""

from __future__ import annotations

import os
from typing import Any


def save_pretrained_here(model: Any, out_dir: str | os.PathLike, **kwargs: Any) -> None:
    """`model.save_pretrained(out_dir, **kwargs)`, writing every file in this process whatever its
    `torch.distributed` rank.

    transformers saves only on rank 0 when a process group is initialised (it assumes every rank
    holds the same sharded model and one copy is enough): on another rank it writes no config and
    no weights and says nothing. A cache build or a conversion in such a process (two context-
    parallel ranks or Ray workers building the tiny model at once) holds a whole model of its own
    and must write it, so that decision is overridden on this instance only.
    """
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        model.save_pretrained(out_dir, **kwargs)
    finally:
        del model.should_save_on_this_rank
