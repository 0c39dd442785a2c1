"""Named tensors <-> flat byte buckets, and the weight digest.

Rules: a bucket is one contiguous uint8 buffer with tensors back to back at 64-byte
aligned offsets; its header lists `TensorMeta`s and its checksum (messages.checksums: over its tensors'
digest parts, so one pass over the bytes gives both).
Packing copies each tensor once (that copy is the wire image); unpacking never copies:
it returns views into the received buffer. `digest()` is the one definition of "the same
weights" used by trainers and every engine.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np
import torch
import xxhash

from messages.checksums import Bytes, bucket_hash, byte_view, checksum_of, combine, part_hasher
from messages.dtypes import DTYPES, dtype_name, tensor_nbytes
from messages.errors import ErrorCode, MessageError
from messages.schema import DEFAULT_BUCKET_BYTES, Patch, TensorMeta
from messages.slices import Box, box_shape

if TYPE_CHECKING:
    from typing_extensions import Buffer

ALIGN = 64


@dataclass(frozen=True, slots=True)
class PackedBucket:
    seq: int
    tensors: tuple[TensorMeta, ...]
    data: torch.Tensor  # uint8, contiguous; `memoryview(data.numpy())` is the wire frame
    checksum: int
    copy_s: float = 0.0  # packing's two passes over the bytes, timed apart (bench.vllm's account)
    hash_s: float = 0.0
    copied: int = 0  # and the bytes each pass went over, counted by the loop that ran it
    hashed: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def frame(self) -> memoryview:
        return memoryview(self.data.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers


def tensor_view(t: torch.Tensor) -> memoryview:
    """A flat CPU tensor's bytes as a buffer (numpy arrays are buffers; their stubs say not
    before Python 3.12)."""
    return memoryview(t.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Cast:
    """`src` as `dtype`, cast while it is packed: straight into the bucket, with no
    intermediate tensor (a trainer's fp32 master pushed as bf16 costs no extra memory)."""

    __slots__ = ("src", "dtype", "shape")

    def __init__(self, src: torch.Tensor, dtype: torch.dtype) -> None:
        self.src, self.dtype, self.shape = src, dtype, src.shape

    def numel(self) -> int:
        return self.src.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def materialize(self) -> torch.Tensor:
        return self.src.to(self.dtype)


class Patched:
    """A delta entry to pack: `data` (uint8, flat) patches tensor `name` of `dtype` and
    `shape` as `patch` says (messages/delta.py); the bucket's meta keeps the full dtype and
    shape, so the daemon checks it against the engines' spec like a dense tensor. With
    `box`, it patches that box of the tensor (an engine rank's slice, held contiguous):
    `shape` stays the full tensor's, and the patch's parts are the box's."""

    __slots__ = ("patch", "data", "dtype", "shape", "dense", "box")

    def __init__(
        self,
        patch: Patch,
        data: torch.Tensor,
        dtype: torch.dtype,
        shape: Iterable[int],
        dense: torch.Tensor | Sliced | None = None,
        box: Box | None = None,
    ) -> None:
        self.patch, self.data, self.dtype, self.shape = patch, data, dtype, tuple(shape)
        self.dense = dense  # what it rebuilds: sent instead where the patch outgrows a bucket
        self.box = box

    def numel(self) -> int:
        return int(self.data.numel())

    def element_size(self) -> int:
        return 1

    def covered(self) -> int:
        """The bytes of the tensor (or box) it patches (what a bucket's size counts: see iter_buckets)."""
        n = 1
        for d in self.shape if self.box is None else box_shape(self.box):
            n *= d
        return n * self.dtype.itemsize


class Sliced:
    """Box `box` of tensor `name` (an engine rank's slice, messages/slices.py), packed as
    the box's contiguous bytes; the bucket's meta keeps the full dtype and shape and names
    the box. `data` is the cut (`messages.slices.cut`), `shape` the full tensor's."""

    __slots__ = ("data", "box", "dtype", "shape")

    def __init__(self, data: torch.Tensor, box: Box, shape: tuple[int, ...]) -> None:
        self.data, self.box, self.dtype, self.shape = data, box, data.dtype, shape

    def numel(self) -> int:
        return int(self.data.numel())

    def element_size(self) -> int:
        return int(self.data.element_size())


class Piece:
    """Bytes [start, start + nbytes) of a tensor larger than a bucket, packed alone in a
    bucket. `src` is the whole tensor's flat bytes (made once for all its pieces) or the
    `Cast` that makes them. `full` is the tensor's digest hasher, fed every piece in order
    and shared by them: after the last piece its digest is the whole tensor's part."""

    __slots__ = ("src", "dtype", "shape", "start", "nbytes", "full", "last", "box")

    def __init__(
        self,
        src: torch.Tensor | Cast,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        start: int,
        nbytes: int,
        full: xxhash.xxh3_128,
        last: bool,
        box: Box | None = None,  # a piece of this box's bytes (a `Sliced` larger than a bucket)
    ) -> None:
        self.src, self.dtype, self.shape = src, dtype, shape
        self.start, self.nbytes, self.full, self.last, self.box = start, nbytes, full, last, box

    def numel(self) -> int:
        return self.nbytes

    def element_size(self) -> int:
        return 1

    def write(self, dst: torch.Tensor, hasher: xxhash.xxh3_128) -> Passed:
        """Copy the piece's bytes into `dst`, hashed for its own part and the tensor's."""
        if isinstance(self.src, Cast):  # cast this piece's elements straight into dst
            size = self.dtype.itemsize
            flat = self.src.src.detach().reshape(-1)[self.start // size : (self.start + self.nbytes) // size]
            return cast_hashing(dst, flat, self.dtype, hasher, self.full)
        return copy_hashing(dst, self.src[self.start : self.start + self.nbytes], hasher, self.full)


def pieces(name: str, t: torch.Tensor | Cast | Sliced, bucket_bytes: int) -> Iterator[Piece]:
    """`t` cut into pieces of at most `bucket_bytes` (whole elements, at least one); a
    `Sliced`'s pieces are of its box's bytes."""
    size = t.element_size()
    total = t.numel() * size
    step = max(size, bucket_bytes // size * size)
    box = t.box if isinstance(t, Sliced) else None
    full = part_hasher(name, dtype_name(t.dtype), tuple(t.shape), box=box)
    # a non-contiguous tensor is copied once
    src = t if isinstance(t, Cast) else as_bytes(t.data if isinstance(t, Sliced) else t)
    for start in range(0, total, step):
        n = min(step, total - start)
        yield Piece(src, t.dtype, tuple(t.shape), start, n, full, start + n == total, box)


Item = torch.Tensor | Cast | Patched | Piece | Sliced


def as_bytes(t: torch.Tensor | Cast) -> torch.Tensor:
    """A flat uint8 view of `t`'s bytes (copied to contiguous CPU first if needed)."""
    if isinstance(t, Cast):
        t = t.materialize()
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.uint8:
        return t
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(torch.uint8)


Alloc = Callable[[int, int], torch.Tensor]  # (seq, nbytes) -> writable uint8 tensor


# Copy, then hash, CHUNK bytes at a time. Measured with `python -m bench` on this 2-core
# host: 1 MiB chunks (hash from cache) were 10% slower than 64 MiB chunks (one copy_ per
# tensor, hash from memory): torch's per-call cost outweighs the cache hits here.
CHUNK = 1 << 26


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for flat uint8 CPU tensors, on this thread alone.

    Not `torch.Tensor.copy_`: it splits a large copy over torch's intra-op thread pool,
    and where the trainer and an engine share cores (one host, few cores) each split waits
    for its slowest thread, which is queued behind the other process's threads: measured
    on a 2-core host during a push to vLLM, 245 ms of copy_ per 428 MB against 45 ms
    alone. A plain memcpy (numpy releases the GIL) runs at memory speed either way."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy(), casting="no")
    else:
        dst.copy_(src)


class Passed(NamedTuple):
    """What `copy_hashing` did: seconds copying and hashing, bytes copied, and bytes fed
    to the hashers (each hasher's, summed), counted chunk by chunk as the work is done."""

    copy_s: float
    hash_s: float
    copied: int
    hashed: int


def copy_hashing(dst: torch.Tensor, src: torch.Tensor, *hashers: xxhash.xxh3_128) -> Passed:
    """dst[:] = src for flat uint8 tensors, CHUNK bytes at a time, feeding each copied
    chunk of `dst` to every streaming hasher (the tensor's part, which serves the checksum
    and the digest alike)."""
    n = src.numel()
    copying = hashing = 0.0
    copied = hashed = 0
    t0 = time.perf_counter()
    for off in range(0, n, CHUNK):
        d = dst[off : off + CHUNK]
        copy_bytes(d, src[off : off + CHUNK])
        copied += d.numel()
        t1 = time.perf_counter()
        copying += t1 - t0
        if hashers:
            v = tensor_view(d)
            for h in hashers:
                h.update(v)
                hashed += v.nbytes
        t0 = time.perf_counter()
        hashing += t0 - t1
    return Passed(copying, hashing, copied, hashed)


def cast_hashing(
    dst: torch.Tensor, src: torch.Tensor, dtype: torch.dtype, *hashers: xxhash.xxh3_128
) -> Passed:
    """dst[:] = src cast to `dtype` (dst: flat uint8 of src's elements at that dtype), in
    one casting copy, then each hasher fed dst's bytes (a `Cast`, whole or a piece)."""
    t0 = time.perf_counter()
    dst.view(dtype).copy_(src)
    t1 = time.perf_counter()
    v = tensor_view(dst)
    for h in hashers:
        h.update(v)
    return Passed(t1 - t0, time.perf_counter() - t1, dst.numel(), len(hashers) * v.nbytes)


def _pack(
    seq: int,
    items: list[tuple[str, Item]],
    alloc: Alloc | None = None,
    digester: Digester | None = None,
) -> PackedBucket:
    metas: list[TensorMeta] = []
    offset = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        patch = t.patch if isinstance(t, Patched) else None
        start = t.start if isinstance(t, Piece) else None
        box = t.box if isinstance(t, (Piece, Sliced, Patched)) else None
        metas.append(TensorMeta(name, dtype_name(t.dtype), tuple(t.shape), offset, nbytes, patch, start, box))
        offset = _aligned(offset + nbytes)
    total = metas[-1].offset + metas[-1].nbytes if metas else 0
    data = torch.empty(total, dtype=torch.uint8) if alloc is None else alloc(seq, total)
    parts: list[bytes] = []  # every tensor's part: its digest part and a piece of the checksum
    copying = hashing = 0.0
    copied = hashed = 0
    pos = 0
    for meta, (name, t) in zip(metas, items, strict=True):
        if meta.offset > pos:  # padding: zeros, so the frame is the same every time
            data[pos : meta.offset].zero_()
        h = part_hasher(meta.name, meta.dtype, meta.shape, meta.start, meta.box)
        dst = data[meta.offset : meta.offset + meta.nbytes]
        if not meta.nbytes:
            pass
        elif isinstance(t, Piece):
            done = t.write(dst, h)
            copying, hashing = copying + done.copy_s, hashing + done.hash_s
            copied, hashed = copied + done.copied, hashed + done.hashed
        elif isinstance(t, Cast):  # the casting copy writes the bucket itself
            done = cast_hashing(dst, t.src.detach().reshape(-1), t.dtype, h)
            copying, hashing = copying + done.copy_s, hashing + done.hash_s
            copied, hashed = copied + done.copied, hashed + done.hashed
        else:
            done = copy_hashing(
                dst, t.data if isinstance(t, Patched) else as_bytes(t.data if isinstance(t, Sliced) else t), h
            )
            copying, hashing = copying + done.copy_s, hashing + done.hash_s
            copied, hashed = copied + done.copied, hashed + done.hashed
        part = h.digest()
        parts.append(part)
        if isinstance(t, Piece):  # the tensor's part is over all its pieces: known at the last
            if t.last and digester is not None:
                digester.add(name, t.full.digest(), t.box)
        elif isinstance(t, Sliced):
            if digester is not None:
                digester.add(name, part, t.box)
        elif isinstance(t, Patched):  # a patch's digest part is the tensor (or box) it rebuilds
            if digester is not None:
                digester.add(name, t.patch.result, t.box)
        elif digester is not None:
            digester.add(name, part)
        pos = meta.offset + meta.nbytes
    return PackedBucket(seq, tuple(metas), data, checksum_of(parts), copying, hashing, copied, hashed)


def iter_buckets(
    named_tensors: Iterable[tuple[str, Item]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    alloc: Alloc | None = None,
    digester: Digester | None = None,
    split: bool = False,
) -> Iterator[PackedBucket]:
    """Stream (name, tensor) pairs into buckets of at most `bucket_bytes`. A larger tensor
    goes alone, or with `split` as pieces of at most `bucket_bytes`, one bucket each (a
    delta patch larger than a bucket is then sent as the dense tensor it rebuilds), so no
    bucket exceeds `bucket_bytes` whatever the model. Holds one bucket's worth of
    references at a time. `alloc(seq, nbytes)` provides the bucket's buffer (e.g. a
    shared-memory slot); default: a new tensor. `digester`, if given, takes every tensor's
    digest during the same copy."""
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be > 0")
    seq = 0
    pending: list[tuple[str, Item]] = []
    size = 0
    for name, t in named_tensors:
        if not isinstance(t, (torch.Tensor, Cast, Patched, Sliced)):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        dtype_name(t.dtype)  # refuse unsupported dtypes before packing anything
        if split and isinstance(t, Patched) and t.numel() > bucket_bytes and t.dense is not None:
            t = t.dense
        if split and not isinstance(t, Patched) and t.numel() * t.element_size() > bucket_bytes:
            if pending:
                yield _pack(seq, pending, alloc, digester)
                seq += 1
                pending, size = [], 0
            for piece in pieces(name, t, bucket_bytes):
                yield _pack(seq, [(name, piece)], alloc, digester)
                seq += 1
            continue
        # A patch counts as the tensor it covers: a delta push is cut where the dense one
        # would be, so its first bucket leaves (and engines start) while the rest encodes.
        nbytes = t.covered() if isinstance(t, Patched) else t.numel() * t.element_size()
        if pending and _aligned(size) + nbytes > bucket_bytes:
            yield _pack(seq, pending, alloc, digester)
            seq += 1
            pending, size = [], 0
        pending.append((name, t))
        size = _aligned(size) + nbytes
    if pending:
        yield _pack(seq, pending, alloc, digester)


def host_buffer(t: torch.Tensor) -> Buffer:
    """A CPU tensor's numpy array: a buffer (numpy's stubs say so for Python >= 3.12 only)."""
    return cast("Buffer", t.numpy())


def flat_bytes(buf: Bytes) -> torch.Tensor:
    """A received buffer as a flat uint8 tensor (a view, no copy)."""
    mv = byte_view(buf)
    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # Received frames are read-only; the views are only ever read from.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mv, dtype=torch.uint8)


def unpack(metas: Sequence[TensorMeta], buf: Bytes) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of each tensor inside `buf` (no copy). The codec has validated the metas;
    delta patches are rebuilt before this (engines/delta.py), never unpacked as tensors."""
    flat = flat_bytes(buf)
    for m in metas:
        if m.patch is not None:
            raise ValueError(f"{m.name}: a delta patch, not a tensor (rebuild it first)")
        raw = flat[m.offset : m.offset + m.nbytes]
        dtype = DTYPES[m.dtype]
        t = raw.view(dtype) if dtype != torch.uint8 else raw
        shape = m.shape if m.box is None else box_shape(m.box)
        yield m.name, t.view(shape) if shape else t.reshape(())


class Added(NamedTuple):
    """One piece taken in: what copying and hashing it cost (its second pass over the
    bytes), and the whole tensor once this was its last piece (its meta, its bytes, its
    digest part), else None."""

    passed: Passed
    whole: tuple[TensorMeta, torch.Tensor, bytes] | None


class Assembler:
    """A receiver's tensors larger than a bucket, assembled from their pieces (in order,
    one bucket each) before anything loads them. Holds at most the tensors begun and not
    yet complete: one at a time from one source, since a source's pieces are consecutive."""

    def __init__(self) -> None:
        self._open: dict[
            str, tuple[TensorMeta, torch.Tensor, xxhash.xxh3_128, int]
        ] = {}  # name -> meta, bytes, hasher, got

    def add(self, m: TensorMeta, buf: Bytes) -> Added:
        """A piece (`m.start` set; its bytes at m.offset of `buf`) copied in (`Added`). A
        piece out of order, or not matching the tensor begun, is a BAD_MESSAGE (the codec
        has bounded it already)."""
        start = m.start or 0
        full = tensor_nbytes(m.dtype, m.shape if m.box is None else box_shape(m.box))
        held = self._open.get(m.name)
        if held is None:
            if start:
                raise MessageError(ErrorCode.BAD_MESSAGE, f"{m.name}: piece at byte {start} before its first")
            whole = TensorMeta(m.name, m.dtype, tuple(m.shape), 0, full, box=m.box)
            held = (
                whole,
                torch.empty(full, dtype=torch.uint8),
                part_hasher(m.name, m.dtype, tuple(m.shape), box=m.box),
                0,
            )
        whole, data, hasher, got = held
        if start != got or (whole.dtype, tuple(whole.shape), whole.box) != (m.dtype, tuple(m.shape), m.box):
            raise MessageError(
                ErrorCode.BAD_MESSAGE,
                f"{m.name}: piece [{start}, {start + m.nbytes}) of {m.dtype}{list(m.shape)} where byte {got} "
                f"of {whole.dtype}{list(whole.shape)} was due",
            )
        src = flat_bytes(buf)[m.offset : m.offset + m.nbytes]
        passed = copy_hashing(data[got : got + m.nbytes], src, hasher)
        got += m.nbytes
        if got < full:
            self._open[m.name] = (whole, data, hasher, got)
            return Added(passed, None)
        self._open.pop(m.name, None)
        return Added(passed, (whole, data, hasher.digest()))

    def incomplete(self) -> list[str]:
        """Tensors begun and not complete, as 'name (got/total bytes)'."""
        return [f"{n} ({got}/{w.nbytes} bytes)" for n, (w, _d, _h, got) in self._open.items()]

    def clear(self) -> None:
        self._open.clear()


def has_pieces(metas: Sequence[TensorMeta]) -> bool:
    return any(m.start is not None for m in metas)


def has_patches(metas: Sequence[TensorMeta]) -> bool:
    return any(m.patch is not None for m in metas)


class Hashed(NamedTuple):
    checksum: int
    parts: dict[str, bytes] | None
    hashed: int  # the bytes the pass fed the hash (messages.checksums.bucket_hash counts them)


def hash_bucket(buf: Bytes, metas: Sequence[TensorMeta], parts: bool = False) -> Hashed:
    """The bucket checksum of `buf` and, with `parts`, every tensor's digest part
    (`Digester.add`): the same single pass over the bytes either way."""
    got, pieces, hashed = bucket_hash(buf, metas)
    return Hashed(got, {m.name: p for m, p in zip(metas, pieces, strict=True)} if parts else None, hashed)


class Digester:
    """Order-independent digest over named tensors: the sum of their parts modulo 2**128.

    Per tensor: xxh3-128 of name, dtype, shape and bytes. Equal state dicts give equal
    digests whatever order or bucketing they were streamed in, and the digests of disjoint
    sets of tensors add up to their union's (`messages.checksums.add_digests`).
    """

    def __init__(self) -> None:
        self._parts: dict[str, bytes] = {}
        self.slices: dict[tuple[str, Box], bytes] = {}  # the parts of boxes sent (a rank's slices)

    @staticmethod
    def start(name: str, t: torch.Tensor | Cast) -> xxhash.xxh3_128:
        """A streaming hash for tensor `name`: feed it the tensor's bytes, then `finish`."""
        return Digester.start_meta(name, dtype_name(t.dtype), tuple(t.shape))

    @staticmethod
    def start_meta(name: str, dtype: str, shape: tuple[int, ...]) -> xxhash.xxh3_128:
        return part_hasher(name, dtype, shape)

    def finish(self, name: str, h: xxhash.xxh3_128) -> None:
        self._parts[name] = h.digest()

    def add(self, name: str, part: bytes, box: Box | None = None) -> None:
        """A tensor's part computed elsewhere (`hash_bucket`), from the same bytes; with
        `box`, the part of that box of it (kept apart: the tensor's own part is the whole's)."""
        if box is None:
            self._parts[name] = part
        else:
            self.slices[(name, box)] = part

    def part(self, name: str) -> bytes | None:
        return self._parts.get(name)

    def update(self, name: str, t: torch.Tensor) -> None:
        h = self.start(name, t)
        b = as_bytes(t)
        if b.numel():
            h.update(tensor_view(b))
        self.finish(name, h)

    def hexdigest(self) -> str:
        return combine(self._parts)

    def __len__(self) -> int:
        return len(self._parts)


def digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    d = Digester()
    for name, t in named_tensors:
        d.update(name, t)
    return d.hexdigest()
