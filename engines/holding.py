"""A holding engine: a weightsync engine that keeps each version in host tensors and hands a
version to a reader only once the daemon made it its served version (for frameworks that
load weights into their own inference server, e.g. verl's checkpoint engines:
`orchestrator.trainer.verl`).

Rules:
- It is a sink engine (preallocated tensors, each bucket validated and copied in place,
  the digest taken behind the copy, finalize counted) built from the checkpoint's spec.
- The daemon's `served` notice releases a version: the daemon sends it once the sync is
  READY and that READY is written to its journal (every participant finalized with the
  same digest, every labelling engine answered `commit`). It is acted on only when the
  engine holds exactly that version and digest (its last finalize). A sync that fails,
  in its commit phase too, is never served: a reader waiting for its version, or coming
  later, is refused with ABORTED, and nothing of it is handed out.
- From a sync's `begin` on, the version before it is no longer offered (its buffers are
  being written), until the next `served`; an abort withdraws what was loaded. A rollback
  or a catch-up is a sync like any other: its version is offered again once served.
- While a reader iterates, the next sync's `begin` waits for it (up to `timeout`; past it
  the begin fails, the sync fails cleanly and the reader's tensors were never torn).
- `HoldingReceiver` runs the engine's `Worker` in a thread of the calling process. Its
  default engine id (`holder_id`) is this host, a name and the process's rank: the same
  for a holder restarted in the same place, so the daemon keeps one record of it.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engines.sink import SinkEngine
from engines.worker import Worker
from messages.checkpoint import checkpoint_spec
from messages.errors import ErrorCode, make_error
from messages.schema import MAX_ID_LEN, ParamSpec

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from engines.worker import WorkerOptions


class HoldingEngine(SinkEngine):
    backend = "holding"

    def __init__(self, model_dir: str | Path, spec: Sequence[ParamSpec], timeout: float = 600.0) -> None:
        super().__init__(model_dir, spec)
        self.timeout = timeout
        self.served: int | None = None  # the version readers may have: the daemon's served one
        # the version of the last sync aborted here (its readers are refused), until a
        # sync of that version or a later one begins
        self.aborted: int | None = None
        self._loading: int | None = None  # the version the running sync writes
        self._holds: tuple[int, str] | None = None  # what the last finalize left: version, digest
        self._cond = threading.Condition()
        self._readers = 0

    def begin(self, sync_id: str = "", version: int = 0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._readers == 0, self.timeout):
                raise make_error(
                    ErrorCode.TIMEOUT, f"a reader held version {self.served} past {self.timeout}s"
                )
            # the buffers change from here on: the version before is no longer held whole
            self.served, self._holds, self._loading = None, None, version
            if self.aborted is not None and version >= self.aborted:
                self.aborted = None
            super().begin(sync_id, version)

    def finalize(self, sync_id: str = "") -> str:
        digest = super().finalize(sync_id)
        with self._cond:
            self._holds = (self._loading, digest) if self._loading is not None else None
        return digest

    def serve(self, version: int, digest: str) -> bool:
        """The daemon's `served`: `version` with `digest` is durably its served version."""
        with self._cond:
            if self._holds != (version, digest):
                return False  # not what this engine holds (a sync began since, or it failed)
            self.served = version
            self._cond.notify_all()
            return True

    def abort(self) -> None:
        """The daemon aborted the running sync: nothing it loaded is ever offered."""
        super().abort()
        with self._cond:
            self.served, self._holds = None, None
            if self._loading is not None:
                self.aborted = self._loading
            self._cond.notify_all()

    @contextmanager
    def hold(self, version: int | None, after: int | None, timeout: float) -> Iterator[int]:
        """Wait until `version` (or, when None, any version newer than `after`) is the
        served one, and keep the next sync from starting while the caller reads. A wait
        for a version whose sync was aborted ends at once with ABORTED."""

        def failed() -> bool:
            return version is not None and self.aborted == version and self.served != version

        def ready() -> bool:
            c = self.served
            if c is None:
                return False
            return c >= version if version is not None else (after is None or c > after)

        with self._cond:
            if not self._cond.wait_for(lambda: failed() or ready(), timeout):
                want = f"version {version}" if version is not None else f"a version after {after}"
                raise make_error(
                    ErrorCode.TIMEOUT,
                    f"{want} was not served within {timeout}s (served now: {self.served})",
                )
            if failed():
                raise make_error(
                    ErrorCode.ABORTED,
                    f"the sync of version {version} failed; it is not handed out (served now: {self.served})",
                )
            if version is not None and self.served != version:
                raise make_error(ErrorCode.STALE_VERSION, f"version {self.served} served, not {version}")
            self._readers += 1
            held = self.served
        try:
            if held is None:  # ready() made sure of it; for the type checker
                raise make_error(ErrorCode.INTERNAL, "no served version")
            yield held
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()


def holder_id(name: str = "holding", rank: int | None = None) -> str:
    """A holding engine's default id: `{host}-{name}-{rank}`, the rank the process's
    torch.distributed rank when a group is up (else 0). Stable across restarts of the same
    holder (a restart takes its old record over instead of leaving one behind), distinct
    between the holders of one host as long as their ranks or names differ."""
    if rank is None:
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    tail = f"-{name}-{rank}"
    return _id_part(socket.gethostname(), MAX_ID_LEN - len(tail)) + tail


def _id_part(text: str, limit: int) -> str:
    """`text` made a valid start of an engine id (schema.Id): characters outside
    [A-Za-z0-9._:@+-] become '-', a leading dot or dash goes, at most `limit` long; "host"
    when nothing is left (a host name may be empty, long, or hold spaces)."""
    part = re.sub(r"[^A-Za-z0-9._:@+-]", "-", text).lstrip(".-")[: max(limit, 1)]
    return part or "host"


class HoldingReceiver:
    """A holding engine registered with the daemon at `connect`, its worker on a thread;
    `engine_id` defaults to `holder_id(name, rank)`."""

    def __init__(
        self,
        model_dir: str | Path,
        connect: str,
        engine_id: str | None = None,
        *,
        name: str = "holding",
        rank: int | None = None,
        timeout: float = 600.0,
        **worker_options: Unpack[WorkerOptions],
    ) -> None:
        spec = list(checkpoint_spec(model_dir).values())
        self.engine = HoldingEngine(model_dir, spec, timeout=timeout)
        self.timeout = timeout
        self.engine_id = engine_id or holder_id(name, rank)
        self.worker = Worker(self.engine, connect, self.engine_id, **worker_options)
        self.thread = threading.Thread(
            target=self.worker.run, name=f"weightsync-{self.engine_id}", daemon=True
        )
        self.thread.start()
        self.last_read: int | None = None

    def wait_registered(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.worker.registered:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise make_error(ErrorCode.TIMEOUT, f"{self.engine_id} not registered within {timeout}s")
            time.sleep(0.05)

    def read(self, version: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields the tensors of `version` (None: the next version served after the last
        one read) once the daemon made it its served version; the next sync waits until
        this ends. A version whose sync failed raises ABORTED."""
        with self.engine.hold(version, self.last_read, self.timeout) as held:
            yield from self.engine.params.items()
            self.last_read = held

    def close(self) -> None:
        self.worker.request_stop()
        self.thread.join(30)
