"""posttrain: scalable RL post-training for language models.

Kept import-light on purpose: `posttrain --help` and config errors must answer in about a
second, so torch, transformers and ray are imported only inside the modules that need them.
"""

__version__ = "0.1.0"
