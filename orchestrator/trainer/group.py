"""The trainer's side of a group transport: rank 0 of the group.

Rules: the trainer hosts the group's rendezvous store (messages/rendezvous.py: bound to its
group host only, token-gated, CURVE with keys) for as long as its client lives (one store,
one session id; each group the daemon plans gets its own key prefix in it). The daemon
plans the group at `begin` and says so in its reply; the trainer joins lazily, after it
has announced the first bucket (the engines join when the daemon forwards that bucket,
so joining earlier would wait on them). A group that failed once is closed and never
reused; the daemon plans a new one for the next sync.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import torch

from messages import schema, stream
from messages.distgroup import (
    Group,
    GroupError,
    GroupSpec,
    Started,
    available_backends,
    local_host_for,
)
from messages.liblog import get_logger
from messages.rendezvous import StoreClient, StoreServer

log = get_logger("trainer")


def _daemon_host(addr: str) -> str:
    """The host part of a tcp:// address ("" for ipc:// and inproc://)."""
    if not addr.startswith("tcp://"):
        return ""
    host = addr[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return "127.0.0.1" if host in ("*", "localhost", "") else host


class TrainerGroup:
    """Rank 0: the store, the current group, and the broadcast of each bucket."""

    def __init__(self, daemon_addr: str, host: str = "", timeout: float = 300.0, curve: bool = False) -> None:
        self.host = host or local_host_for(_daemon_host(daemon_addr) or "127.0.0.1")
        self.session = uuid.uuid4().hex[:16]
        self.timeout = timeout
        self.curve = curve  # the deployment uses keys: the store speaks CURVE
        self._server: StoreServer | None = None
        self._store: StoreClient | None = None
        self.group: Group | None = None
        self.planned: dict[str, Any] | None = None
        self._pending: Started | None = None  # the broadcast in flight (Group.start)
        self.pending_seq: int | None = None  # the bucket of that broadcast

    def offer(self) -> schema.CollectiveOffer:
        if self._server is None:
            self._server = s = StoreServer(self.host, curve=self.curve)
            self._store = StoreClient(
                s.host, s.port, s.token, s.public_key, timeout=self.timeout, source=self.host
            )
            log.info(
                "collective_store_started", host=s.host, port=s.port, session=self.session, curve=self.curve
            )
        s = self._server
        return schema.CollectiveOffer(
            host=self.host,
            port=s.port,
            session=self.session,
            backends=available_backends(),
            stream=True,
            token=s.token,
            store_key=s.public_key,
        )

    def mac_key(self, sync_id: str) -> bytes | None:
        """This sync's bucket MAC key when the deployment uses keys (else None)."""
        if not self.curve or self._server is None:
            return None
        return stream.mac_key(self._server.token, sync_id)

    def plan(self, view: dict[str, Any]) -> None:
        """The daemon's group for this sync (its begin reply's group plan)."""
        if self.group is not None and (self.group.spec.id != view["group"] or self.group.broken):
            self.group.close()
            self.group = None
        self.planned = view

    def start(self, data: torch.Tensor, seq: int, give_up: Callable[[], str | None] | None = None) -> None:
        """Begin sending bucket `seq`'s bytes to every engine (joining the group first if
        it is new: `give_up` ends that wait, e.g. when the daemon says the sync failed);
        the previous broadcast must have been waited for."""
        v = self.planned
        if v is None:
            raise GroupError("no group planned for this sync")
        if self.group is None:
            spec = GroupSpec(
                id=v["group"],
                host=self.host,
                port=self._server.port if self._server else 0,
                rank=0,
                world_size=v["world_size"],
                backend=v["backend"],
                timeout=float(v["timeout_s"]),
                bind=self.host,
            )
            self.group = Group(spec, store=self._store, give_up=give_up)
        if self.group.device.type != "cpu":
            data = data.to(self.group.device, non_blocking=False)
        self._pending = self.group.start(data)
        self.pending_seq = seq

    def wait(self, give_up: Callable[[], str | None]) -> None:
        """Wait for the broadcast in flight, if any."""
        pending, self._pending = self._pending, None
        if pending is not None and self.group is not None:
            self.group.wait(pending, give_up=give_up)

    def fail(self) -> None:
        """A sync on this group failed: close it so blocked engines return at once."""
        self._pending, self.pending_seq = None, None
        if self.group is not None:
            self.group.close()
            self.group = None

    def close(self) -> None:
        self.fail()
        if self._store is not None:
            self._store.close()
        if self._server is not None:
            self._server.close()
        self._store = self._server = None
