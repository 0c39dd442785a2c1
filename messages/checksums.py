"""The bucket checksum (xxh3-64 of the bucket's bytes) and the weight digest's pieces (a
tensor's part: xxh3-128 of its name, dtype, shape and bytes; the digest: over the sorted
parts). Torch-free: the daemon and the simulated engines use them."""

from __future__ import annotations

from typing import Any

import xxhash


def checksum(buf: Any) -> int:
    """xxh3-64 of a buffer (bytes, memoryview, zmq.Frame buffer, uint8 tensor)."""
    if hasattr(buf, "numpy"):  # a torch tensor, without importing torch here
        buf = buf.numpy()
    return xxhash.xxh3_64_intdigest(buf)


def part_hasher(name: str, dtype: str, shape: tuple[int, ...]) -> Any:
    """A streaming hash of tensor `name`'s digest part: feed it the bytes, then `.digest()`."""
    h = xxhash.xxh3_128()
    h.update(name.encode())
    h.update(b"\0" + dtype.encode() + b"\0")
    h.update(repr(tuple(shape)).encode())
    return h


def combine(parts: dict[str, bytes]) -> str:
    """The weight digest over every tensor's part, whatever order they came in."""
    h = xxhash.xxh3_128()
    for name in sorted(parts):
        h.update(name.encode() + b"\0")
        h.update(parts[name])
    return h.hexdigest()
