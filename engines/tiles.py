"""Whole tensors assembled before they load: from the pieces of a tensor larger than a
bucket (`messages.buckets.Assembler`), and from the boxes of another layout: a replay (rollback, catch-up)
of a version the spool keeps as the boxes its push was cut for (`Load.cut_for`), to an
engine whose layout was not among them (one that takes whole tensors, or a tensor-parallel
engine of another partition). Each box is copied into its tensor's place; the tensor is
handed on once its boxes covered every element (overlapping boxes of several layouts
count once). Memory: the tensors begun and not yet covered, plus one byte per element of
each for the coverage. Used by the applier thread only; cleared when a sync begins or ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from messages.buckets import Assembler, host_buffer, unpack
from messages.checksums import Bytes
from messages.cuts import box_view
from messages.dtypes import DTYPES
from messages.errors import ErrorCode, MessageError, WeightSyncError
from messages.schema import TensorMeta

if TYPE_CHECKING:
    from typing_extensions import Buffer

Parts = dict[str, bytes] | None  # the digest parts of the tensors received, where checked
Group = tuple[tuple[TensorMeta, ...], "Buffer", Parts]  # metas to apply, their bytes, parts


class Tiles:
    def __init__(self) -> None:
        self._open: dict[str, tuple[TensorMeta, torch.Tensor, torch.Tensor]] = {}

    def add(self, meta: TensorMeta, buf: Bytes) -> tuple[TensorMeta, torch.Tensor] | None:
        """Take box `meta.box` of tensor `meta.name` from a verified bucket; the whole
        tensor (its meta, its contiguous contents) once every element is covered."""
        if meta.box is None or meta.patch is not None:
            why = "a patch of a box" if meta.patch is not None else "a whole tensor"
            raise WeightSyncError(
                f"{meta.name}: {why} in a replay this engine assembles from boxes of another layout",
                code=ErrorCode.BAD_MESSAGE,
            )
        held = self._open.get(meta.name)
        if held is None:
            whole = torch.empty(tuple(meta.shape), dtype=DTYPES[meta.dtype])
            held = (meta, whole, torch.zeros(tuple(meta.shape), dtype=torch.bool))
            self._open[meta.name] = held
        first, whole, covered = held
        if (first.dtype, tuple(first.shape)) != (meta.dtype, tuple(meta.shape)):
            raise WeightSyncError(
                f"{meta.name}: boxes of {first.dtype}{list(first.shape)} and {meta.dtype}{list(meta.shape)}",
                code=ErrorCode.SHAPE_MISMATCH,
            )
        ((_, t),) = unpack((meta,), buf)
        box_view(whole, meta.box).copy_(t)
        box_view(covered, meta.box).fill_(True)
        if not bool(covered.all()):
            return None
        del self._open[meta.name]
        nbytes = whole.numel() * whole.element_size()
        return TensorMeta(meta.name, meta.dtype, tuple(meta.shape), 0, nbytes), whole

    def clear(self) -> None:
        self._open.clear()


def assembled(
    metas: Sequence[TensorMeta],
    buf: Buffer,
    parts: Parts,
    pieces: Assembler,
    tiles: Tiles | None,
    on_pass: Callable[[str, float, int], None],
) -> Iterator[Group]:
    """A bucket holding pieces (or, with `tiles`, boxes to assemble) as what to apply: its
    other tensors first, then each tensor its piece or box completed. A box whose pieces
    completed goes on to `tiles`. `on_pass` counts each piece's second pass (copy, hash)."""

    def ready(m: TensorMeta) -> bool:  # applied as it is: neither a piece nor a box to assemble
        return m.start is None and (tiles is None or m.box is None)

    whole = tuple(m for m in metas if ready(m))
    if whole:
        yield whole, buf, None if parts is None else {m.name: parts[m.name] for m in whole}
    for m in metas:
        if ready(m):
            continue
        if m.start is None:  # a box: whole once its tensor's boxes cover it
            done = tiles.add(m, buf) if tiles is not None else None
            if done is not None:
                yield (done[0],), memoryview(host_buffer(done[1])), None
            continue
        try:
            added = pieces.add(m, buf)
        except MessageError as exc:
            raise WeightSyncError(exc.reason, code=exc.code) from None
        # its second pass: copied into the whole tensor, hashed for its digest part
        p = added.passed
        on_pass("assemble", p.copy_s + p.hash_s, p.hashed)
        if added.whole is not None:
            meta, data, part = added.whole
            yield (
                (meta,),
                memoryview(host_buffer(data)),
                None if parts is None or (tiles is not None and meta.box) else {meta.name: part},
            )
