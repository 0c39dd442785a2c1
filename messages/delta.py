"""Delta patches: one tensor's change against a base copy, and its exact rebuild.

Rules: a patch is bit-exact. Values are compared and written as integers of the
dtype's width (a bf16 -0.0 and +0.0 differ; a NaN equals itself), so the rebuild is the
trainer's tensor byte for byte. Each patch names the digest part of its base and of its
result (`Digester.part`): `rebuild` refuses a base that is not the one the patch was
made against (STALE_BASE) and a result that is not the trainer's (CHECKSUM_MISMATCH),
before the tensor can reach a model. The encoder picks whichever is smallest: nothing
(`same`), flat indices + values (`sparse`), zstd of the XOR (`xor`), or the dense tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import zstandard

from messages.buckets import Digester, as_bytes, tensor_view
from messages.cuts import part_digest
from messages.dtypes import DTYPES
from messages.errors import ErrorCode, WeightSyncError
from messages.schema import INDEX32_MAX, Patch, TensorMeta
from messages.slices import box_shape

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
Mode = Literal["auto", "sparse", "xor"]
# A sample of this many elements decides, before any full pass, that a tensor changed
# almost everywhere and goes dense (a dense-every-element step costs about a dense push).
SAMPLE = 4096
DENSE_SAMPLE_FRACTION = 0.5
ZSTD_LEVEL = 1  # level 1: ~1 GB/s on the mostly-zero XOR of a small step; higher barely shrinks it


def ints(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as integers of the same width, flat (a view, no copy)."""
    return as_bytes(t).view(_INT[t.element_size()])


COMPARE_CHUNK = 1 << 22  # elements compared at a time: a small reused mask, no model-sized one


def _changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Flat indices where `a` and `b` (same-width integers) differ, in order."""
    n = a.numel()
    if n <= COMPARE_CHUNK:
        return (a != b).nonzero().reshape(-1)
    mask = torch.empty(COMPARE_CHUNK, dtype=torch.bool)
    found = []
    for lo in range(0, n, COMPARE_CHUNK):
        hi = min(n, lo + COMPARE_CHUNK)
        m = mask[: hi - lo]
        torch.ne(a[lo:hi], b[lo:hi], out=m)
        idx = m.nonzero().reshape(-1)
        if idx.numel():
            found.append(idx + lo)
    return torch.cat(found) if found else torch.empty(0, dtype=torch.long)


def part(name: str, t: torch.Tensor) -> bytes:
    """The tensor's digest part: what the weight digest is made of (`Digester`)."""
    h = Digester.start(name, t)
    b = as_bytes(t)
    if b.numel():
        h.update(tensor_view(b))
    return bytes(h.digest())


def held_part(meta: TensorMeta, t: torch.Tensor) -> bytes:
    """The digest part of what an engine holds for `meta`: the whole tensor, or the box
    `meta.box` of it (`t` is then the box's contents, `meta.shape` the full tensor's)."""
    return part(meta.name, t) if meta.box is None else part_digest(meta.name, meta.shape, meta.box, t)


def held_shape(meta: TensorMeta) -> tuple[int, ...]:
    """The shape of what `meta`'s patch applies to: the tensor, or its box."""
    return tuple(meta.shape) if meta.box is None else box_shape(meta.box)


@dataclass(frozen=True, slots=True)
class Encoded:
    """One tensor's entry of a delta push: `patch` None means dense (`data` is the tensor)."""

    patch: Patch | None
    data: torch.Tensor  # uint8 flat (a patch), or the new tensor itself (dense)
    changed: int  # elements that differ from the base (numel when not counted)


def encode(
    name: str,
    new: torch.Tensor,
    base: torch.Tensor,
    base_part: Callable[[], bytes],
    mode: Mode = "auto",
    part_of: Callable[[torch.Tensor], bytes] | None = None,
) -> tuple[Encoded, bytes | None]:
    """`new` against `base` (same dtype and shape, contiguous CPU): the smallest entry and
    `new`'s digest part (None for a dense entry: the bucket's packing hashes it anyway).
    `base_part` gives the base's part (computed only when a patch needs it); `part_of`
    hashes a tensor's part (default: the whole tensor `name`'s; a box's for a slice). mode:
    "sparse" or "xor" force that encoding where it is smaller than dense (benchmarks)."""
    numel, item = new.numel(), new.element_size()
    dense = Encoded(None, new, numel)
    a, b = ints(new), ints(base)
    if numel > SAMPLE:  # changed nearly everywhere: dense, without a full comparison
        idx = torch.arange(0, numel, numel // SAMPLE)[:SAMPLE]  # integers: exact at any size
        if (a[idx] != b[idx]).float().mean().item() > DENSE_SAMPLE_FRACTION:
            return dense, None
    if torch.equal(a, b):
        bp = base_part()
        return Encoded(Patch("same", bp, bp), torch.empty(0, dtype=torch.uint8), 0), bp
    where = _changed(a, b)
    count = int(where.numel())
    index_dtype = torch.int32 if numel <= INDEX32_MAX else torch.int64
    sparse_size = count * (index_dtype.itemsize + item)
    try_sparse = mode in ("auto", "sparse") and sparse_size < numel * item
    try_xor = mode == "xor" or (mode == "auto" and sparse_size > numel * item // 16)
    if not (try_sparse or try_xor):
        return dense, None
    bp, new_part = base_part(), (part(name, new) if part_of is None else part_of(new))
    best, size = dense, numel * item
    if try_sparse:
        data = torch.empty(sparse_size, dtype=torch.uint8)
        data[: count * index_dtype.itemsize].view(index_dtype).copy_(where)
        data[count * index_dtype.itemsize :].view(a.dtype).copy_(a[where])
        best, size = Encoded(Patch("sparse", bp, new_part, count), data, count), sparse_size
    if try_xor:
        # zstd pays where changes are dense but their XOR has few high bits set
        xored = tensor_view(torch.bitwise_xor(a, b).view(torch.uint8))
        packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1).compress(xored)
        if len(packed) < size or (mode == "xor" and len(packed) < numel * item):
            data = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
            best, size = Encoded(Patch("xor", bp, new_part), data, count), len(packed)
    return best, (new_part if best.patch is not None else None)


def check_base(meta: TensorMeta, base: torch.Tensor | None, base_part: bytes | None) -> torch.Tensor:
    """`base` if `meta.patch` applies to it, else STALE_BASE (no, another, or a misshapen base)."""
    p = meta.patch
    if p is None:
        raise WeightSyncError(f"{meta.name}: not a patch", code=ErrorCode.INTERNAL)
    if base is None or base_part != p.base:
        have = "no base copy" if base is None else "a different base"
        raise WeightSyncError(
            f"{meta.name}: the patch applies to a version this engine does not hold ({have}); push dense",
            code=ErrorCode.STALE_BASE,
        )
    if tuple(base.shape) != held_shape(meta) or base.dtype != DTYPES[meta.dtype]:
        raise WeightSyncError(
            f"{meta.name}: the base copy has another dtype or shape", code=ErrorCode.STALE_BASE
        )
    return base


def rebuild(
    meta: TensorMeta, raw: torch.Tensor, base: torch.Tensor | None, base_part: bytes | None
) -> torch.Tensor:
    """The tensor (or box) `meta.patch` makes of `base` (raw: the patch's bytes, uint8 flat).
    Returns a new tensor (`base` is left as it is); `same` returns `base` itself."""
    p = meta.patch
    b = check_base(meta, base, base_part)
    if p is None or p.kind == "same":
        return b
    out = b.clone()
    if p.kind == "sparse":
        patch_in_place(meta, raw, out)
    else:
        numel, item = out.numel(), out.element_size()
        try:
            xored = zstandard.ZstdDecompressor().decompress(
                raw.numpy().tobytes(), max_output_size=numel * item
            )
        except zstandard.ZstdError as exc:
            raise WeightSyncError(
                f"{meta.name}: xor patch unreadable: {exc}", code=ErrorCode.BAD_MESSAGE
            ) from None
        if len(xored) != numel * item:
            raise WeightSyncError(
                f"{meta.name}: xor patch inflates to {len(xored)} bytes, not {numel * item}",
                code=ErrorCode.BAD_MESSAGE,
            )
        o = ints(out)
        o.bitwise_xor_(torch.frombuffer(bytearray(xored), dtype=torch.uint8).view(o.dtype))
    if held_part(meta, out) != p.result:
        raise wrong_rebuild(meta)
    return out


def wrong_rebuild(meta: TensorMeta) -> WeightSyncError:
    return WeightSyncError(
        f"{meta.name}: the patch rebuilt a tensor that is not the trainer's; nothing applied",
        code=ErrorCode.CHECKSUM_MISMATCH,
    )


Undo = tuple[torch.Tensor, torch.Tensor]  # (flat indices, the values they held)


def patch_in_place(meta: TensorMeta, raw: torch.Tensor, target: torch.Tensor) -> Undo:
    """Apply a sparse patch to `target` itself (its base); returns what `undo` needs.
    The caller checks the result's part (and undoes on a mismatch)."""
    p = meta.patch
    numel = target.numel()
    if p is None or p.kind != "sparse":
        raise WeightSyncError(f"{meta.name}: not a sparse patch", code=ErrorCode.INTERNAL)
    index_dtype = torch.int32 if numel <= INDEX32_MAX else torch.int64
    cut = p.count * index_dtype.itemsize
    idx = raw[:cut].view(index_dtype).long()
    if p.count and (int(idx.min()) < 0 or int(idx.max()) >= numel):
        raise WeightSyncError(f"{meta.name}: sparse patch index out of range", code=ErrorCode.BAD_MESSAGE)
    o = ints(target)
    old = o[idx].clone()
    o[idx] = raw[cut:].view(o.dtype)
    return idx, old


def undo(target: torch.Tensor, u: Undo) -> None:
    """Put back what `patch_in_place` overwrote."""
    idx, old = u
    ints(target)[idx] = old
