"""Segments: named files of shared memory on this host, one writer, any number of readers.
The primitives under the same-host reference transport (`messages.shm`, its slots) and
under a vLLM engine's staging for workers in other processes.

Rules:
- Segments are plain files in one directory (/dev/shm by default; `configure()` sets
  another, e.g. a private tmpfs), created, reserved, grown and unlinked by their owner
  only. Their names are `weightsync.KIND.PID.HEX12`, made here.
- A name that arrives from a peer is opened by `open_segment` alone, the one function
  the daemon and every engine use: the name must match SEGMENT_PATTERN (never a path),
  the file is opened O_NOFOLLOW | O_NONBLOCK (a symlink or a FIFO cannot redirect or
  block us), and `fstat` must show a regular file owned by our uid holding the bytes
  asked for. Anything else is `BAD_MESSAGE`.
- Space is reserved with posix_fallocate before a segment is used, so a full tmpfs is an
  `ShmFull` error up front, never a SIGBUS while writing into the mapping.
- No `multiprocessing.resource_tracker` (on Python 3.11 it would unlink a segment when
  any reader process exits). Descriptors that cross processes are plain strings and ints.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from messages.errors import ErrorCode, MessageError

PREFIX = "weightsync"
SEGMENT_PATTERN = re.compile(r"^weightsync\.[a-z]+\.[0-9]+\.[0-9a-f]{12}\Z")
if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer

_DIR = Path("/dev/shm")


class ShmFull(OSError):
    """The shared-memory directory has no room for a segment (ENOSPC on reservation)."""


def configure(directory: str | Path | None) -> None:
    """Set this process's shared-memory directory (a setting, from config)."""
    global _DIR
    if directory:
        _DIR = Path(directory)


def segment_name(kind: str) -> str:
    """`weightsync.KIND.PID.RANDOM`: the pid lets `sweep_stale` find a dead owner's segments."""
    return f"{PREFIX}.{kind}.{os.getpid()}.{uuid.uuid4().hex[:12]}"


def available() -> bool:
    return _DIR.is_dir() and os.access(_DIR, os.W_OK)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one we may not signal counts as alive)."""
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
    for path in _DIR.glob(f"{PREFIX}.*.*.*"):
        if not SEGMENT_PATTERN.match(path.name):
            continue
        if not pid_alive(int(path.name.split(".")[2])):
            try:
                path.unlink()
                removed.append(path.name)
            except FileNotFoundError:
                pass
    return removed


def list_segments() -> list[str]:
    return sorted(p.name for p in _DIR.glob(f"{PREFIX}.*"))


def _refuse(name: str, why: str) -> MessageError:
    return MessageError(ErrorCode.BAD_MESSAGE, f"shm segment {name[:96]!r}: {why}")


def open_segment(name: str, need: int) -> tuple[int, int]:
    """Open a peer-named segment read-only; (fd, size). The one check of a peer's name."""
    if not isinstance(name, str) or not SEGMENT_PATTERN.match(name):
        raise _refuse(name, "not a weightsync segment name")
    try:
        fd = os.open(_DIR / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _refuse(name, "does not exist") from None
    except OSError as exc:  # ELOOP: a symlink; EACCES, ENXIO: not ours to read
        raise _refuse(name, f"cannot be opened ({errno.errorcode.get(exc.errno or 0, exc.errno)})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(name, "is not a regular file")
        if st.st_uid != os.geteuid():
            raise _refuse(name, f"is owned by uid {st.st_uid}, not by us")
        if st.st_size == 0 or st.st_size < need:
            raise _refuse(name, f"has {st.st_size} bytes, need {need}")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _unmap(mm: mmap.mmap) -> None:
    """Close a mapping; while a view of it is alive it stays, and goes with that view."""
    try:
        mm.close()
    except BufferError:
        pass


class Segment:
    """A writable segment owned by this process; space is reserved before it is used."""

    def __init__(self, size: int, kind: str = "bucket") -> None:
        self.name = segment_name(kind)
        self.path = _DIR / self.name
        self.size = 0
        self._fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        self._mm: mmap.mmap | None = None
        try:
            self.resize(max(size, mmap.PAGESIZE))
        except BaseException:
            self.close()
            raise

    def resize(self, size: int) -> None:
        if size <= self.size:
            return
        try:
            # Reserve the pages now: ftruncate alone leaves a sparse file, and writing into
            # its mapping on a full tmpfs is a SIGBUS.
            os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise ShmFull(
                    exc.errno,
                    f"{_DIR} has no room for a {size}-byte shared-memory segment ({os.strerror(exc.errno)})",
                ) from None
            raise
        if self._mm is not None:
            _unmap(self._mm)
        self._mm = mmap.mmap(self._fd, size)
        self.size = size

    def write(self, data: Buffer, offset: int = 0) -> int:
        """Copy `data` (buffer protocol) at `offset`; returns its length."""
        mv = memoryview(data).cast("B")
        n = mv.nbytes
        self.resize(offset + n)
        self._mm[offset : offset + n] = mv  # type: ignore[index]
        return n

    def view(self, offset: int = 0, size: int | None = None) -> memoryview:
        size = self.size - offset if size is None else size
        return memoryview(self._mm)[offset : offset + size]  # type: ignore[arg-type]

    def close(self) -> None:
        if self._mm is not None:
            _unmap(self._mm)
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Reader:
    """Read-only mappings of peer-named segments, cached (a segment grows: remap)."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}

    def view(self, name: str, offset: int, size: int) -> memoryview:
        cached = self._maps.get(name)
        if cached is None or cached[0] < offset + size:
            if cached is not None:
                _unmap(cached[1])
            fd, total = open_segment(name, offset + size)
            try:
                # MAP_POPULATE: the page tables are filled in one call, not one fault per page
                mm = mmap.mmap(
                    fd, total, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ
                )
            finally:
                os.close(fd)
            self._maps[name] = cached = (total, mm)
        return memoryview(cached[1])[offset : offset + size]

    def check(self, name: str, offset: int, size: int) -> None:
        """The checks `view` makes of a peer's segment (name, owner, type, size), without
        mapping it: for a process that only vouches for a slot it never reads."""
        cached = self._maps.get(name)
        if cached is not None and cached[0] >= offset + size:
            return
        fd, _ = open_segment(name, offset + size)
        os.close(fd)

    def prune(self) -> None:
        """Drop the mappings of segments that are gone (their owner unlinked them): a
        mapping would keep their memory. The others stay mapped for the next sync (a
        trainer reuses its slots), so their pages are not faulted in again."""
        for name in [n for n in self._maps if not (_DIR / n).exists()]:
            _unmap(self._maps.pop(name)[1])

    def close(self) -> None:
        for _, mm in self._maps.values():
            _unmap(mm)
        self._maps.clear()


def frombuffer(mv: memoryview) -> torch.Tensor:
    """uint8 tensor over a (possibly read-only) buffer, without copying."""
    import torch  # noqa: PLC0415 (the daemon reads segments without torch)

    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only: we only ever read
        return torch.frombuffer(mv, dtype=torch.uint8)


VIA = "shm"  # the reference transport that reads segments (`schema.Ref.via`)
