"""One lock for every model construction in this process.

transformers builds a model under process-wide patches (weights created on the meta device, then
loaded and tied): two threads building models at once corrupt each other's (meta tensors left,
tied weights reported missing). The local backend (`cluster.backend: local`) starts its worker
groups and environments concurrently as threads of one process, so posttrain builds every model
(`from_pretrained`, `from_config`) while holding `MODEL_BUILD_LOCK`.
"""

import threading

MODEL_BUILD_LOCK = threading.RLock()
