"""What trainers import: `TrainerClient(addr).push(named_tensors, version)`.

Rules: one DEALER socket, used only by the thread that created the client. At most
`window` buckets are unacknowledged at a time (the daemon acks a bucket only when every
engine applied it), so memory stays at ~window buckets whatever the model size; by
default the window is sized during the push from the measured round trip and ack rate
(`stream.WindowSizer`), between 2 and 8 buckets and 128 MiB. A request
that gets no reply in `timeout` is resent with the same sync_id and seq (the daemon acks
duplicates without re-applying them). Every error reply raises the `WeightSyncError`
subclass of its code, carrying the daemon's state and version.
"""

from __future__ import annotations

import secrets
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Unpack

import torch
import zmq

from messages import schema, transports
from messages.buckets import Cast, Digester, Item, PackedBucket
from messages.cuts import Cuts, Planned
from messages.delta import Mode
from messages.errors import ErrorCode, WeightSyncError, make_error
from messages.keys import ClientKeys
from messages.liblog import get_logger
from messages.replies import BeginReply, FinishReply, JsonObject, StatusReply
from messages.replies import decode as decode_reply
from messages.schema import DEFAULT_ADDR, DEFAULT_BUCKET_BYTES
from orchestrator.trainer.connection import Connection, error_from_reply
from orchestrator.trainer.delta import DeltaBase, DeltaChooser
from orchestrator.trainer.deltapush import push_delta
from orchestrator.trainer.module import push_module
from orchestrator.trainer.options import (
    AdapterPushOptions as AdapterPushOptions,
)
from orchestrator.trainer.options import (
    ClientOptions as ClientOptions,
)
from orchestrator.trainer.options import (
    ConnectOptions as ConnectOptions,
)
from orchestrator.trainer.options import (
    ModuleCallOptions,
    PushArgs,
)
from orchestrator.trainer.options import ModulePushOptions as ModulePushOptions
from orchestrator.trainer.options import PushOptions as PushOptions
from orchestrator.trainer.results import SyncResult as SyncResult  # where trainers import it from
from orchestrator.trainer.results import abort_reason, ended_cause, sync_result
from orchestrator.trainer.routes import Routes, pending_cap
from orchestrator.trainer.shard import ShardPlans
from orchestrator.trainer.stream import Progress, Stream, window_limit

log = get_logger("trainer")


class TrainerClient:
    """A trainer's handle on the daemon: a `Connection` (socket, link, resends), a `Stream`
    (the bucket pipeline), its slots for the reference transports and, for a group
    transport, its group (rank 0)."""

    def __init__(
        self,
        addr: str = DEFAULT_ADDR,
        *,
        timeout: float = 30.0,
        retries: int = 3,
        finish_timeout: float = 900.0,
        ctx: zmq.SyncContext | None = None,
        source: int = 0,
        keys: ClientKeys | None = None,
        connect_timeout: float = 5.0,
        collective_host: str = "",
    ) -> None:
        self.addr = addr
        self.collective_host = collective_host  # this host's address for the group's store
        self.finish_timeout = finish_timeout
        self.source = source
        self.curve = keys is not None  # with keys, the group's plane is keyed too
        self.conn = Connection(
            addr,
            timeout=timeout,
            retries=retries,
            ctx=ctx or zmq.Context.instance(),
            keys=keys,
            connect_timeout=connect_timeout,
        )
        # This client's seat token: a source's seat (its begin, buckets and finish) belongs
        # to the token that began it. A token, not the connection: a reconnected DEALER gets
        # a new routing identity at the daemon, and the resends that follow must still be
        # this source's; a begin resent after a lost reply carries the same token.
        self.seat = secrets.randbits(64)
        self.stream = Stream(self.conn, source, self.seat)
        # how this client's buckets travel: each transport's slots, its group (kept across pushes)
        self.routes = Routes(addr, collective_host, self.curve)
        self.delta_base = DeltaBase()  # the copy delta pushes are encoded against (push(delta=True))
        self.delta_chooser = DeltaChooser()  # whether a delta pays on a transport, as measured
        self.plans = ShardPlans()  # sharded pushes' assignments, by model layout (push_module)
        # The sync the last push began or joined; None while it has not (its begin was
        # refused or unanswered): a failed push with None here left nothing on the daemon
        # to wait for, unless its begin went unanswered (TIMEOUT).
        self.began: str | None = None

    @property
    def timeout(self) -> float:
        return self.conn.timeout

    def close(self) -> None:
        self.routes.close()
        self.conn.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -----------------------------------------------------------------------
    def hello(self) -> JsonObject:
        return self.conn.request(lambda i: schema.Hello(id=i, client="weightsync-client"))

    def status(self, timeout: float | None = None, retries: int | None = None) -> dict[str, Any]:
        """The whole status object, as `weightsync status --json` prints it: JSON whose
        fields are read by name (`fleet` is the typed part a trainer acts on)."""
        return self.conn.request(lambda i: schema.Status(id=i), timeout, retries=retries)

    def fleet(self, timeout: float | None = None, retries: int | None = None) -> StatusReply:
        """The status, typed: what a trainer acts on (decoded once, BAD_MESSAGE if it does
        not match)."""
        return decode_reply(self.status(timeout, retries), StatusReply)

    @property
    def lost_connections(self) -> int:
        """How many times the connection to the daemon was lost after it was up (a daemon
        restart is one): a request that failed while this grew failed with the connection,
        not on its merits. Counts what the socket monitor has shown so far."""
        self.conn.link.pump()
        return self.conn.link.drops

    def next_version(self, last: int | None = None) -> int:
        """The version after both `last` (this trainer's own) and what the fleet served, so a
        restarted trainer never pushes a version the fleet already served."""
        served = self.fleet().last_ready_version
        return max(v for v in (last, served, 0) if v is not None) + 1

    def begin(
        self,
        version: int,
        sync_id: str | None = None,
        *,
        sources: int = 1,
        source: int = 0,
        plan: int | None = None,
        expected_buckets: int | None = None,
        probes: Sequence[schema.Probe] = (),
        transport: str = transports.FRAMES,
        group_offer: schema.CollectiveOffer | None = None,
        base: int | None = None,
        bucket_bytes: int | None = None,
    ) -> BeginReply:
        """Start a sync (`base`: a delta sync against that served version; `bucket_bytes`:
        the size its buckets are cut to, which the daemon sizes its fan-out for). `transport`:
        a registered transport's name or "auto" (`messages.transports`); a group transport
        needs `group_offer` (this trainer's store). The reply's `transport` says what the
        daemon chose (a transport's name, or "mixed": references for some engines, frames
        for the rest).
        A sharded push's source (`source` of `sources`, with the sources' `plan` hash) may be
        told to join a sync another source opened: the reply's `sync_id` is the one to use."""
        sync_id = sync_id or uuid.uuid4().hex
        t = transports.get(transport)
        host = socket.gethostname() if t is None or t.carries == "ref" else ""
        body = self.conn.request(
            lambda i: schema.Begin(
                sync_id=sync_id,
                version=version,
                id=i,
                sources=sources,
                source=source,
                plan=plan,
                expected_buckets=expected_buckets,
                probes=tuple(probes),
                host=host,
                transport=transport,
                offer=group_offer,
                base=base,
                bucket_bytes=bucket_bytes,
                seat=self.seat,
            )
        )
        return decode_reply({"sync_id": sync_id, **body}, BeginReply)

    def send_bucket(self, sync_id: str, bucket: PackedBucket, *, checksum: int | None = None) -> JsonObject:
        """Send one bucket and wait until every engine applied it."""
        return self.conn.request(
            lambda i: self.stream.bucket_msg(sync_id, bucket, i, checksum), payload=[bucket.frame()]
        )

    def finish(
        self,
        sync_id: str,
        buckets: int,
        *,
        digest: str | None = None,
        timeout: float | None = None,
        partial: bool = False,
        chain: int | None = None,
        slice_digests: dict[str, tuple[str, ...]] | None = None,
    ) -> FinishReply:
        """Finish the sync; its answer comes once every participant finalized (READY).
        slice_digests: a push cut into slices, each rank's digest per layout key."""
        body = self.conn.request(
            lambda i: schema.Finish(
                sync_id=sync_id,
                buckets=buckets,
                id=i,
                source=self.source,
                digest=digest,
                partial=partial,
                chain=chain,
                seat=self.seat,
                slice_digests=slice_digests or {},
            ),
            self.finish_timeout if timeout is None else timeout,
        )
        return decode_reply(body, FinishReply)

    def abort(
        self,
        sync_id: str,
        reason: str = "",
        *,
        timeout: float | None = None,
        retries: int | None = None,
        code: ErrorCode | None = None,
        by: Literal["trainer", "operator"] = "trainer",
    ) -> dict[str, Any]:
        """End a running sync. code: the error that made the caller give up (the sync's
        failure code in status, metrics and journal; default ABORTED); by: who asks."""
        return self.conn.request(
            lambda i: schema.Abort(sync_id=sync_id, id=i, reason=reason, code=code, by=by),
            timeout,
            retries=retries,
        )

    # -- the whole sync -----------------------------------------------------------------
    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor | Cast]],
        version: int,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        window: int | None = None,
        probes: Sequence[schema.Probe] = (),
        sync_id: str | None = None,
        abort_on_error: bool = True,
        progress: Progress | None = None,
        transport: str = "auto",
        rollback_wait: float = 120.0,
        partial: bool = False,
        engines_wait: float = 0.0,
        delta: bool = False,
        delta_mode: Mode = "auto",
        source: tuple[int, int] | None = None,
        plan: int | None = None,
    ) -> SyncResult:
        """Stream `named_tensors` to every engine as `version`; return when READY.

        transport: "auto" or a registered transport's name (`messages.transports.names()`;
        docs/PROTOCOL.md lists the built-in ones). "auto" picks by capability: references
        to same-host memory for the engines on this host that can read them (one write
        here, one read per engine), frames through the daemon otherwise. A name forces a
        choice (a reference transport still falls back to frames where the daemon says
        so); a group transport broadcasts each bucket to the engines over a
        torch.distributed group (the daemon only sees metadata; frames where some engine
        cannot join).
        window: buckets unacknowledged at a time; None sizes it from measurements (enough
        buckets in flight to cover one round trip at the measured ack rate, 2 to 8, at
        most 128 MiB); the size reached is in the result's `detail["window"]`.
        rollback_wait: seconds to wait, before beginning, for a rollback the daemon is
        running after an earlier failure (0: raise its INVALID_STATE at once).
        partial: the tensors are a subset of the engines' on purpose (otherwise `finish`
        refuses a push that leaves an engine tensor out, with INCOMPLETE_SYNC).
        delta: send each tensor as a patch against the version the fleet serves (nothing
        when unchanged, indices + values or zstd of the XOR when few bits changed, dense
        otherwise): this client keeps a host copy of what it pushed last (one model's
        bytes). The first delta push, or one the daemon refuses (STALE_BASE: the fleet no
        longer serves our copy's version, an engine keeps no base), goes dense; the result's
        `detail["delta"]` says what was sent (after a refusal, `refused`: the base tried,
        the refusal's message and details). Over a transport where delta pushes measured
        slower than dense ones (the link outruns the encoding: shared memory on one host),
        it sends dense and says so (`chose`, `why`), trying delta again every 8 pushes.
        delta_mode "sparse"/"xor" force an encoding where it beats dense (benchmarks).
        Whatever ends the push early (an error, a timeout, Ctrl-C, SIGTERM raised as an
        exception) aborts the sync it began, so the daemon is free for the next push.
        source: (rank, world): this process is one of `world` sources of a sharded push, each
        pushing a disjoint part of the version (call it on every rank with the same version;
        the first begin opens the sync, the others join it). The daemon refuses a tensor two
        sources send (DUPLICATE_TENSOR) and, at the last finish, one no source sent
        (INCOMPLETE_SYNC); every engine finalizes once, after the last bucket of the last
        source; any source failing fails the sync for all. Every transport: over a
        group each source broadcasts from a group of its own. `plan`: the sources' assignment hash, which the
        daemon checks every source agrees on (`push_module(sharded=True)` sets it). The result's
        `digest` is the version's, over every source's tensors."""
        if source is not None:
            rank, world = source
            if not 0 <= rank < world:
                raise ValueError(f"source (rank, world) = {source}: need 0 <= rank < world")
            if delta:
                raise ValueError("a sharded push is dense: delta=True takes one source")
        kw: PushArgs = {
            "bucket_bytes": bucket_bytes,
            "window": window,
            "probes": probes,
            "abort_on_error": abort_on_error,
            "progress": progress,
            "transport": transport,
            "rollback_wait": rollback_wait,
            "partial": partial,
            "engines_wait": engines_wait,
            "source": source,
            "plan": plan,
        }
        pace = self.delta_chooser
        if not delta:
            result = self._push(named_tensors, version, sync_id=sync_id, **kw)
            pace.record(transport, result.detail["transport"], "dense", result.seconds, result.bytes)
            return result
        return push_delta(
            self._push,
            self.delta_base,
            pace,
            named_tensors,
            version,
            sync_id=sync_id,
            transport=transport,
            delta_mode=delta_mode,
            kw=kw,
        )

    def _push(
        self,
        named_tensors: Iterable[tuple[str, Item]],
        version: int,
        *,
        bucket_bytes: int,
        window: int | None,
        probes: Sequence[schema.Probe],
        sync_id: str | None,
        abort_on_error: bool,
        progress: Progress | None,
        transport: str,
        rollback_wait: float,
        partial: bool,
        engines_wait: float,
        base: int | None = None,
        source: tuple[int, int] | None = None,
        plan: int | None = None,
        planned: Planned | None = None,
    ) -> SyncResult:
        if window is not None and window < 1:
            raise ValueError("window must be >= 1 (or None: sized from measurements)")
        asked = transports.get(transport)
        if transport != transports.AUTO and asked is None:
            raise ValueError(f"transport must be auto or one of {', '.join(transports.names())}")
        t0 = time.perf_counter()
        sync_id = sync_id or uuid.uuid4().hex
        offer = self.routes.offer() if asked is not None and asked.needs_group else None
        ring, via = self.routes.slots(asked, window_limit(window, bucket_bytes), bucket_bytes)
        if ring is None and offer is None:
            transport = transports.frames().name
        elif ring is not None:
            transport = via  # "auto" too: the daemon plans the transport these slots are of
        rank, world = source or (0, 1)
        self.source = self.stream.source = rank
        self.began = None
        try:
            try:
                started = self._begin_after_rollback(
                    version,
                    sync_id,
                    probes,
                    transport,
                    rollback_wait,
                    engines_wait,
                    offer,
                    base,
                    bucket_bytes,
                    (rank, world, plan),
                )
            except WeightSyncError as err:
                if abort_on_error and err.code in (ErrorCode.TIMEOUT, ErrorCode.UNREACHABLE):
                    self._abort_quietly(sync_id, err)  # the begin may have landed unanswered
                raise
            except BaseException as exc:  # interrupted while beginning: release what began
                if abort_on_error:
                    self._abort_quietly(sync_id, exc)
                raise
            sync_id = self.began = started.sync_id  # a sharded push's source may have joined another's sync
            if started.via != via:
                ring = None  # kept for a later push; this one goes by frames or a broadcast
            coll = self.routes.group_for(started, transport)
            if started.bucket_bytes is not None and started.bucket_bytes < bucket_bytes:
                log.info("bucket_size_capped", asked=bucket_bytes, bucket_bytes=started.bucket_bytes)
                bucket_bytes = started.bucket_bytes  # what the daemon's fan-out queue holds
            digester = Digester()
            # engines that take slices: each rank is sent only what it loads (a delta's
            # encoder, told the cuts here, patches each box; its dense tensors are cut below)
            cuts = Cuts.of(started.layouts)
            if planned is not None:
                planned.cuts, planned.digester = cuts, digester
            named_tensors = named_tensors if cuts is None else cuts.items(named_tensors, digester)
            t_stream = time.perf_counter()
            try:
                if coll is not None and started.stream:
                    streamed = self.stream.framed(
                        sync_id, named_tensors, bucket_bytes, progress, coll, digester, partial
                    )
                else:
                    streamed = self.stream.run(
                        sync_id,
                        named_tensors,
                        bucket_bytes,
                        window,
                        progress,
                        ring,
                        digester,
                        coll,
                        max_pending=pending_cap(started, bucket_bytes),
                    )
                # A partial push covers only some of the engines' tensors, while an engine's
                # digest covers all it holds: the engines are then checked against each other.
                t_finish = time.perf_counter()
                done = self.finish(
                    sync_id,
                    streamed.buckets,
                    digest=None if partial else digester.hexdigest(),
                    partial=partial,
                    chain=streamed.chain,
                    slice_digests=cuts.rank_digests(digester) if cuts is not None and not partial else None,
                )
                trainer_phases = {
                    "begin": t_stream - t0,
                    **streamed.phases,
                    "finish": time.perf_counter() - t_finish,
                }
            except WeightSyncError as err:
                if coll is not None:
                    coll.fail()
                ended = started.stream and err.code is ErrorCode.INVALID_STATE
                pushed = self.conn.pushed_error(sync_id, wait=2.0) if ended else None
                if pushed is not None:
                    # the stream ended before the finish: raise what ended it (it names the engine)
                    raise error_from_reply(pushed) from None
                cause = ended_cause(err, sync_id)
                if cause is not None:  # the finish came after the sync failed: raise why it did
                    raise cause from err
                if abort_on_error and err.state in ("LOADING_BUCKETS", "FINALIZING", None):
                    self._abort_quietly(sync_id, err)
                raise
            except BaseException as exc:  # KeyboardInterrupt, a broken iterator: do not wedge
                if coll is not None:
                    coll.fail()
                if abort_on_error:
                    self._abort_quietly(sync_id, exc)
                raise
        except BaseException:
            self.routes.drop_rings()  # an engine may still read a slot of the failed sync
            raise
        return sync_result(
            sync_id,
            version,
            time.perf_counter() - t0,
            started=started,
            streamed=streamed,
            done=done,
            digester=digester,
            trainer_phases=trainer_phases,
            bucket_bytes=bucket_bytes,
            source=(rank, world),
        )

    def push_module(
        self,
        model: torch.nn.Module,
        version: int,
        *,
        dtype: torch.dtype | None = None,
        filter: Callable[[str, torch.Tensor], bool] | None = None,
        **push_kw: Unpack[ModuleCallOptions],
    ) -> SyncResult:
        """Push a live module's parameters and buffers as `version`, streamed (no second
        state dict): HF names, tied weights once, optional dtype cast, FSDP2/DTensor
        gathered per tensor (call it on every rank; ranks without a client use
        `orchestrator.trainer.push_module(None, model, version)`). See trainer/module.py."""
        return push_module(self, model, version, dtype=dtype, filter=filter, **push_kw)

    def served_versions(self) -> dict[str, int | None]:
        """engine_id -> the version it serves now (None: none verified), lost engines left out."""
        return {e.engine_id: (e.version if e.state == "READY" else None) for e in self.fleet().live()}

    def wait_ready(self, min_version: int, *, timeout: float = 300.0, poll: float = 0.1) -> dict[str, int]:
        """Block until the daemon is READY at `min_version` or newer and every live engine
        serves it (an off-policy trainer bounds its staleness with this). Returns
        engine_id -> version; raises TIMEOUT naming the engines still behind. An engine that
        labels its outputs (vLLM) counts only once its label says the version it serves."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.fleet()
            live = st.live()
            behind = [
                e.engine_id
                for e in live
                if e.state != "READY"
                or e.version is None
                or e.version < min_version
                or (e.labels and e.label != str(e.version))
            ]
            if st.state == "READY" and (st.version or -1) >= min_version and live and not behind:
                return {e.engine_id: e.version for e in live if e.version is not None}
            if time.monotonic() >= deadline:
                raise make_error(
                    ErrorCode.TIMEOUT,
                    f"version {min_version} not served everywhere within "
                    f"{timeout}s: daemon {st.state} at {st.version}, behind: {behind}",
                    state=st.state,
                    version=st.version,
                    details={"behind": behind},
                )
            time.sleep(poll)

    def _collective_offer(self) -> schema.CollectiveOffer:
        return self.routes.offer()

    def _begin_after_rollback(
        self,
        version: int,
        sync_id: str | None,
        probes: Sequence[schema.Probe],
        transport: str,
        wait: float,
        engines_wait: float = 0.0,
        offer: schema.CollectiveOffer | None = None,
        base: int | None = None,
        bucket_bytes: int | None = None,
        source: tuple[int, int, int | None] = (0, 1, None),
    ) -> BeginReply:
        """Begin; wait (and say so every few seconds) for a rollback the daemon runs, or for
        engines still registering, up to `wait` / `engines_wait` seconds."""
        t0 = time.monotonic()
        said = 0.0
        while True:
            try:
                return self.begin(
                    version,
                    sync_id,
                    probes=probes,
                    transport=transport,
                    group_offer=offer,
                    base=base,
                    bucket_bytes=bucket_bytes,
                    source=source[0],
                    sources=source[1],
                    plan=source[2],
                )
            except WeightSyncError as err:
                waited = time.monotonic() - t0
                rolling = err.details.get("rollback_running") and waited < wait
                engines = err.code is ErrorCode.NO_ENGINES and waited < engines_wait
                if not (rolling or engines):
                    raise
                if waited >= said:
                    what = "the daemon's rollback" if rolling else "engines to register"
                    log.warning("waiting", what=what, waited_s=round(waited, 1), reason=err.message)
                    said = waited + 5.0
                time.sleep(0.2)

    def _abort_quietly(self, sync_id: str, cause: BaseException) -> None:
        """Abort the sync `cause` ended, naming the cause; a WeightSyncError raised next then
        says where the daemon is after the abort, not before it."""
        code, reason = abort_reason(cause)
        try:
            body = self.abort(
                sync_id,
                reason=reason,
                timeout=min(self.timeout, 5.0),
                retries=0,
                code=code,
            )
        except WeightSyncError as err:  # already ended on the daemon side: nothing to undo
            log.info("abort_not_needed", sync_id=sync_id, code=err.code.value)
            return
        if isinstance(cause, WeightSyncError) and body.get("state"):
            cause.state, cause.version = body["state"], body.get("version")
