"""Same-host shared memory for bucket bytes: one writer, any number of readers.

Rules: segments are plain files in /dev/shm (POSIX shm on Linux), created, grown and
unlinked by their owner only; readers map them read-only by name and never unlink.
No `multiprocessing.resource_tracker` is involved (on Python 3.11 it would unlink a
segment when any reader process exits). Descriptors that cross processes are plain
strings and ints.
"""

from __future__ import annotations

import mmap
import os
import uuid
import warnings
from pathlib import Path
from typing import Any

SHM_DIR = Path("/dev/shm")


PREFIX = "weightsync"


def segment_name(kind: str) -> str:
    """`weightsync.KIND.PID.RANDOM`: the pid lets `sweep_stale` find a dead owner's segments."""
    return f"{PREFIX}.{kind}.{os.getpid()}.{uuid.uuid4().hex[:12]}"


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Unlink segments whose owner process is gone (a trainer or engine that crashed)."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}.*.*.*"):
        try:
            pid = int(path.name.split(".")[2])
        except (IndexError, ValueError):
            continue
        if not _pid_alive(pid):
            try:
                path.unlink()
                removed.append(path.name)
            except FileNotFoundError:
                pass
    return removed


def list_segments() -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"{PREFIX}.*"))


class Segment:
    """A writable segment owned by this process (grows on demand)."""

    def __init__(self, size: int, kind: str = "bucket") -> None:
        self.name = segment_name(kind)
        self.path = SHM_DIR / self.name
        self.size = 0
        self._fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._mm: mmap.mmap | None = None
        self.resize(max(size, mmap.PAGESIZE))

    def resize(self, size: int) -> None:
        if size <= self.size:
            return
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view of the old mapping is alive; it goes with the view
                pass
        os.ftruncate(self._fd, size)
        self._mm = mmap.mmap(self._fd, size)
        self.size = size

    def write(self, data: Any, offset: int = 0) -> int:
        """Copy `data` (buffer protocol) at `offset`; returns its length."""
        mv = memoryview(data).cast("B")
        n = mv.nbytes
        self.resize(offset + n)
        self._mm[offset:offset + n] = mv  # type: ignore[index]
        return n

    def view(self, offset: int = 0, size: int | None = None) -> memoryview:
        size = self.size - offset if size is None else size
        return memoryview(self._mm)[offset:offset + size]  # type: ignore[arg-type]

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass
            self._mm = None
        os.close(self._fd)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Reader:
    """Read-only mappings of segments by name, cached (a segment grows: remap)."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}

    def view(self, name: str, offset: int, size: int) -> memoryview:
        if "/" in name or name.startswith("."):
            raise ValueError(f"bad shared-memory segment name {name!r}")
        cached = self._maps.get(name)
        if cached is None or cached[0] < offset + size:
            if cached is not None:
                try:
                    cached[1].close()
                except BufferError:  # a view of the old mapping is alive; GC closes it
                    pass
            fd = os.open(SHM_DIR / name, os.O_RDONLY)
            try:
                total = os.fstat(fd).st_size
                if offset + size > total:
                    raise ValueError(f"segment {name} has {total} bytes, need {offset + size}")
                mm = mmap.mmap(fd, total, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self._maps[name] = cached = (total, mm)
        return memoryview(cached[1])[offset:offset + size]

    def close(self) -> None:
        for _, mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # a view is still alive; the mapping goes with the process
                pass
        self._maps.clear()


def frombuffer(mv: memoryview) -> Any:
    """uint8 tensor over a (possibly read-only) buffer, without copying."""
    import torch  # here, not at the top: the daemon reads segments without torch

    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only: we only ever read
        return torch.frombuffer(mv, dtype=torch.uint8)
