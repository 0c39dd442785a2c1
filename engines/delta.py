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
An engine whose ranks take slices keeps each box it loaded under (name, box), each
rank's own (a patch of a box rebuilds that box); a whole tensor is (name, None).
Used by the applier thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from messages import delta
from messages.buckets import as_bytes, copy_bytes, flat_bytes, unpack
from messages.checksums import Bytes
from messages.cuts import box_view, part_digest
from messages.schema import TensorMeta
from messages.slices import WHOLE, Box, Part

Key = tuple[str, Box | None]  # a tensor's name, and the box of it held (None: the whole)
Loaded = tuple[str, Part, torch.Tensor]  # a tensor to load: its name, part (WHOLE or a box), contents


class BaseStore:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._base: dict[Key, tuple[torch.Tensor, bytes | None]] = {}
        self._staged: dict[Key, tuple[torch.Tensor, bytes | None]] = {}
        # sparse patches this sync applied to base tensors in place: key -> undos, in order
        self._undo: dict[Key, list[delta.Undo]] = {}
        self._lost: set[Key] = set()  # base tensors this sync overwrote whole, in place
        # base entries a finalize drops: the whole of a tensor this sync staged boxes of, or
        # the boxes of one it staged whole (another layout's push: no longer what it holds)
        self._superseded: set[Key] = set()
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

    def _get(
        self, name: str, box: Box | None = None, shape: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor | None, bytes | None]:
        """This sync's `name` (its `box` of a tensor of `shape`) if it staged one, else the
        base's (its part hashed on first use)."""
        key = (name, box)
        for d in (self._staged, self._base):
            hit = d.get(key)
            if hit is None and box is not None and (name, None) in d:
                # the whole is held (a push that was not cut): its box is this rank's base
                hit = (box_view(d[(name, None)][0], box).clone(memory_format=torch.contiguous_format), None)
                d[key] = hit
            if hit is not None:
                t, part = hit
                if part is None:
                    part = delta.part(name, t) if box is None else part_digest(name, shape, box, t)
                    d[key] = (t, part)
                return t, part
        return None, None

    def stage(self, key: Key, t: torch.Tensor, part: bytes | None = None) -> None:
        """Keep `t` (copied: the caller's buffer is reused) as this sync's `key`: into
        the tensor that holds `key` already when the shape allows (a fresh model-sized
        allocation per sync costs more in page faults than the copy), which a sync that
        does not finalize then drops from the base (a later patch of it is STALE_BASE)."""
        if not self.keeping:
            return
        held = self._staged.get(key) or self._base.get(key)
        if held is not None and held[0].shape == t.shape and held[0].dtype == t.dtype:
            own = held[0]
            if key in self._base and self._base[key][0] is own:
                self._lost.add(key)
        else:
            own = torch.empty(t.shape, dtype=t.dtype)
        if own.numel():
            copy_bytes(as_bytes(own), as_bytes(t))
        self._keep(key, own, part)

    def _keep(self, key: Key, t: torch.Tensor, part: bytes | None) -> None:
        """`t` is this sync's `key`: the whole of its tensor replaces the boxes held of it at
        finalize, and a box the whole (`_superseded`)."""
        self._staged[key] = (t, part)
        name, box = key
        self._superseded |= {
            k for k in self._base if k[0] == name and k != key and (box is None or k[1] is None)
        }

    def commit(self) -> None:
        """The sync finalized: what it loaded is the base, and the model holds it (off:
        a held replay's tensors are dropped)."""
        if self.enabled:
            for k in self._superseded - self._staged.keys():
                self._base.pop(k, None)
            self._base.update(self._staged)
        self._staged, self._undo, self._lost, self._superseded = {}, {}, set(), set()
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
        self._staged, self._undo, self._lost, self._superseded = {}, {}, set(), set()
        self.holding = False

    def invalidate(self) -> None:
        """This sync loads bytes the store never sees: no base is left to patch."""
        self.discard()
        self._base, self.clean = {}, False

    def rebuild(
        self, metas: Sequence[TensorMeta], buf: Bytes, skip_same: bool = False
    ) -> tuple[list[Loaded], dict[str, bytes], set[Key]]:
        """Every tensor of a verified bucket, patches rebuilt on the base: (name, part,
        tensor) in order to load, the rebuilt whole tensors' digest parts, and the keys
        staged here.
        `skip_same`: leave unchanged tensors out of the load (the engine digests its
        whole model, and its model holds the base). Sparse patches apply in place to the
        base (undone if the sync does not finalize). Raises STALE_BASE (no or another
        base) or CHECKSUM_MISMATCH (a wrong rebuild; that tensor is put back first)."""
        flat = flat_bytes(buf)
        out: list[Loaded] = []
        parts: dict[str, bytes] = {}
        staged: set[Key] = set()
        for m in metas:
            raw = flat[m.offset : m.offset + m.nbytes]
            key, part = (m.name, m.box), m.box or WHOLE
            if m.patch is None:
                out.extend(loaded_of((m,), buf))
                continue
            base, base_part = self._get(m.name, m.box, m.shape)
            if m.box is None:
                parts[m.name] = m.patch.result
            staged.add(key)
            if m.patch.kind == "same":
                base = delta.check_base(m, base, base_part)
                if not (skip_same and self.clean and key not in self._staged):
                    out.append((m.name, part, base))
                continue
            if m.patch.kind == "sparse" and self.keeping:
                t = delta.check_base(m, base, base_part)
                u = delta.patch_in_place(m, raw, t)
                if delta.held_part(m, t) != m.patch.result:
                    delta.undo(t, u)
                    raise delta.wrong_rebuild(m)
                held = self._base.get(key)
                if held is not None and held[0] is t:  # a base tensor, changed in place: undo kept
                    self._undo.setdefault(key, []).append(u)
            else:
                t = delta.rebuild(m, raw, base, base_part)
            if self.keeping:
                self._keep(key, t, m.patch.result)
            out.append((m.name, part, t))
        return out, parts, staged

    def stage_loaded(self, tensors: Sequence[Loaded], parts: dict[str, bytes] | None, skip: set[Key]) -> None:
        """Stage (copy) every loaded tensor or box not in `skip` (the rebuilt ones are
        already). `parts`: the whole tensors' digest parts where known (a box's is hashed
        when a patch first needs it)."""
        for name, part, t in tensors:
            key = (name, None if part == WHOLE else part)
            if key not in skip:
                self.stage(key, t, None if parts is None or key[1] is not None else parts.get(name))


def loaded_of(metas: Sequence[TensorMeta], buf: Bytes) -> list[Loaded]:
    """A verified bucket's tensors as (name, part, view): WHOLE, or the box a meta names."""
    return [(m.name, m.box or WHOLE, t) for m, (_, t) in zip(metas, unpack(metas, buf), strict=True)]
