"""The weight digest's pieces (a tensor's part: xxh3-128 of its name, dtype, shape and
bytes; the digest: their sum modulo 2**128, so disjoint sets' digests add up) and the bucket checksum, which is made of the
same parts: xxh3-64 over the parts of the bucket's tensors, in order. One pass over a
bucket's bytes therefore yields both its checksum and every tensor's digest part
(`bucket_hash`); the padding between tensors (zeros, never loaded) is not covered.
Torch-free: the daemon and the simulated engines use them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, TypeAlias

import xxhash

if TYPE_CHECKING:
    from typing_extensions import Buffer


class Framed(Protocol):
    """A received ZeroMQ frame (`zmq.Frame`): its bytes are `.buffer`."""

    @property
    def buffer(self) -> memoryview: ...


class Arrayed(Protocol):
    """A CPU tensor: its bytes are `.numpy()`'s buffer."""

    def numpy(self) -> object: ...


# What a bucket's bytes arrive as: a buffer, a received frame or a flat CPU tensor.
Bytes: TypeAlias = "Buffer | Framed | Arrayed"


class Ranged(Protocol):
    """What `bucket_hash` reads of a tensor's meta (messages.schema.TensorMeta)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def start(self) -> int | None: ...
    @property
    def box(self) -> tuple[tuple[int, int], ...] | None: ...


def byte_view(buf: Bytes) -> memoryview:
    """`buf`'s bytes as a memoryview, no copy: a tensor's through `.numpy()`, a received
    frame's through `.buffer`."""
    if hasattr(buf, "numpy"):
        # numpy arrays are buffers; numpy's stubs declare `__buffer__` only for Python >= 3.12
        return memoryview(buf.numpy())  # type: ignore[arg-type]
    if hasattr(buf, "buffer"):
        return memoryview(buf.buffer)
    return memoryview(buf)


def part_hasher(
    name: str,
    dtype: str,
    shape: tuple[int, ...],
    start: int | None = None,
    box: tuple[tuple[int, int], ...] | None = None,
) -> xxhash.xxh3_128:
    """A streaming hash of tensor `name`'s digest part: feed it the bytes, then `.digest()`.
    With `start`, the part of a piece (the bytes from `start` of a tensor larger than a
    bucket): it serves the bucket's checksum; the tensor's digest part is the plain hasher
    fed every piece in order. With `box`, the part of that box of the tensor (a rank's
    slice): its bytes, and which box of which tensor they are."""
    h = xxhash.xxh3_128()
    h.update(name.encode())
    h.update(b"\0" + dtype.encode() + b"\0")
    h.update(repr(tuple(shape)).encode())
    if box is not None:
        h.update(b"\0#" + repr(tuple((int(a), int(b)) for a, b in box)).encode())
    if start is not None:
        h.update(b"\0@" + str(start).encode())
    return h


def checksum_of(parts: Iterable[bytes]) -> int:
    """A bucket's checksum from its tensors' parts, in the bucket's order."""
    return xxhash.xxh3_64_intdigest(b"".join(parts))


def bucket_hash(buf: Bytes, metas: Iterable[Ranged]) -> tuple[int, list[bytes], int]:
    """The checksum of a bucket and every tensor's part, in one pass over its bytes
    (a range past the buffer's end reads short, so the checksum does not match), and the
    bytes that pass fed the hash (counted as fed: benchmarks report it)."""
    mv = byte_view(buf).cast("B")
    parts = []
    hashed = 0
    for m in metas:
        h = part_hasher(m.name, m.dtype, tuple(m.shape), m.start, m.box)
        if m.nbytes:
            piece = mv[m.offset : m.offset + m.nbytes]
            h.update(piece)
            hashed += piece.nbytes
        parts.append(h.digest())
    return checksum_of(parts), parts, hashed


def bucket_checksum(buf: Bytes, metas: Iterable[Ranged]) -> int:
    return bucket_hash(buf, metas)[0]


DIGEST_MOD = 1 << 128

# The digest's scheme, recorded with every served digest (journal, spool): a digest made by
# another scheme is never compared with this one's (it would call every engine wrong).
DIGEST_SCHEME = "sum128"  # `combine`: the parts' sum modulo 2**128 (protocol v6)
LEGACY_DIGEST_SCHEME = "sorted128"  # xxh3-128 over the name-sorted parts (protocol v5 and before)
# What a journal row or spool manifest that records no scheme was made by: a daemon from
# before the scheme was recorded, counted as v5's (docs/PROTOCOL.md, "Digest scheme").
UNRECORDED_DIGEST_SCHEME = LEGACY_DIGEST_SCHEME


def combine(parts: dict[str, bytes] | Iterable[bytes]) -> str:
    """The weight digest over every tensor's part, whatever order they came in: the sum of
    the parts (each an xxh3-128 that covers its tensor's name) modulo 2**128, as 32 hex
    digits. A sum, so that the digests of disjoint sets of tensors add up to the digest of
    their union (`add_digests`): each source of a sharded push sends its own, and the
    daemon knows the version's digest without seeing a byte."""
    total = 0
    for p in parts.values() if isinstance(parts, dict) else parts:
        total += int.from_bytes(p, "big")
    return f"{total % DIGEST_MOD:032x}"


def add_digests(digests: Iterable[str]) -> str:
    """The digest of the union of disjoint sets of tensors, from each set's digest."""
    return f"{sum(int(d, 16) for d in digests) % DIGEST_MOD:032x}"
