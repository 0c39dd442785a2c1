"""The engine's base copy for delta syncs, and the rebuild of a bucket's patches on it.

Rules: the base is the checkpoint-format tensors of the version this engine last
finalized, as received (before any post-load repacking), in host memory, with each
tensor's digest part. A sync stages what it loads; its finalize makes the staged tensors
the base; an abort drops them (the model is then rolled back by a replay that stages
again). Patches of a sync apply to what that sync staged before them, else to the base:
a spool replay (a full version, then its deltas in order) rebuilds in one sync. Off
(`--no-delta-base`), nothing is kept and the engine registers without `delta`. Memory:
`nbytes` (one copy of the checkpoint, plus the tensors a sync changed until it ends).
Used by the applier thread only.
"""

from __future__ import annotations

from typing import Any

import torch

from messages import delta
from messages.buckets import ALIGN, as_bytes, copy_bytes, flat_bytes
from messages.dtypes import DTYPES, dtype_name
from messages.schema import TensorMeta


class BaseStore:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._base: dict[str, tuple[torch.Tensor, bytes | None]] = {}
        self._staged: dict[str, tuple[torch.Tensor, bytes | None]] = {}

    @property
    def nbytes(self) -> int:
        tensors = {id(t): t for t, _ in [*self._base.values(), *self._staged.values()]}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _get(self, name: str) -> tuple[torch.Tensor | None, bytes | None]:
        """This sync's `name` if it staged one, else the base's (its part hashed on first use)."""
        for d in (self._staged, self._base):
            hit = d.get(name)
            if hit is not None:
                t, part = hit
                if part is None:
                    part = delta.part(name, t)
                    d[name] = (t, part)
                return t, part
        return None, None

    def stage(self, name: str, t: torch.Tensor, part: bytes | None = None) -> None:
        """Keep `t` (copied: the caller's buffer is reused) as this sync's `name`."""
        if not self.enabled:
            return
        own = torch.empty(t.shape, dtype=t.dtype)
        if own.numel():
            copy_bytes(as_bytes(own), as_bytes(t))
        self._staged[name] = (own, part)

    def commit(self) -> None:
        self._base.update(self._staged)
        self._staged = {}

    def discard(self) -> None:
        self._staged = {}

    def invalidate(self) -> None:
        """This sync loads bytes the store never sees: no base is left to patch."""
        self._base, self._staged = {}, {}

    def rebuild(
        self, metas: Any, buf: Any
    ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, bytes], set[str]]:
        """Every tensor of a verified bucket, patches rebuilt on the base: (name, tensor)
        in order, the rebuilt tensors' digest parts, and the names staged here (rebuilt
        tensors are staged as they are, unchanged ones not at all). Raises STALE_BASE (no
        or another base) or CHECKSUM_MISMATCH (a wrong rebuild) before anything is loaded."""
        flat = flat_bytes(buf)
        out: list[tuple[str, torch.Tensor]] = []
        parts: dict[str, bytes] = {}
        staged: list[tuple[str, torch.Tensor, bytes]] = []
        for m in metas:
            raw = flat[m.offset : m.offset + m.nbytes]
            if m.patch is None:
                dtype = DTYPES[m.dtype]
                out.append((m.name, (raw.view(dtype) if dtype != torch.uint8 else raw).reshape(m.shape)))
                continue
            base, base_part = self._get(m.name)
            t = delta.rebuild(m, raw, base, base_part)
            out.append((m.name, t))
            parts[m.name] = m.patch.result
            if m.patch.kind != "same":
                staged.append((m.name, t, m.patch.result))
        if self.enabled:
            for name, t, part in staged:
                self._staged[name] = (t, part)  # a new tensor already: kept, not copied
        return out, parts, {name for name, _, _ in staged} | set(parts)

    def stage_loaded(
        self, tensors: list[tuple[str, torch.Tensor]], parts: dict[str, bytes] | None, skip: set[str]
    ) -> None:
        """Stage (copy) every loaded tensor not in `skip` (the rebuilt ones are already)."""
        for name, t in tensors:
            if name not in skip:
                self.stage(name, t, None if parts is None else parts.get(name))


def pack(tensors: list[tuple[str, torch.Tensor]]) -> tuple[tuple[TensorMeta, ...], torch.Tensor]:
    """Dense bucket bytes and metas of `tensors` (for engines that load whole buckets)."""
    metas: list[TensorMeta] = []
    offset = 0
    flats = []
    for name, t in tensors:
        raw = as_bytes(t)
        metas.append(TensorMeta(name, dtype_name(t.dtype), tuple(t.shape), offset, int(raw.numel())))
        flats.append(raw)
        offset = (offset + int(raw.numel()) + ALIGN - 1) // ALIGN * ALIGN
    data = torch.zeros(offset, dtype=torch.uint8)
    for m, raw in zip(metas, flats, strict=True):
        copy_bytes(data[m.offset : m.offset + m.nbytes], raw)
    return tuple(metas), data
