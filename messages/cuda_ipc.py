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

from typing import Any

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


def export(buf: torch.Tensor) -> dict[str, object]:
    """A handle to `buf` (a contiguous uint8 CUDA tensor) another process can open."""
    if buf.device.type != "cuda" or buf.dtype != torch.uint8 or not buf.is_contiguous():
        raise ValueError("CUDA IPC exports contiguous uint8 CUDA tensors only")
    parts = buf.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
    ref = dict(zip(FIELDS, parts, strict=True))
    ref["offset"] = buf.storage_offset()
    ref["numel"] = buf.numel()
    return ref


def open_handle(ref: dict[str, Any]) -> torch.Tensor:
    """The exported tensor, mapped into this process (same device, no copy)."""
    args = tuple(ref[f] for f in FIELDS)
    storage = torch.UntypedStorage._new_shared_cuda(*args)
    t = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", ref["device"]))
    t.set_(storage, ref["offset"], (ref["numel"],), (1,))
    return t
