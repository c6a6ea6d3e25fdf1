"""posttrain: scalable RL post-training for language models.

Kept import-light on purpose: `posttrain --help` and config errors must answer in about a
second, so torch, transformers and ray are imported only inside the modules that need them.
"""

__version__ = "0.1.0"

__all__ = ["GRPO", "__version__"]


def __getattr__(name: str):
    """`from posttrain import GRPO` (the Python API, `posttrain.api`), imported on first use."""
    if name in ("GRPO", "TrainResult"):
        from posttrain import api

        return getattr(api, name)
    raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
