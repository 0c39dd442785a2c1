"""The group data plane: one torch.distributed group per membership, built beside
(never as) the default group, so it lives next to vLLM's own groups in the same process.

Rules:
- Rank 0 is the trainer. It hosts the group's rendezvous store (`messages.rendezvous`:
  bound to the trainer's group host only, token-gated, CURVE with keys) for as long
  as its client lives; every group gets its own key prefix in that store
  (`weightsync/<group id>/`), so a rebuilt group never meets the keys of the last one.
- The process group object is created directly (`ProcessGroupGloo` / `ProcessGroupNCCL`
  on a `PrefixStore`), never through `init_process_group`, and each member binds its gloo
  device to the address it was given (no guessing of interfaces on multi-homed hosts).
- Every call on the group has a deadline (the group's timeout). `broadcast` polls while it
  waits, so its caller can give up early when the control plane says the sync is over;
  giving up shuts the group down, which releases the peers blocked in the same call.
- A group that failed once is never reused: `broken` is set and the owner builds anew.
- On gloo with more than two members a broadcast is relayed down the chain of ranks
  (`messages.relay`: gloo's own broadcast is a tree whose root sends one copy per
  child); with two members, and on NCCL, it is the backend's own broadcast.
- torch is imported here, not in `messages/__init__`: the daemon never imports this
  module, so it stays out of the byte path and light.
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from messages.bounded import LRU
from messages.errors import ErrorCode
from messages.liblog import get_logger
from messages.relay import Relayer, relays
from messages.rendezvous import StoreClient
from messages.schema import MAX_COLLECTIVE_SOURCES

log = get_logger("group")

# A rendezvous store: ours (`messages.rendezvous.StoreClient`) or any other of torch's.
Store = dist.Store
Backend = Literal["gloo", "nccl"]


class Pending(Protocol):
    """A broadcast in progress: the backend's work, or a relay's (`messages.relay`)."""

    def is_completed(self) -> bool: ...

    def wait(self, timeout: datetime.timedelta = ...) -> bool: ...


# A broadcast begun (`Group.start`): its work and the monotonic deadline it must meet.
Started = tuple[Pending, float]

PREFIX = "weightsync"
ROOT_KEY = "root"  # set by rank 0 as it joins a group


# What a failure caused by another member says (a closed connection, not a deadline): the
# applier reports it as `failed.peer`, also when it crossed a process boundary as text
# (vLLM's workers), and the daemon then looks for the member that failed first.
PEER_FAILED = "another member of the group failed or left"


class GroupError(RuntimeError):
    """A call on the group failed or passed its deadline (a member died, hung or left)."""

    def __init__(self, message: str, *, timed_out: bool = False, peer: bool = False) -> None:
        super().__init__(f"{message} ({PEER_FAILED})" if peer else message)
        self.timed_out = timed_out
        self.peer = peer

    @property
    def code(self) -> ErrorCode:
        """What it is on the wire: TIMEOUT past a deadline, else ENGINE_FAILED (a member
        died or left): one rule for the engines' receive and the trainer's send."""
        return ErrorCode.TIMEOUT if self.timed_out else ErrorCode.ENGINE_FAILED


def local_host_for(remote: str) -> str:
    """The address of the interface this host uses to reach `remote` (no packet is sent:
    a UDP connect only asks the kernel for its route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((remote, 9))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def available_backends() -> tuple[Backend, ...]:
    """What this process can join: gloo always; NCCL when a CUDA device is present."""
    out: list[Backend] = ["gloo"]
    if torch.cuda.is_available() and dist.is_nccl_available():
        out.append("nccl")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """Everything a member needs to join: which group, where its store is, who it is."""

    id: str
    host: str  # the store's host (the trainer's)
    port: int
    rank: int
    world_size: int
    backend: str  # "gloo" | "nccl"
    timeout: float
    bind: str = ""  # this member's own address for gloo ("" = the route to the store)
    token: str = field(default="", repr=False)  # admits this member to the store
    store_key: str = ""  # the store's CURVE public key ("" without keys)


class Group:
    """One member's handle on one process group; `broadcast` is the only data call."""

    def __init__(
        self, spec: GroupSpec, store: Store | None = None, give_up: Callable[[], str | None] | None = None
    ) -> None:
        self.spec = spec
        self.broken = False
        self._work: Pending | None = None  # the last broadcast started
        self._relayer: Relayer | None = None
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if spec.backend == "nccl"
            else torch.device("cpu")
        )
        td = datetime.timedelta(seconds=spec.timeout)
        t0 = time.perf_counter()
        own: StoreClient | None = None  # the store's client when this member opens it (and closes it)
        if store is None:
            store = own = StoreClient(
                spec.host, spec.port, spec.token, spec.store_key, timeout=spec.timeout, source=spec.bind
            )
        base = store
        try:
            prefixed = dist.PrefixStore(f"{PREFIX}/{spec.id}/", base)
            if spec.rank == 0:
                prefixed.set(ROOT_KEY, "1")  # members that wait for the root may join now
            elif give_up is not None:
                _await_root(spec, prefixed, give_up)
            # the backend's rendezvous waits through our store: left when `give_up` says so
            # (a member that died before joining would otherwise hold the others to the deadline)
            joining = (
                base.interruptible(give_up) if isinstance(base, StoreClient) else contextlib.nullcontext()
            )
            with joining:
                self.pg = self._make_pg(prefixed, td)
        except GroupError:
            if own is not None:
                own.close()
            raise
        except Exception as exc:  # rendezvous failed: a member never came, or the store is gone
            if own is not None:
                own.close()
            raise GroupError(
                f"group {spec.id}: rank {spec.rank} of {spec.world_size} could not "
                f"join ({type(exc).__name__}: {_short(exc)})",
                timed_out=_timed_out(exc),
            ) from None
        if relays(spec.backend, spec.world_size):
            self._relayer = Relayer(self.pg, spec.rank, spec.world_size, spec.id)
        self._store = base  # keep the client connection for the group's lifetime
        self._own_store = own
        log.info(
            "group_joined",
            group=spec.id,
            rank=spec.rank,
            world_size=spec.world_size,
            backend=spec.backend,
            seconds=round(time.perf_counter() - t0, 3),
        )

    def _make_pg(self, store: Store, td: datetime.timedelta) -> Any:
        s = self.spec
        if s.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            return dist.ProcessGroupNCCL(store, s.rank, s.world_size, opts)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = td
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=s.bind or local_host_for(s.host))]
        return dist.ProcessGroupGloo(store, s.rank, s.world_size, opts)

    def broadcast(
        self, tensor: torch.Tensor, *, give_up: Callable[[], str | None] | None = None, poll: float = 0.002
    ) -> None:
        """Broadcast `tensor` from rank 0 (in place on the others). Raises GroupError
        when a member fails, after the group's timeout, or as soon as `give_up()` returns a
        reason; in each case the group is shut down and marked broken."""
        self.wait(self.start(tensor), give_up=give_up, poll=poll)

    def start(self, tensor: torch.Tensor) -> Started:
        """Begin a broadcast and return at once (gloo/NCCL progress it on their own
        threads): the caller may pack the next bucket meanwhile, then `wait`."""
        if self.broken:
            raise GroupError(f"group {self.spec.id} is broken; build a new one")
        deadline = time.monotonic() + self.spec.timeout
        try:
            if self._relayer is not None:
                work = self._work = self._relayer.start(tensor, deadline)
                return (work, deadline)
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            work = self.pg.broadcast([tensor], opts)
            self._work = work
            return (work, deadline)
        except Exception as exc:
            self.close()
            raise GroupError(f"broadcast in group {self.spec.id} failed: {_short(exc)}", peer=True) from None

    def wait(
        self, started: Started, *, give_up: Callable[[], str | None] | None = None, poll: float = 0.002
    ) -> None:
        work, deadline = started
        try:
            if give_up is None:
                work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
                return
            _until(
                work.is_completed,
                give_up,
                deadline,
                poll,
                lambda reason: f"broadcast abandoned: {reason}",
                f"broadcast passed its {self.spec.timeout}s deadline",
            )
            work.wait()  # raises the member's failure, if that is how it completed
        except GroupError:
            self.close()
            raise
        except Exception as exc:
            self.close()
            late = _timed_out(exc)
            raise GroupError(
                f"broadcast in group {self.spec.id} failed: {_short(exc)}", timed_out=late, peer=not late
            ) from None

    def close(self) -> None:
        """Shut the group down (peers blocked in a call with us get an error at once)."""
        if self.broken:
            return
        self.broken = True
        work = self._work
        if self._relayer is not None:  # idle: its thread ends now; else when the relay fails
            self._relayer.stop(wait=1.0 if work is None or work.is_completed() else 0.0)
        try:
            self.pg.shutdown()
        except Exception as exc:  # already torn down by a failure: nothing left to release
            log.debug("group_shutdown_error", group=self.spec.id, error=_short(exc))
        # A process group's destructor joins its worker thread, which may be inside a
        # broadcast a dead or stalled peer never completes (until the group's timeout):
        # then the last reference goes to the reaper thread, never to the caller's.
        work, self._work = self._work, None
        pending = work is not None and not work.is_completed()
        if pending:
            _bury(self.pg)
        self.pg = None
        if self._own_store is not None:
            self._own_store.close()
        log.info("group_closed", group=self.spec.id, rank=self.spec.rank)


_graves: queue.SimpleQueue[object] = queue.SimpleQueue()
_reaper: threading.Thread | None = None
_reaper_lock = threading.Lock()


def _reap() -> None:
    while True:
        pg = _graves.get()
        del pg  # may block until the group's timeout; only this thread waits


def _bury(pg: object) -> None:
    global _reaper
    with _reaper_lock:
        if _reaper is None:
            _reaper = threading.Thread(target=_reap, name="group-reaper", daemon=True)
            _reaper.start()
    _graves.put(pg)


def _await_root(spec: GroupSpec, store: Store, give_up: Callable[[], str | None]) -> None:
    """Wait, interruptibly, until rank 0 (the trainer) starts joining: the backend's own
    rendezvous cannot be left early, and a sync given up before its trainer broadcast
    anything must not hold its members there until the group's deadline."""
    _until(
        lambda: bool(store.check([ROOT_KEY])),
        give_up,
        time.monotonic() + spec.timeout,
        0.02,
        lambda reason: f"group {spec.id}: {reason} (before the trainer joined)",
        f"group {spec.id}: the trainer did not join within {spec.timeout}s",
    )


def _until(
    done: Callable[[], bool],
    give_up: Callable[[], str | None],
    deadline: float,
    poll: float,
    abandoned: Callable[[str], str],
    late: str,
) -> None:
    """Poll `done` until it holds; GroupError(`abandoned(reason)`) as soon as
    `give_up()` says why, GroupError(`late`, timed_out) past `deadline`."""
    while not done():
        reason = give_up()
        if reason is not None:
            raise GroupError(abandoned(reason))
        if time.monotonic() > deadline:
            raise GroupError(late, timed_out=True)
        time.sleep(poll)


def _timed_out(exc: BaseException) -> bool:
    """torch.distributed reports a passed deadline only in its message."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:300]


# Groups an engine keeps open: one per source of a sharded push, which has at most this
# many; the least recently used goes first, never one the running sync used.
MAX_GROUPS = MAX_COLLECTIVE_SOURCES


# A receive posted (`Member.post`): the buffer's view and the broadcast filling it.
Posted = tuple[torch.Tensor, tuple[Group, Started]]


class Member:
    """An engine's (or a vLLM worker's) side: joins the group a `load` names, reuses it
    while the id stays the same, and receives each bucket into one of `slots` reusable
    buffers (a caller that receives ahead of its use takes turns through them).

    One group per trainer store: a sharded push's sources each broadcast from a group of
    their own, so the engine keeps one open per source; a new group from the same store
    replaces (closes) that store's old one. At most MAX_GROUPS stay open: past it the
    group used least recently closes (a store of a trainer that went away), never one
    that the running sync (`sync`, the sync_id of the bucket being received) has used."""

    def __init__(self, bind: str = "", rank_offset: int = 0, slots: int = 1) -> None:
        self.bind = bind
        self.rank_offset = rank_offset
        self._in_use: set[tuple[str, int]] = set()  # the stores the running sync used: kept open
        # (store host, port) -> its group
        self.groups: LRU[tuple[str, int], Group] = LRU(MAX_GROUPS, self._evicted, self._in_use.__contains__)
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._next = 0
        self._dead: set[str] = set()  # groups closed or broken here: never joined again
        self._sync: str | None = None  # the sync whose buckets were received last

    @property
    def group(self) -> Group | None:
        """The group used last (one source: the only one)."""
        return self.groups.newest()

    def _evicted(self, store: tuple[str, int], g: Group) -> None:
        self._dead.add(g.spec.id)
        g.close()

    def ensure(
        self, ref: dict[str, Any], give_up: Callable[[], str | None] | None = None, sync: str | None = None
    ) -> Group:
        store = (str(ref["host"]), int(ref["port"]))
        if sync is not None and sync != self._sync:  # a new sync: the last one's pins end
            self._sync = sync
            self._in_use.clear()
            self.groups.trim()
        if sync is not None:
            self._in_use.add(store)
        g = self.groups.get(store)  # a use: it stays the newest
        if g is not None and g.spec.id == ref["id"] and not g.broken:
            return g
        if g is not None:
            self._dead.add(g.spec.id)
            g.close()
            del self.groups[store]
        if ref["id"] in self._dead:  # its root left it: joining again would wait out the timeout
            raise GroupError(f"group {ref['id']} failed or was closed here; it is not joined again")
        spec = GroupSpec(
            id=ref["id"],
            host=ref["host"],
            port=ref["port"],
            rank=ref["rank"] + self.rank_offset,
            world_size=ref["world_size"],
            backend=ref["backend"],
            timeout=ref["timeout"],
            bind=self.bind,
            token=ref.get("token", ""),
            store_key=ref.get("store_key", ""),
        )
        g = self.groups[store] = Group(spec, give_up=give_up)  # may close the least recently used
        return g

    def receive(
        self,
        ref: dict[str, Any],
        size: int,
        give_up: Callable[[], str | None] | None = None,
        sync: str | None = None,
    ) -> torch.Tensor:
        """The bucket's `size` bytes, received in place into the next buffer (a view of it:
        valid until that buffer comes round again). `give_up`: why to stop waiting (the
        sync ended), checked while joining and while receiving."""
        return self.wait(self.post(ref, size, give_up, sync), give_up)

    def post(
        self,
        ref: dict[str, Any],
        size: int,
        give_up: Callable[[], str | None] | None = None,
        sync: str | None = None,
    ) -> Posted:
        """Start receiving the next broadcast of `size` bytes into the next buffer and
        return at once (the backend receives on its own threads); `wait` for it. Posts
        must follow the order the root broadcasts in."""
        g = self.ensure(ref, give_up, sync)
        view = self.buffer(size, g.device)
        return view, (g, g.start(view))

    def buffer(self, size: int, device: torch.device) -> torch.Tensor:
        """The next of the reusable buffers, `size` bytes long (grown when too small)."""
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        buf = self._bufs[i]
        if buf is None or buf.numel() < size or buf.device != device:
            buf = self._bufs[i] = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
        return buf[:size]

    @staticmethod
    def wait(posted: Posted, give_up: Callable[[], str | None] | None = None) -> torch.Tensor:
        view, (g, started) = posted
        g.wait(started, give_up=give_up)
        return view

    def keep_used(self, sync: str) -> int:
        """`sync` finished (every source sent all of its buckets): close the groups it did
        not use, so the groups kept open are this sync's, one per source that is still
        pushing (a source that went away, or the stores of an earlier layout, keep none).
        How many closed; none when `sync` is not the one received last."""
        if sync != self._sync:
            return 0
        gone = [store for store in self.groups if store not in self._in_use]
        for store in gone:
            self._evicted(store, self.groups.pop(store))
        return len(gone)

    def close(self) -> None:
        for g in self.groups.values():
            self._dead.add(g.spec.id)
            g.close()
        self.groups.clear()
        self._bufs = [None] * len(self._bufs)
