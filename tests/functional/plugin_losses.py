"""A loss the functional tests plug in the way users do (`loss_fn.name=<this file>:<Class>`),
misbehaving on purpose inside the policy workers' training step."""

from __future__ import annotations

import os
import threading

import torch.distributed as dist

from posttrain.algorithms.loss import ClippedPGLoss


class StallOnceLoss(ClippedPGLoss):
    """GRPO's loss, except that rank 1 of the policy's workers, once the file `stall_flag` exists,
    deletes it and never returns from its loss: a Python-level hang inside a training step, the
    process alive and beating, while rank 0 waits for it in the step's collective (FSDP's gradient
    reduce-scatter). A replay of the step trains normally (the flag is gone)."""

    def __init__(self, stall_flag: str = "", **overrides):
        super().__init__(**overrides)
        self.stall_flag = stall_flag

    def __call__(self, logprobs, batch, global_valid_seqs, global_valid_toks):
        if self.stall_flag and dist.is_initialized() and dist.get_rank() == 1 and os.path.exists(self.stall_flag):
            os.remove(self.stall_flag)
            threading.Event().wait()  # the rank's thread blocks here until the process is killed
        return super().__call__(logprobs, batch, global_valid_seqs, global_valid_toks)
