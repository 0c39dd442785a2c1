"""One daemon per state: exclusive locks on the journal and the spool.

Rules: a lock is an `flock` on a file beside what it guards (`STATE_DB.lock`,
`SPOOL/.lock`), held for the daemon's life and released by the kernel when the process
dies (no stale lock after a SIGKILL). The holder writes its pid and host into the file,
so a refused daemon can name it.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path


class StateInUse(Exception):
    """Another live daemon holds this state (startup failure, exit code 3)."""


class StateLock:
    def __init__(self, path: str | Path, what: str) -> None:
        self.path = Path(path)
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> StateLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateInUse(
                f"{self.what} is in use by another daemon ({holder}); stop it, "
                f"or give this one its own --state-db and --spool"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def lock_state(state_db: str, spool: str) -> list[StateLock]:
    """Lock the journal (and the spool, when there is one); raise StateInUse if held."""
    locks: list[StateLock] = []
    try:
        if state_db != ":memory:":
            locks.append(StateLock(f"{state_db}.lock", f"state db {state_db}").acquire())
        if spool:
            locks.append(StateLock(Path(spool) / ".lock", f"spool {spool}").acquire())
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks
