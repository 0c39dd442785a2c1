"""A group stream's in-band framing: what travels on the group ahead of each bucket,
so that engines receive a whole sync from the trainer without the daemon in the loop.

Theory of operation (docs/PROTOCOL.md, the v3 stream's section): the daemon opens the
stream once per engine (`stream`); then the trainer broadcasts, per bucket, a fixed-size
header and a payload (the bucket's tensor metadata, msgpack, then its bytes), and at the
end a header of kind END that carries the bucket count, the byte count and the chain (a
checksum over the buckets' checksums, in order). Each engine verifies every bucket
itself and answers the daemon once, with `prepared`; the daemon commits (finalize once
per engine) only when every engine prepared exactly what the trainer finished with.

With keys (the group's store speaks CURVE), each bucket also carries a MAC: BLAKE3 keyed
with a per-sync key derived from the group's store token (which the daemon hands to the
members over CURVE), over the header and the payload, 16 bytes after the metadata; the
header's MAC flag says it is there. xxh3 catches accidents; the MAC catches a host that
writes into the group's connections (gloo's own are not authenticated).

Rules: pure and torch-free (the daemon and the simulated engines use it). A header is
refused with a typed BAD_MESSAGE when its magic, kind or sizes are wrong; the payload is
refused with CHECKSUM_MISMATCH when either checksum differs, and with UNAUTHORIZED when
a MAC is due and missing or wrong. Nothing here touches a socket or a group.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, cast

import blake3
import msgspec
import xxhash

from messages.errors import ErrorCode, MessageError
from messages.schema import MAX_TENSORS_PER_BUCKET, TensorMeta

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import Buffer

# The bytes a MAC covers: a buffer, or a CPU tensor's `.numpy()` array (a buffer too, but
# numpy's stubs say so only for Python 3.12 and later).
MacBytes: TypeAlias = "Buffer | np.ndarray[tuple[int, ...], np.dtype[np.generic]]"

MAGIC = b"WSS1"
BUCKET, END = 1, 2
PARTIAL = 1  # END's flags: the trainer pushes a subset of the tensors on purpose
MAC = 1  # a BUCKET's flags: a MAC_BYTES tag follows the metadata in the payload
MAC_BYTES = 16
# magic, kind, flags, seq, meta_len, data_len, checksum, meta_checksum
_HEADER = struct.Struct("<4sBBxxQQQQQ")
HEADER_BYTES = _HEADER.size
MAX_META_BYTES = 16 << 20  # the metadata of one bucket (MAX_TENSORS_PER_BUCKET entries fit)
MAX_DATA_BYTES = 1 << 40

_metas = msgspec.msgpack.Decoder(tuple[TensorMeta, ...])
_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True, slots=True)
class Header:
    """One frame's header. For BUCKET: `seq`, the payload's `meta_len` + `data_len` bytes
    and their checksums. For END: `seq` is the bucket count, `data_len` the bytes sent,
    `checksum` the chain and `meta_len` the flags (PARTIAL)."""

    kind: int
    seq: int
    meta_len: int
    data_len: int
    checksum: int
    meta_checksum: int = 0
    flags: int = 0

    @property
    def tag_len(self) -> int:
        return MAC_BYTES if self.kind == BUCKET and self.flags & MAC else 0

    @property
    def payload_len(self) -> int:
        return self.meta_len + self.data_len + self.tag_len if self.kind == BUCKET else 0

    @property
    def partial(self) -> bool:
        return self.kind == END and bool(self.meta_len & PARTIAL)

    def encode(self) -> bytes:
        return _HEADER.pack(
            MAGIC,
            self.kind,
            self.flags,
            self.seq,
            self.meta_len,
            self.data_len,
            self.checksum,
            self.meta_checksum,
        )


def bucket_header(seq: int, metas: bytes, data_len: int, checksum: int, *, mac: bool = False) -> Header:
    return Header(
        BUCKET, seq, len(metas), data_len, checksum, xxhash.xxh3_64_intdigest(metas), MAC if mac else 0
    )


def mac_key(token: str, sync_id: str) -> bytes:
    """This sync's MAC key: BLAKE3 keyed with the group's store token (32 bytes, hex)."""
    return blake3.blake3(b"weightsync stream mac\0" + sync_id.encode(), key=bytes.fromhex(token)).digest()


def _buffer(data: MacBytes) -> Buffer:
    """`data` as the buffer it is (numpy arrays included: see MacBytes)."""
    return cast("Buffer", data)


def bucket_mac(key: bytes, h: Header, data: MacBytes, metas: Buffer) -> bytes:
    """The tag over a bucket's header, bytes and metadata (buffers, no copy)."""
    m = blake3.blake3(key=key)
    m.update(h.encode())
    m.update(_buffer(data))
    m.update(metas)
    return m.digest(MAC_BYTES)


def load_mac(key: bytes, source: int, seq: int, data: MacBytes) -> bytes:
    """The tag of a per-bucket group load (its metadata travels over the control
    plane; only the broadcast bytes need the MAC): over (source, seq) and the bytes."""
    m = blake3.blake3(key=key)
    m.update(b"load\0" + source.to_bytes(4, "little") + seq.to_bytes(8, "little"))
    m.update(_buffer(data))
    return m.digest(MAC_BYTES)


def check_load_mac(key: bytes | None, source: int, seq: int, data: MacBytes, tag: bytes | None) -> None:
    """Raise UNAUTHORIZED unless a per-bucket group load carries the right tag."""
    if key is None:
        return
    if tag is None:
        raise MessageError(ErrorCode.UNAUTHORIZED, f"bucket seq {seq}: no MAC, and this group needs one")
    if not hmac.compare_digest(load_mac(key, source, seq, data), tag):
        raise MessageError(ErrorCode.UNAUTHORIZED, f"bucket seq {seq}: wrong MAC (forged or corrupted)")


def check_mac(key: bytes | None, h: Header, data: MacBytes, metas: Buffer, tag: Buffer) -> None:
    """Raise UNAUTHORIZED unless the bucket carries the right tag (`key` None: no MAC due;
    a tag that is there is then not checked: nothing to check it with)."""
    if key is None:
        return
    if not h.flags & MAC:
        raise MessageError(ErrorCode.UNAUTHORIZED, f"bucket seq {h.seq}: no MAC, and this group needs one")
    if not hmac.compare_digest(bucket_mac(key, h, data, metas), bytes(tag)):
        raise MessageError(ErrorCode.UNAUTHORIZED, f"bucket seq {h.seq}: wrong MAC (forged or corrupted)")


def end_header(buckets: int, nbytes: int, chain: int, *, partial: bool = False) -> Header:
    return Header(END, buckets, PARTIAL if partial else 0, nbytes, chain)


def decode_header(buf: bytes | memoryview) -> Header:
    if len(buf) != HEADER_BYTES:
        raise MessageError(ErrorCode.BAD_MESSAGE, f"stream header of {len(buf)} bytes, want {HEADER_BYTES}")
    magic, kind, flags, seq, meta_len, data_len, ck, meta_ck = _HEADER.unpack(buf)
    if magic != MAGIC or kind not in (BUCKET, END):
        raise MessageError(ErrorCode.BAD_MESSAGE, f"not a stream header (magic {magic!r}, kind {kind})")
    if kind == BUCKET and (meta_len > MAX_META_BYTES or data_len > MAX_DATA_BYTES):
        raise MessageError(
            ErrorCode.BAD_MESSAGE, f"stream bucket {seq}: {meta_len}+{data_len} bytes exceed the limits"
        )
    return Header(kind, seq, meta_len, data_len, ck, meta_ck, flags)


def encode_metas(metas: tuple[TensorMeta, ...]) -> bytes:
    return _encoder.encode(metas)


def decode_metas(h: Header, raw: bytes | memoryview) -> tuple[TensorMeta, ...]:
    """The bucket's tensor metadata, after its checksum and bounds are checked."""
    if xxhash.xxh3_64_intdigest(raw) != h.meta_checksum:
        raise MessageError(ErrorCode.CHECKSUM_MISMATCH, f"bucket seq {h.seq}: metadata arrived corrupted")
    try:
        metas = _metas.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise MessageError(ErrorCode.BAD_MESSAGE, f"bucket seq {h.seq}: metadata: {exc}") from None
    if len(metas) > MAX_TENSORS_PER_BUCKET:
        raise MessageError(ErrorCode.TOO_LARGE, f"bucket seq {h.seq}: {len(metas)} tensors")
    for t in metas:
        if t.offset + t.nbytes > h.data_len:
            raise MessageError(
                ErrorCode.BAD_MESSAGE, f"bucket seq {h.seq}: tensor {t.name!r} lies outside the bucket"
            )
    return metas


class Chain:
    """The checksum over a stream's bucket checksums, in seq order: what every engine and
    the trainer compute independently and the daemon compares (xxh3-64 of the u64 LE
    checksums)."""

    __slots__ = ("_h", "buckets", "nbytes")

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()
        self.buckets = 0
        self.nbytes = 0

    def add(self, checksum: int, nbytes: int) -> None:
        self._h.update(checksum.to_bytes(8, "little"))
        self.buckets += 1
        self.nbytes += nbytes

    @property
    def value(self) -> int:
        return self._h.intdigest()
