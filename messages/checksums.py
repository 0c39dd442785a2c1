"""The bucket checksum: xxh3-64 of the bucket's bytes. Torch-free (the daemon uses it)."""

from __future__ import annotations

from typing import Any

import xxhash


def checksum(buf: Any) -> int:
    """xxh3-64 of a buffer (bytes, memoryview, zmq.Frame buffer, uint8 tensor)."""
    if hasattr(buf, "numpy"):  # a torch tensor, without importing torch here
        buf = buf.numpy()
    return xxhash.xxh3_64_intdigest(buf)
