"""The `Engine` protocol (docs/ARCHITECTURE.md, engines): what the worker loop drives.

Rules: `load` validates every tensor of a bucket (name, shape, dtype) before it touches a
parameter, then copies in place (parameter storage and `data_ptr` stay the same), and
raises a `DataError` (UNKNOWN_TENSOR / SHAPE_MISMATCH) with nothing applied. `finalize`
is the backend's post-load step and is NOT idempotent, exactly like vLLM's
`process_weights_after_loading`; the worker guarantees it runs once per sync. `begin`
prepares a new sync (undoes what finalize did to the checkpoint-format weights).
An engine may also offer `load_bucket(metas, buf, parts)`, taking the received bucket
as is (the vLLM engine hands it to its workers by reference or through shared memory,
without unpacking; `parts` are the tensors' digest parts when it sets `digest_parts`),
`load_shm(metas, ref, checksum, parts)` (its workers read the trainer's slot), and
`load_collective(metas, group, size, checksum, bind, seq, next_bucket)`, receiving a
collective bucket itself (the vLLM engine's workers each join the group and receive
inside vLLM, posting the next bucket's receive before loading this one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from messages.dtypes import dtype_name
from messages.errors import ErrorCode, make_error
from messages.schema import ParamSpec, Probe


@dataclass(frozen=True, slots=True)
class EngineInfo:
    backend: str
    model: str
    spec: tuple[ParamSpec, ...]
    transports: tuple[str, ...] = ("inline", "shm", "collective")
    cast_ok: bool = False
    collective_ranks: int = 1  # group members it brings (a vLLM engine: one per TP/PP worker)
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    finalize_count: int

    def describe(self) -> EngineInfo: ...

    def begin(self, sync_id: str, version: int) -> None: ...

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None: ...

    def finalize(self, sync_id: str) -> str:
        """Run the post-load step once; return the digest of the weights now held."""
        ...

    def digest(self) -> str: ...

    def probe(self, probes: Sequence[Probe]) -> tuple[tuple[int, ...], ...]: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...


def validate_bucket(spec: dict[str, ParamSpec], tensors: Sequence[tuple[str, torch.Tensor]],
                    *, cast_ok: bool = False) -> None:
    """Raise UNKNOWN_TENSOR / SHAPE_MISMATCH for the first tensor `spec` would refuse."""
    for name, t in tensors:
        want = spec.get(name)
        if want is None:
            raise make_error(ErrorCode.UNKNOWN_TENSOR, f"no tensor named {name!r} in this model",
                             details={"tensor": name})
        got_dtype = dtype_name(t.dtype)
        if tuple(t.shape) != tuple(want.shape) or (not cast_ok and got_dtype != want.dtype):
            raise make_error(ErrorCode.SHAPE_MISMATCH,
                             f"{name}: model has {want.dtype}{list(want.shape)}, "
                             f"bucket has {got_dtype}{list(t.shape)}",
                             details={"tensor": name})
