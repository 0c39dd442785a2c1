"""The trainer's side of delta sync: a copy of the version the fleet serves, and the
encoding of each pushed tensor against it.

Rules: the copy is in host memory, one per tensor name, in the dtype and shape pushed
(checkpoint format), with each tensor's digest part. A push encodes as it streams (one
tensor at a time, no second model) and updates the copy in place, keeping what it
overwrote (`undo`): the push's READY keeps the update (`commit`); a failure restores the
copy exactly where a patch changed it and drops what was overwritten whole (the next
push sends those dense), so the copy never differs from what the fleet serves. Memory:
one model's bytes (`nbytes`), plus, during a push, the old values of what it patched.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from messages import delta
from messages.buckets import Cast, Digester, Item, Patched, Sliced, as_bytes, copy_bytes
from messages.cuts import Planned, cut, part_digest
from messages.replies import JsonObject
from messages.schema import INDEX32_MAX
from messages.slices import Box

_LOST = ("lost",)  # an undo marker: the old value was overwritten in place, drop the name
RETRY_DELTA = 8  # a transport whose delta pushes were slower tries delta again every this many
JUDGED_BYTES = 64 << 20  # smaller models always go delta: fixed costs, not the pass, decide there


@dataclass(slots=True)
class Pace:
    """Seconds per model byte of the recent pushes over one transport (halved memory of
    the older ones), dense and delta; how many delta pushes went dense since delta was
    last tried there."""

    dense: float | None = None
    delta: float | None = None
    skipped: int = 0
    model_bytes: int = 0  # the last push's


class DeltaChooser:
    """Whether a delta push pays over a transport, from what the pushes over it measured.

    Encoding a delta costs a pass over every tensor (comparison, digest) on the trainer;
    it pays where the link is slower than that pass (through the daemon, between hosts)
    and not where the link outruns it (shared memory, a fast group on one host). A
    delta push over a transport whose delta pushes took longer per model byte than its
    dense pushes goes dense (the copy kept as usual), trying delta again every
    RETRY_DELTA pushes in case that changed; the result says which was chosen and why.

    Measurements are keyed by the transport the daemon chose for the push (its begin's
    answer: a transport's name or "mixed"), never by the one asked for: "auto" or a
    fallback (a reference transport answered with frames) would otherwise mix links of
    different speeds.
    A push asks by what it requests; the chooser looks up what the daemon last chose for
    that request."""

    def __init__(self) -> None:
        self.paces: dict[str, Pace] = {}  # the daemon's chosen transport -> its measurements
        self.answered: dict[str, str] = {}  # transport asked for -> the one the daemon chose last

    def choose(self, asked: str) -> tuple[bool, str]:
        transport = self.answered.get(asked, asked)
        p = self.paces.get(transport)
        if p is None or p.dense is None or p.delta is None:
            return True, "not measured on this transport yet"
        if p.model_bytes < JUDGED_BYTES:
            return True, f"a model under {JUDGED_BYTES >> 20} MiB: its fixed costs decide, not the encoding"
        if p.delta <= p.dense:
            return True, f"delta {p.delta * 1e9:.2f} s/GB <= dense {p.dense * 1e9:.2f} s/GB on {transport}"
        if p.skipped + 1 >= RETRY_DELTA:
            p.skipped = 0
            return True, f"measured again after {RETRY_DELTA - 1} dense pushes on {transport}"
        p.skipped += 1
        return False, (
            f"on {transport} delta pushes took {p.delta * 1e9:.2f} s/GB and dense ones "
            f"{p.dense * 1e9:.2f} s/GB: the link outruns the encoding"
        )

    def record(self, asked: str, chose: str, kind: str, seconds: float, model_bytes: int) -> None:
        """A push of `kind` ("dense" or "delta") of a `model_bytes` model that asked for
        transport `asked` went over `chose` (the daemon's choice) and took `seconds`."""
        self.answered[asked] = chose
        transport = chose
        if model_bytes <= 0 or seconds <= 0:
            return
        p = self.paces.setdefault(transport, Pace())
        p.model_bytes = model_bytes
        v = seconds / model_bytes
        old = p.dense if kind == "dense" else p.delta
        new = v if old is None else (old + v) / 2
        if kind == "dense":
            p.dense = new
        else:
            p.delta = new


def _host(t: torch.Tensor | Cast) -> tuple[torch.Tensor, bool]:
    """`t` as a contiguous CPU tensor, and whether it is our own (a copy) or may be the
    caller's live tensor (then copied only where the base keeps it)."""
    if isinstance(t, Cast):
        return t.materialize().cpu().contiguous(), True
    t = t.detach()
    if t.device.type != "cpu":
        return t.cpu().contiguous(), True
    c = t.contiguous()
    return c, c.data_ptr() != t.data_ptr()


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= INDEX32_MAX else torch.int64


@dataclass(slots=True)
class DeltaStats:
    """What the last push sent, per kind of entry (tensors and wire bytes)."""

    tensors: dict[str, int] = field(default_factory=dict)
    wire_bytes: dict[str, int] = field(default_factory=dict)
    dense_bytes: int = 0  # what a dense push of the same tensors would send
    changed: int = 0  # elements that differ from the base (counted where compared)
    elements: int = 0

    def add(self, kind: str, wire: int, full: int, changed: int, numel: int) -> None:
        self.tensors[kind] = self.tensors.get(kind, 0) + 1
        self.wire_bytes[kind] = self.wire_bytes.get(kind, 0) + wire
        self.dense_bytes += full
        self.changed += changed
        self.elements += numel

    def view(self) -> JsonObject:
        return {
            "tensors": dict(self.tensors),
            "wire_bytes": dict(self.wire_bytes),
            "bytes": sum(self.wire_bytes.values()),
            "dense_bytes": self.dense_bytes,
            "density": self.changed / self.elements if self.elements else 0.0,
        }


class DeltaBase:
    def __init__(self) -> None:
        self.version: int | None = None  # the version the copy holds (None: no copy yet)
        self._t: dict[str, tuple[torch.Tensor, bytes | None]] = {}  # (tensor, its part when known)
        # name -> what to put back on failure: None (the name was new), the old entry,
        # or (flat indices, old values, old part) for a sparse change made in place
        self._undo: dict[str, Any] = {}
        self.stats = DeltaStats()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, _ in self._t.values())

    def encode(
        self,
        named: Iterable[tuple[str, torch.Tensor | Cast]],
        mode: delta.Mode = "auto",
        planned: Planned | None = None,
    ) -> Iterator[tuple[str, Item]]:
        """Each tensor as its smallest entry against the copy (a `Patched`, or the tensor
        itself where dense is smaller), the copy updated as it goes. With `planned` (filled
        by the push at its begin), a tensor the engines' ranks take as boxes is encoded box
        by box: each box a patch of that box, or the box itself where dense is smaller."""
        self.stats = DeltaStats()
        for name, t in named:
            new, owned = _host(t)
            old = self._t.get(name)
            full = new.numel() * new.element_size()
            if old is None or old[0].dtype != new.dtype or old[0].shape != new.shape:
                self._overwrite(name, new, owned, None)
                self.stats.add("dense", full, full, new.numel(), new.numel())
                yield name, new
                continue
            boxes = planned.cuts.boxes(name) if planned is not None and planned.cuts is not None else []
            if boxes:
                yield from self._encode_boxes(
                    name, new, old[0], boxes, mode, planned.digester if planned else None
                )
                self._overwrite(name, new, owned, None)
                continue
            enc, part = delta.encode(name, new, old[0], functools.partial(self._part, name), mode)
            if enc.patch is None:
                self._overwrite(name, new, owned, part)
                self.stats.add("dense", full, full, enc.changed, new.numel())
                yield name, new
                continue
            if enc.patch.kind == "sparse":
                self._patch_in_place(name, self._t[name], new, enc, part)
            elif enc.patch.kind == "xor":
                self._overwrite(name, new, owned, part)
            self.stats.add(enc.patch.kind, int(enc.data.numel()), full, enc.changed, new.numel())
            yield name, Patched(enc.patch, enc.data, new.dtype, new.shape, dense=new)

    def _encode_boxes(
        self,
        name: str,
        new: torch.Tensor,
        old: torch.Tensor,
        boxes: list[Box],
        mode: delta.Mode,
        digester: Digester | None,
    ) -> Iterator[tuple[str, Item]]:
        """`name`'s boxes, each against the same box of the copy (messages/cuts.py): the
        parts are the boxes' (what a rank holds), the version's digest the whole tensor's."""
        shape = tuple(new.shape)
        if digester is not None:
            digester.update(name, new)
        for box in boxes:
            nb, ob = cut(new, box), cut(old, box)
            part_of = functools.partial(part_digest, name, shape, box)
            enc, _ = delta.encode(name, nb, ob, functools.partial(part_of, ob), mode, part_of)
            size = nb.numel() * nb.element_size()
            sliced = Sliced(nb, box, shape)
            if enc.patch is None:
                self.stats.add("dense", size, size, enc.changed, nb.numel())
                yield name, sliced
            else:
                self.stats.add(enc.patch.kind, int(enc.data.numel()), size, enc.changed, nb.numel())
                yield name, Patched(enc.patch, enc.data, new.dtype, shape, dense=sliced, box=box)

    def record(self, named: Iterable[tuple[str, torch.Tensor | Cast]]) -> Iterator[tuple[str, torch.Tensor]]:
        """A dense push that also becomes the copy: each tensor passes through unchanged."""
        self.stats = DeltaStats()
        for name, t in named:
            new, owned = _host(t)
            self._overwrite(name, new, owned, None)
            full = new.numel() * new.element_size()
            self.stats.add("dense", full, full, new.numel(), new.numel())
            yield name, new

    def adopt(self, named: Iterable[tuple[str, torch.Tensor | Cast]], version: int) -> None:
        """Take `named` as the copy of `version` without pushing it (e.g. the checkpoint the
        fleet was given by another process); engines check each patch's base anyway."""
        for _ in self.record(named):
            pass
        self.commit(version)

    def _part(self, name: str) -> bytes:
        """The copy's digest part of `name` (hashed on first use: dense entries are not)."""
        t, part = self._t[name]
        if part is None:
            part = delta.part(name, t)
            self._t[name] = (t, part)
        return part

    def _overwrite(self, name: str, new: torch.Tensor, owned: bool, part: bytes | None) -> None:
        """The copy of `name` becomes `new`: written into the copy's own memory when the
        shape allows (a fresh model-sized allocation per push costs more in page faults
        than the copy itself), else a new tensor. An overwritten tensor cannot be put
        back: a failed push drops it from the copy (the next push sends it dense)."""
        old = self._t.get(name)
        if old is not None and old[0].shape == new.shape and old[0].dtype == new.dtype and not owned:
            copy_bytes(as_bytes(old[0]), as_bytes(new))
            if name not in self._undo:
                self._undo[name] = _LOST
            self._t[name] = (old[0], part)
            return
        self._replace(name, new if owned else new.clone(), part)

    def _replace(self, name: str, new: torch.Tensor, part: bytes | None) -> None:
        if name not in self._undo:
            self._undo[name] = self._t.get(name)
        self._t[name] = (new, part)

    def _patch_in_place(
        self,
        name: str,
        old: tuple[torch.Tensor, bytes | None],
        new: torch.Tensor,
        enc: delta.Encoded,
        part: bytes | None,
    ) -> None:
        ints = delta.ints(old[0])
        index = _index_dtype(new.numel())
        where = enc.data[: enc.changed * index.itemsize].view(index).long()
        if name not in self._undo:
            self._undo[name] = (where, ints[where].clone(), old[1])
        ints[where] = as_bytes(new).view(ints.dtype)[where]
        self._t[name] = (old[0], part)

    def commit(self, version: int) -> None:
        """The push is READY fleet-wide: the copy is that version."""
        self._undo = {}
        self.version = version

    def rollback(self) -> None:
        """The push failed: put the copy back exactly as the fleet still serves it."""
        for name, was in self._undo.items():
            if was is None or was is _LOST:
                self._t.pop(name, None)
            elif len(was) == 2:  # (tensor, part): the entry replaced
                self._t[name] = was
            else:  # (indices, old values, old part): a sparse change made in place
                where, values, part = was
                t = self._t[name][0]
                delta.ints(t)[where] = values
                self._t[name] = (t, part)
        self._undo = {}

    def forget(self) -> None:
        """No copy can be trusted (the fleet refused our base): the next push goes dense."""
        self._t, self._undo, self.version = {}, {}, None
