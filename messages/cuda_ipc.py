"""CUDA IPC for a trainer and an engine on the same GPU: the bucket never leaves the device.

Rules: the trainer exports the CUDA storage of a packed bucket as a handle (plain bytes,
ints and bools: MessagePack carries it; no pickle, unlike `torch.multiprocessing`'s
reductions, whose `_share_cuda_` / `_new_shared_cuda` pair this wraps); the engine opens
it, copies the bytes it needs into its parameters, and drops its view before it
acknowledges, so the trainer may reuse the slot. Only peers on the same host and device
may use it; the orchestrator offers it like the segments' reference transport (same host), never
across hosts.
"""

from __future__ import annotations

from typing import TypedDict, cast

import torch

FIELDS = (
    "device",
    "handle",
    "storage_bytes",
    "storage_offset_bytes",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)


class Handle(TypedDict):
    """An exported CUDA tensor: `_share_cuda_`'s fields (FIELDS, in that order; the
    handles are None for a storage without memory), then the tensor's place in it."""

    device: int
    handle: bytes | None
    storage_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes | None
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool | None
    offset: int
    numel: int


def export(buf: torch.Tensor) -> Handle:
    """A handle to `buf` (a contiguous uint8 CUDA tensor) another process can open."""
    if buf.device.type != "cuda" or buf.dtype != torch.uint8 or not buf.is_contiguous():
        raise ValueError("CUDA IPC exports contiguous uint8 CUDA tensors only")
    parts = buf.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
    ref = dict(zip(FIELDS, parts, strict=True))
    ref["offset"] = buf.storage_offset()
    ref["numel"] = buf.numel()
    return cast(Handle, ref)  # torch's untyped tuple, named by FIELDS


def open_handle(ref: Handle) -> torch.Tensor:
    """The exported tensor, mapped into this process (same device, no copy)."""
    args = (
        ref["device"],
        ref["handle"],
        ref["storage_bytes"],
        ref["storage_offset_bytes"],
        ref["ref_counter_handle"],
        ref["ref_counter_offset"],
        ref["event_handle"],
        ref["event_sync_required"],
    )  # FIELDS, in order
    storage = torch.UntypedStorage._new_shared_cuda(*args)
    t = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", ref["device"]))
    t.set_(storage, ref["offset"], (ref["numel"],), (1,))
    return t
