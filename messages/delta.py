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

from dataclasses import dataclass
from typing import Any, Literal

import torch
import zstandard

from messages.buckets import Digester, as_bytes
from messages.dtypes import DTYPES
from messages.errors import ErrorCode, WeightSyncError
from messages.schema import INDEX32_MAX, Patch, TensorMeta

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
Mode = Literal["auto", "sparse", "xor"]
# A sample of this many elements decides, before any full pass, that a tensor changed
# almost everywhere and goes dense (a dense-every-element step costs about a dense push).
SAMPLE = 4096
DENSE_SAMPLE_FRACTION = 0.5
ZSTD_LEVEL = 1  # level 1: ~1 GB/s on the mostly-zero XOR of a small step; higher barely shrinks it


def _ints(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as integers of the same width, flat (a view, no copy)."""
    return as_bytes(t).view(_INT[t.element_size()])


def part(name: str, t: torch.Tensor) -> bytes:
    """The tensor's digest part: what the weight digest is made of (`Digester`)."""
    h = Digester.start(name, t)
    b = as_bytes(t)
    if b.numel():
        h.update(b.numpy())
    return bytes(h.digest())


@dataclass(frozen=True, slots=True)
class Encoded:
    """One tensor's entry of a delta push: `patch` None means dense (`data` is the tensor)."""

    patch: Patch | None
    data: torch.Tensor  # uint8 flat (a patch), or the new tensor itself (dense)
    changed: int  # elements that differ from the base (numel when not counted)


def encode(
    name: str, new: torch.Tensor, base: torch.Tensor, base_part: bytes, mode: Mode = "auto"
) -> tuple[Encoded, bytes]:
    """`new` against `base` (same dtype and shape, contiguous CPU): the smallest entry and
    `new`'s digest part. mode: "sparse" or "xor" force that encoding when it is smaller
    than dense (the benchmark measures each)."""
    new_part = part(name, new)
    numel, item = new.numel(), new.element_size()
    dense = Encoded(None, new, numel)
    if new_part == base_part:
        return Encoded(Patch("same", base_part, new_part), torch.empty(0, dtype=torch.uint8), 0), new_part
    a, b = _ints(new), _ints(base)
    if numel > SAMPLE:  # changed nearly everywhere: skip the full comparison
        idx = torch.linspace(0, numel - 1, SAMPLE).long()
        if (a[idx] != b[idx]).float().mean().item() > DENSE_SAMPLE_FRACTION:
            return dense, new_part
    where = (a != b).nonzero().reshape(-1)
    count = int(where.numel())
    best, size = dense, numel * item
    index_dtype = torch.int32 if numel <= INDEX32_MAX else torch.int64
    sparse_size = count * (index_dtype.itemsize + item)
    if mode in ("auto", "sparse") and sparse_size < size:
        data = torch.empty(sparse_size, dtype=torch.uint8)
        data[: count * index_dtype.itemsize].view(index_dtype).copy_(where)
        data[count * index_dtype.itemsize :].view(a.dtype).copy_(a[where])
        best, size = Encoded(Patch("sparse", base_part, new_part, count), data, count), sparse_size
    if mode == "xor" or (mode == "auto" and sparse_size > numel * item // 16):
        # zstd pays where changes are dense but their XOR has few high bits set
        xored: Any = torch.bitwise_xor(a, b).view(torch.uint8).numpy()  # a buffer (its stubs say not)
        packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(xored)
        if len(packed) < size or (mode == "xor" and len(packed) < numel * item):
            data = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
            best, size = Encoded(Patch("xor", base_part, new_part), data, count), len(packed)
    return best, new_part


def rebuild(
    meta: TensorMeta, raw: torch.Tensor, base: torch.Tensor | None, base_part: bytes | None
) -> torch.Tensor:
    """The full tensor `meta.patch` makes of `base` (raw: the patch's bytes, uint8 flat).
    Returns a new tensor (`base` is left as it is); `same` returns `base` itself."""
    p = meta.patch
    if p is None:
        raise WeightSyncError(f"{meta.name}: not a patch", code=ErrorCode.INTERNAL)
    if base is None or base_part != p.base:
        have = "no base copy" if base is None else "a different base"
        raise WeightSyncError(
            f"{meta.name}: the patch applies to a version this engine does not hold ({have}); push dense",
            code=ErrorCode.STALE_BASE,
        )
    if tuple(base.shape) != tuple(meta.shape) or base.dtype != DTYPES[meta.dtype]:
        raise WeightSyncError(
            f"{meta.name}: the base copy has another dtype or shape", code=ErrorCode.STALE_BASE
        )
    if p.kind == "same":
        return base
    numel, item = base.numel(), base.element_size()
    out = base.clone()
    o = _ints(out)
    if p.kind == "sparse":
        index_dtype = torch.int32 if numel <= INDEX32_MAX else torch.int64
        cut = p.count * index_dtype.itemsize
        idx = raw[:cut].view(index_dtype).long()
        if p.count and (int(idx.min()) < 0 or int(idx.max()) >= numel):
            raise WeightSyncError(f"{meta.name}: sparse patch index out of range", code=ErrorCode.BAD_MESSAGE)
        o[idx] = raw[cut:].view(o.dtype)
    else:
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
        o.bitwise_xor_(torch.frombuffer(bytearray(xored), dtype=torch.uint8).view(o.dtype))
    if part(meta.name, out) != p.result:
        raise WeightSyncError(
            f"{meta.name}: the patch rebuilt a tensor that is not the trainer's; nothing applied",
            code=ErrorCode.CHECKSUM_MISMATCH,
        )
    return out
