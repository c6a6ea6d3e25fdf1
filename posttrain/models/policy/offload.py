"""The policy's training state leaves its device while the colocated engine generates (issue 24).

`policy.offload_during_generation` (None: on when the policy shares GPUs with generation): after
the refit and before the rollouts, every policy worker moves its parameters (FSDP2's local shards
included), their gradients, its buffers and its optimizer's state tensors to host memory; before
the next logprobs, training, checkpoint or refit they come back (`Policy` brings them back before
any call that needs them). The tensors move *in place*: the same `nn.Parameter` objects get new
storage (`nn.Module._apply`, which FSDP2 overrides to re-point its sharded parameters), and the
optimizer's state dicts get their values replaced, so the optimizer and FSDP keep their
references. Each state tensor goes back to the device it came from (Adam's `step` counters stay
on the CPU where torch keeps them).

Weights lent in place (the local backend with one policy worker: `WeightExport.live_weights`):
the generation engine's model *is* the policy's parameters, so moving them would move the
engine's weights off the device it generates on. Then only the gradients (stashed on the host and
set to None; autograd needs a gradient on its parameter's device) and the optimizer state move.

On CPU workers offloading has nothing to move: the policy already lives in host memory. An
explicit `policy.offload_during_generation=true` there is a documented no-op (one note at
start-up). Under `policy.fsdp_cpu_offload` FSDP2 already keeps the state on the host: off too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor

HOST = torch.device("cpu")


def offloads_during_generation(cfg: Any, on_gpus: bool) -> bool:
    """Whether `policy.offload_during_generation` (of the `PolicyConfig` `cfg`) moves anything: only
    when generation is colocated with the policy on GPUs (None: then on); never on CPU workers nor
    under `policy.fsdp_cpu_offload` (the state is in host memory already), nor with generation on
    devices of its own (nothing to make room for)."""
    if not on_gpus or cfg.fsdp_cpu_offload or not cfg.generation.colocated.enabled:
        return False
    return cfg.offload_during_generation is not False


def offload_note(cfg: Any, on_gpus: bool) -> Optional[str]:
    """The start-up note for an explicit `offload_during_generation=true` that moves nothing."""
    if not cfg.offload_during_generation or offloads_during_generation(cfg, on_gpus):
        return None
    if not on_gpus:
        why = "the policy's workers run on CPU, where its state already lives in host memory"
    elif cfg.fsdp_cpu_offload:
        why = "policy.fsdp_cpu_offload keeps the training state in host memory already"
    else:
        why = "generation runs on devices of its own (policy.generation.colocated.enabled=false)"
    return f"[posttrain] policy.offload_during_generation=true: nothing to move ({why})"


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of `tensor` (its local shard for a DTensor)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _device_of(tensor: torch.Tensor) -> torch.device:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).device


@dataclass
class Offloaded:
    """What `offload` moved, for `reload` to put back."""

    bytes_moved: int
    parameters_moved: bool
    state_devices: dict[tuple[int, str], torch.device] = field(default_factory=dict)  # (param index, key) -> device
    stashed_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # param index -> gradient (lent weights)


def _state_tensors(optimizer: Optional[torch.optim.Optimizer]):
    """`(index, key, state dict, tensor)` of every tensor in the optimizer's state."""
    if optimizer is None:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, param in enumerate(params):
        state = optimizer.state.get(param, {})
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor):
                yield index, key, state, value


def _move_model(model: torch.nn.Module, device: torch.device, copy: bool) -> int:
    """Parameters, their gradients and buffers to `device`, in place; returns the bytes moved."""
    tensors = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += list(model.buffers())
    moved = sum(nbytes(t) for t in tensors if copy or _device_of(t) != device)
    # Swapping keeps every Parameter object whatever the two devices (assigning `.data` cannot
    # cross to the meta device, and `_apply` would then make new Parameters behind the
    # optimizer's back); FSDP2's `_apply` then re-points its sharded parameters.
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model._apply(lambda t: t.to(device, copy=copy))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    return moved


def offload(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], target: torch.device = HOST, *,
            move_parameters: bool = True, copy: bool = False) -> Offloaded:
    """Move `model`'s training state and `optimizer`'s state tensors to `target`, in place.

    `move_parameters=False` (weights lent to an engine) moves only gradients and optimizer state.
    `copy=True` copies even a tensor already on `target` (tests: a host-to-host round trip).
    """
    target = torch.device(target)
    if move_parameters:
        moved, stashed = _move_model(model, target, copy), {}
    else:
        moved, stashed = 0, {}
        for index, param in enumerate(model.parameters()):
            if param.grad is not None:
                stashed[index] = param.grad.to(target, copy=copy)
                moved += nbytes(param.grad)
                param.grad = None
    done = Offloaded(moved, move_parameters, stashed_grads=stashed)
    for index, key, state, value in _state_tensors(optimizer):
        done.state_devices[(index, key)] = _device_of(value)
        if copy or _device_of(value) != target:
            done.bytes_moved += nbytes(value)
        state[key] = value.to(target, copy=copy)
    return done


def reload(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], offloaded: Offloaded,
           device: torch.device, *, copy: bool = False) -> int:
    """Undo `offload`: parameters, gradients and buffers back to `device`, each optimizer state
    tensor to the device it was on; returns the bytes moved."""
    device = torch.device(device)
    moved = _move_model(model, device, copy) if offloaded.parameters_moved else 0
    params = list(model.parameters())
    for index, grad in offloaded.stashed_grads.items():
        params[index].grad = grad.to(_device_of(params[index]), copy=copy)
        moved += nbytes(grad)
    for index, key, state, value in _state_tensors(optimizer):
        home = offloaded.state_devices.get((index, key), device)
        if copy or _device_of(value) != home:
            moved += nbytes(value)
        state[key] = value.to(home, copy=copy)
    return moved


def empty_device_cache(device: torch.device) -> None:
    """Give the freed blocks back to the device (CUDA; nothing to do on CPU)."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


class OffloadsDuringGeneration:
    """Mixin of `PolicyWorker`: reads `self.model`, `self.optimizer`, `self.device`, `self._reshard`
    and `self._weights_lent` (set by `WeightExport.live_weights`)."""

    _offloaded: Optional[Offloaded] = None
    _weights_lent = False

    def offload_to_host(self) -> int:
        """Move the training state to host memory (see the module); returns the bytes moved (0 if
        it is there already)."""
        if self._offloaded is not None:
            return 0
        self._reshard()  # FSDP's gathered copies (the root unit keeps them) would stay on the device
        self._offloaded = offload(self.model, self.optimizer, HOST, move_parameters=not self._weights_lent)
        empty_device_cache(self.device)
        return self._offloaded.bytes_moved

    def reload_to_device(self) -> int:
        """Bring back what `offload_to_host` moved; returns the bytes moved (0 if nothing was away)."""
        if self._offloaded is None:
            return 0
        moved = reload(self.model, self.optimizer, self._offloaded, self.device)
        self._offloaded = None
        return moved
