"""Refit: copy the policy's weights into the generation workers, one packed bucket at a time.

Flow (after NeMo-RL's packed refit, `reference/nemo-rl.md` section 6):

1. Once at set-up, the controller builds `RefitMetadata` from the policy's ordered list of
   `(name, shape, dtype)` with `build_refit_metadata`, cut into buckets of
   `policy.refit_buffer_size_gb` (`default_bucket_bytes` when unset), and hands it to the
   generation workers (`prepare_refit_info`), which check that every name is one of their
   parameters. From then on no per-tensor metadata travels.
2. Each refit streams the buckets: for each, the policy ranks gather its tensors one at a time
   from their shards and the packing rank copies each into one `uint8` buffer at a 512-byte
   aligned offset, cast to the engine's dtype (`pack_bucket`); the bucket is sent (a broadcast
   group, CUDA IPC, or Ray's object store: `GenerationInterface.refit_from_policy`), every
   generation worker copies it into its parameters (`load_bucket`: views
   `buf[offset:offset+nbytes].view(dtype).view(shape)`), and it is freed before the next. A
   sender holds one bucket plus one gathered tensor beyond the model, a receiver one bucket.

Refit is lazy: generation tracks the `weights_version` it holds, the controller refits only when
the policy's version differs.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch

DEFAULT_ALIGNMENT = 512  # bytes; also a multiple of every dtype's element size


@dataclass(frozen=True)
class ParamSlot:
    """Where one tensor lives in the packed buffers."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket: int  # index of the buffer
    offset: int  # byte offset in that buffer, a multiple of the alignment
    nbytes: int


@dataclass(frozen=True)
class RefitMetadata:
    """Layout of all tensors in the packed buffers; built once, shared by sender and receivers."""

    slots: tuple[ParamSlot, ...]
    bucket_sizes: tuple[int, ...]  # bytes per buffer

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    @property
    def max_bucket_bytes(self) -> int:
        return max(self.bucket_sizes, default=0)

    @property
    def names(self) -> list[str]:
        return [slot.name for slot in self.slots]


# Default refit bucket: this share of the free memory where the buckets are packed (host RAM on
# CPU, the GPU's free memory on GPU), within the bounds below. A refit holds at most one bucket
# plus one gathered tensor beside the model on the sender, one bucket on each receiver.
REFIT_FREE_MEMORY_FRACTION = 0.2
MIN_BUCKET_BYTES = 1 << 20
MAX_BUCKET_BYTES = 2 << 30


def default_bucket_bytes(device: torch.device) -> int:
    """The refit bucket size `policy.refit_buffer_size_gb` stands for when unset, on `device`:
    `REFIT_FREE_MEMORY_FRACTION` of its free memory (`torch.cuda.mem_get_info` on a GPU, available
    host RAM on CPU), between 1 MiB and 2 GiB."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    return int(min(max(free * REFIT_FREE_MEMORY_FRACTION, MIN_BUCKET_BYTES), MAX_BUCKET_BYTES))


def _aligned(nbytes: int, alignment: int) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


def build_refit_metadata(
    params: Iterable[tuple[str, Sequence[int], torch.dtype]],
    bucket_bytes: int = 512 * 2**20,
    alignment: int = DEFAULT_ALIGNMENT,
    dtypes: Optional[Mapping[str, torch.dtype] | torch.dtype] = None,
) -> RefitMetadata:
    """Lay out tensors in buffers of about `bucket_bytes`, in the given order.

    Args:
        params: `(name, shape, dtype)` per tensor, in the order the sender will pack them.
        dtypes: the receivers' dtype per name, or one dtype for every tensor (an engine such as
            vLLM holds all its weights in one dtype), which the buffers then carry (default None:
            the sender's). float32 masters sent to a bfloat16 engine are cast while packing, so the
            transfer moves half the bytes and the receiver copies without casting.
        bucket_bytes: target buffer size (default 512 MiB; jobs pass `policy.refit_buffer_size_gb`,
            see `Policy.refit_bucket_bytes`). A tensor larger than this gets a buffer of its own;
            buffers hold whole tensors.
        alignment: every tensor starts at a multiple of this many bytes (default 512, as NeMo-RL's
            IPC refit) so dtype views of the buffer are always legal and aligned.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    slots: list[ParamSlot] = []
    bucket_sizes: list[int] = []
    used = 0
    seen: set[str] = set()
    for name, shape, dtype in params:
        if name in seen:
            raise ValueError(f"refit metadata: parameter {name!r} is listed twice")
        seen.add(name)
        dtype = _dtype_for(dtypes, name, dtype)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"refit metadata: dtype of {name!r} must be a torch.dtype, got {dtype!r}")
        shape = tuple(int(d) for d in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        padded = _aligned(nbytes, alignment)
        if not bucket_sizes or (used > 0 and used + padded > bucket_bytes):
            bucket_sizes.append(0)
            used = 0
        slots.append(ParamSlot(name, shape, dtype, len(bucket_sizes) - 1, used, nbytes))
        used += padded
        bucket_sizes[-1] = used
    return RefitMetadata(tuple(slots), tuple(bucket_sizes))


def _dtype_for(dtypes: Optional[Mapping[str, torch.dtype] | torch.dtype], name: str, default: torch.dtype) -> torch.dtype:
    """The receiver's dtype of `name`: `dtypes` per name, one dtype for all, or `default`."""
    if isinstance(dtypes, torch.dtype):
        return dtypes
    return dtypes.get(name, default) if dtypes else default


def refit_metadata_from_state_dict(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int = 512 * 2**20) -> RefitMetadata:
    """`build_refit_metadata` over a state dict's `(name, shape, dtype)` in its order."""
    return build_refit_metadata(((n, t.shape, t.dtype) for n, t in state_dict.items()), bucket_bytes)


def _byte_view(array: np.ndarray) -> torch.Tensor:
    """A uint8 torch tensor sharing memory with `array` (possibly read-only, as Ray returns it)."""
    with warnings.catch_warnings():
        # Arrays from Ray's object store are read-only; we only ever read from such views.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def bucket_slots(metadata: RefitMetadata, bucket: int) -> list[ParamSlot]:
    """The slots of buffer `bucket`, in packing order."""
    if not 0 <= bucket < len(metadata.bucket_sizes):
        raise IndexError(f"refit: bucket {bucket} does not exist; the metadata has {len(metadata.bucket_sizes)}")
    return [slot for slot in metadata.slots if slot.bucket == bucket]


def pack_bucket(
    tensor_of: Callable[[str], torch.Tensor], metadata: RefitMetadata, bucket: int, device: torch.device | str = "cpu",
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One uint8 buffer on `device` holding the tensors of `bucket`, cast to the metadata dtypes.

    `tensor_of(name)` is asked for one tensor at a time, just before it is copied, and the
    reference is dropped right after: with a `tensor_of` that gathers a sharded parameter
    (`DTensor.full_tensor()`), the memory a bucket costs is the buffer plus one full tensor.
    `out` (default None: a new buffer): a uint8 tensor of at least `max_bucket_bytes` to pack
    into (its leading bytes are returned), so a refit that sends bucket after bucket reuses one
    buffer. Raises ValueError on a shape mismatch.
    """
    size = metadata.bucket_sizes[bucket]
    if out is None:
        buffer = torch.zeros(size, dtype=torch.uint8, device=device)
    else:
        buffer = out[:size]
        buffer.zero_()
    for slot in bucket_slots(metadata, bucket):
        tensor = tensor_of(slot.name)
        if tuple(tensor.shape) != slot.shape:
            raise ValueError(f"refit pack: {slot.name!r} has shape {tuple(tensor.shape)}, metadata says {slot.shape}")
        buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape).copy_(tensor.detach())
        del tensor
    return buffer


def unpack_bucket(buffer: np.ndarray | torch.Tensor, metadata: RefitMetadata, bucket: int) -> dict[str, torch.Tensor]:
    """Views (no copies) of the tensors of `bucket` in its buffer (a numpy array or a torch
    uint8 tensor on any device)."""
    size = metadata.bucket_sizes[bucket]
    if isinstance(buffer, np.ndarray):
        if buffer.dtype != np.uint8 or buffer.ndim != 1 or buffer.shape[0] != size:
            raise ValueError(f"refit: buffer {bucket} is {buffer.dtype}[{buffer.shape}], expected uint8[{size}]")
        buffer = _byte_view(buffer)
    elif buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.shape[0] != size:
        raise ValueError(f"refit: buffer {bucket} is {buffer.dtype}[{tuple(buffer.shape)}], expected uint8[{size}]")
    return {
        slot.name: buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
        for slot in bucket_slots(metadata, bucket)
    }


def pack(state_dict: Mapping[str, torch.Tensor], metadata: RefitMetadata) -> list[np.ndarray]:
    """Every bucket of `metadata` packed from a full `state_dict` (tests and benchmarks; refits
    stream one bucket at a time with `pack_bucket`). Raises KeyError naming missing tensors."""
    missing = [slot.name for slot in metadata.slots if slot.name not in state_dict]
    if missing:
        raise KeyError(f"refit pack: state dict lacks {len(missing)} tensors of the metadata, e.g. {missing[:5]}")
    return [pack_bucket(state_dict.__getitem__, metadata, bucket).numpy() for bucket in range(len(metadata.bucket_sizes))]


def unpack(buffers: Sequence[np.ndarray], metadata: RefitMetadata) -> dict[str, torch.Tensor]:
    """Views (no copies) of every tensor in the packed buffers, on CPU."""
    if len(buffers) != len(metadata.bucket_sizes):
        raise ValueError(f"refit: got {len(buffers)} buffers, metadata describes {len(metadata.bucket_sizes)}")
    views: dict[str, torch.Tensor] = {}
    for bucket, buffer in enumerate(buffers):
        views.update(unpack_bucket(buffer, metadata, bucket))
    return {slot.name: views[slot.name] for slot in metadata.slots}


def check_metadata_matches(model: torch.nn.Module, metadata: RefitMetadata) -> None:
    """Raise ValueError if the metadata names a tensor the model lacks, or misses one it has.

    Shapes must match; dtypes may differ (the receiver casts on copy).
    """
    own = model.state_dict()
    unknown = [n for n in metadata.names if n not in own]
    missing = [n for n in own if n not in set(metadata.names)]
    if unknown or missing:
        raise ValueError(
            f"refit metadata does not match the generation model: unknown to the model {unknown[:5]}, "
            f"not sent {missing[:5]}"
        )
    for slot in metadata.slots:
        if tuple(own[slot.name].shape) != slot.shape:
            raise ValueError(f"refit: {slot.name!r} is {tuple(own[slot.name].shape)} in the model, {slot.shape} in the metadata")


@torch.no_grad()
def load_bucket(model: torch.nn.Module, buffer: np.ndarray | torch.Tensor, metadata: RefitMetadata, bucket: int) -> None:
    """Copy the tensors of one packed bucket into the model's parameters and buffers in place."""
    own = model.state_dict()  # tensors share storage with the model's parameters
    for name, view in unpack_bucket(buffer, metadata, bucket).items():
        if name not in own:
            raise KeyError(f"refit: model has no tensor named {name!r}")
        own[name].copy_(view, non_blocking=True)
    if own and next(iter(own.values())).is_cuda:
        torch.cuda.synchronize()  # the buffer may be freed as soon as this returns


def load_packed(model: torch.nn.Module, buffers: Sequence[np.ndarray], metadata: RefitMetadata) -> None:
    """`load_bucket` for every bucket of `metadata`."""
    if len(buffers) != len(metadata.bucket_sizes):
        raise ValueError(f"refit: got {len(buffers)} buffers, metadata describes {len(metadata.bucket_sizes)}")
    for bucket, buffer in enumerate(buffers):
        load_bucket(model, buffer, metadata, bucket)


def state_dict_checksum(
    state_dict: Mapping[str, torch.Tensor], dtypes: Optional[Mapping[str, torch.dtype] | torch.dtype] = None
) -> str:
    """SHA-256 over names, dtypes, shapes and raw bytes, in sorted name order (bit-exact check).

    `dtypes` (name -> dtype, or one dtype for all) casts tensors first, so float32 masters can be
    compared with the bfloat16 copy a generation engine holds.
    """
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu()
        if dtypes:
            tensor = tensor.to(_dtype_for(dtypes, name, tensor.dtype))
        tensor = tensor.contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def refit_policy_generation(policy, generation, metadata: RefitMetadata, *, version: int, verify: bool = False) -> None:
    """Copy the policy's current weights into every generation worker.

    By default the policy's rank 0 packs its full weights into `metadata`'s buffers and keeps them
    in the object store; the generation workers read them from there (zero-copy on one node) and
    copy them into their parameters. No per-tensor messages; the controller never touches the
    bytes. A backend may take a faster path on GPU (`GenerationInterface.refit_from_policy`).

    Args:
        verify: afterwards, check that the engine holds the policy's weights
            (`GenerationInterface.verify_refit`: checksums for the native engine, a logprob
            probe for vLLM; config `policy.generation.verify_refit`).
    """
    reload = getattr(policy, "reload_to_device", None)
    if reload is not None:  # a policy offloaded for generation: its weights leave from the device
        reload()
    generation.refit_from_policy(policy, metadata, version)
    if verify:
        generation.verify_refit(policy, version)
