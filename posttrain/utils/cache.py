"""Where posttrain keeps what it builds once and reuses: converted models, SFT warm starts,
isolated Python environments."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of posttrain's cache: `$POSTTRAIN_CACHE`, default `~/.cache/posttrain`."""
    return Path(os.environ.get("POSTTRAIN_CACHE") or Path.home() / ".cache" / "posttrain").expanduser()
