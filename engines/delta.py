"""The engine's base copy for delta syncs, and the rebuild of a bucket's patches on it.

Rules: the base is the checkpoint-format tensors of the version this engine last
finalized, as received (before any post-load repacking), in host memory, with each
tensor's digest part. A sync stages what it loads (written into the base's own memory
where it can, patched there in place with an undo); its finalize makes that the base;
an abort undoes the patches and drops what was overwritten whole (the model is then
rolled back by a replay that stages again). Patches of a sync apply to what that sync staged before them, else to the base:
a spool replay (a full version, then its deltas in order) rebuilds in one sync. Off
(`--no-delta-base`), nothing is kept and the engine registers without `delta`, except
for a replay whose buckets say `hold` (the daemon's rollback or catch-up to a version
the spool keeps as base + deltas): that sync stages what it loads, its patches rebuild
on it, and all of it is dropped when the sync ends. Memory: `nbytes` (one copy of the
checkpoint, plus the tensors a sync changed until it ends; off, only during a held replay).
Used by the applier thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from messages import delta
from messages.buckets import as_bytes, copy_bytes, flat_bytes, unpack
from messages.checksums import Bytes
from messages.schema import TensorMeta


class BaseStore:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._base: dict[str, tuple[torch.Tensor, bytes | None]] = {}
        self._staged: dict[str, tuple[torch.Tensor, bytes | None]] = {}
        # sparse patches this sync applied to base tensors in place: name -> undos, in order
        self._undo: dict[str, list[delta.Undo]] = {}
        self._lost: set[str] = set()  # base tensors this sync overwrote whole, in place
        # the engine's model holds exactly the base (it finalized the base's version and
        # nothing was loaded since): an unchanged tensor need not be loaded again
        self.clean = False
        self.holding = False  # off, but this sync is a replay whose patches need what it loads

    @property
    def held(self) -> bool:
        """A base of this engine's own is kept (a delta may be rebuilt on it)."""
        return self.enabled and bool(self._base)

    @property
    def keeping(self) -> bool:
        """Whatever this sync loads is staged: a base is kept, or this sync holds one."""
        return self.enabled or self.holding

    def hold(self) -> None:
        """This sync replays a base and then its deltas: stage what it loads even without
        a base of our own (dropped when the sync ends)."""
        self.holding = True

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
        """Keep `t` (copied: the caller's buffer is reused) as this sync's `name`: into
        the tensor that holds `name` already when the shape allows (a fresh model-sized
        allocation per sync costs more in page faults than the copy), which a sync that
        does not finalize then drops from the base (a later patch of it is STALE_BASE)."""
        if not self.keeping:
            return
        held = self._staged.get(name) or self._base.get(name)
        if held is not None and held[0].shape == t.shape and held[0].dtype == t.dtype:
            own = held[0]
            if name in self._base and self._base[name][0] is own:
                self._lost.add(name)
        else:
            own = torch.empty(t.shape, dtype=t.dtype)
        if own.numel():
            copy_bytes(as_bytes(own), as_bytes(t))
        self._staged[name] = (own, part)

    def commit(self) -> None:
        """The sync finalized: what it loaded is the base, and the model holds it (off:
        a held replay's tensors are dropped)."""
        if self.enabled:
            self._base.update(self._staged)
        self._staged, self._undo, self._lost = {}, {}, set()
        self.clean, self.holding = self.enabled, False

    def discard(self) -> None:
        """The sync ended without finalizing here: the base is put back exactly; the
        model may hold part of that sync, so every tensor is loaded next time."""
        for name, undos in self._undo.items():
            t, _ = self._base[name]
            for u in reversed(undos):
                delta.undo(t, u)
        for name in self._lost:  # overwritten in place: its old value is gone
            self._base.pop(name, None)
        if self._staged or self._undo:
            self.clean = False
        self._staged, self._undo, self._lost = {}, {}, set()
        self.holding = False

    def invalidate(self) -> None:
        """This sync loads bytes the store never sees: no base is left to patch."""
        self.discard()
        self._base, self.clean = {}, False

    def rebuild(
        self, metas: Sequence[TensorMeta], buf: Bytes, skip_same: bool = False
    ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, bytes], set[str]]:
        """Every tensor of a verified bucket, patches rebuilt on the base: (name, tensor)
        in order to load, the rebuilt tensors' digest parts, and the names staged here.
        `skip_same`: leave unchanged tensors out of the load (the engine digests its
        whole model, and its model holds the base). Sparse patches apply in place to the
        base (undone if the sync does not finalize). Raises STALE_BASE (no or another
        base) or CHECKSUM_MISMATCH (a wrong rebuild; that tensor is put back first)."""
        flat = flat_bytes(buf)
        out: list[tuple[str, torch.Tensor]] = []
        parts: dict[str, bytes] = {}
        for m in metas:
            raw = flat[m.offset : m.offset + m.nbytes]
            if m.patch is None:
                out.extend(unpack((m,), buf))
                continue
            base, base_part = self._get(m.name)
            parts[m.name] = m.patch.result
            if m.patch.kind == "same":
                delta.check_base(m, base, base_part)
                if not (skip_same and self.clean and m.name not in self._staged):
                    out.append((m.name, base))  # type: ignore[arg-type]  # check_base refused None
                continue
            if m.patch.kind == "sparse" and self.keeping:
                t = delta.check_base(m, base, base_part)
                u = delta.patch_in_place(m, raw, t)
                if delta.part(m.name, t) != m.patch.result:
                    delta.undo(t, u)
                    raise delta.wrong_rebuild(m)
                held = self._base.get(m.name)
                if held is not None and held[0] is t:  # a base tensor, changed in place: undo kept
                    self._undo.setdefault(m.name, []).append(u)
            else:
                t = delta.rebuild(m, raw, base, base_part)
            if self.keeping:
                self._staged[m.name] = (t, m.patch.result)
            out.append((m.name, t))
        return out, parts, set(parts)

    def stage_loaded(
        self, tensors: list[tuple[str, torch.Tensor]], parts: dict[str, bytes] | None, skip: set[str]
    ) -> None:
        """Stage (copy) every loaded tensor not in `skip` (the rebuilt ones are already)."""
        for name, t in tensors:
            if name not in skip:
                self.stage(name, t, None if parts is None else parts.get(name))
