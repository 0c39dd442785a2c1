"""`python -m tests.faults.soak --syncs 500`: many syncs with random faults injected.

A daemon with a spool and two torch engines (`--tp N`: of N ranks each, so every push is
cut into slices); a trainer pushes version after version over
a transport drawn each time (inline, shm, collective, sharded: two sources each
pushing half of the version into one sync, or delta: a small step pushed as patches
against the copy one trainer keeps across its pushes, cut per rank with `--tp`); for some syncs a fault is drawn among those
that transport can suffer (trainer abort, corrupted bucket, resent bucket, engine SIGKILL,
engine SIGSTOP past its deadline, daemon SIGKILL and restart, a source dying mid-push) and
injected halfway through. After each sync the daemon must settle at READY (IDLE-dirty only
before any version was served: after that it counts as unsettled), and every READY
engine must hold the digest of the version the daemon says it serves: each engine process
is asked (SIGUSR1, `--digest-file`) to digest the weights it holds again, and its answer,
not the daemon's record of its finalize, is compared with the trainer's digest of that
version (an engine that does not answer counts as wrong). Every failure that
touched engines (the daemon answered IDLE, or it was killed mid-sync) must be rolled back,
and only those: rolled back == failed after touching engines.

A failure is explained only by the code its fault must produce (`EXPECTED`): a fault-free
sync that fails, an INTERNAL, or any other code is unexplained, and so is a corrupted
bucket the daemon did not refuse with CHECKSUM_MISMATCH. Prints: syncs ok / failed /
rolled back, double finalizes, READY with a wrong digest, leaked processes and /dev/shm
segments, unsettled and unexplained; all of those must be 0, and rolled back equal to
failed after touching (exit code 1 otherwise). `faults drawn` counts the faults drawn; one
drawn may not take effect (an abort after the sync completed: `ok_despite`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

# "sharded": two sources (each its own connection and thread) push the two halves of the
# version into one sync, by shared memory or by the collective (a group per source)
# "delta": a small step from the version the trainer's copy holds, pushed with delta=True
# (refused and sent dense, in the same call, where the fleet serves another version)
TRANSPORTS = ("inline", "shm", "collective", "sharded", "delta")
FAULTS = {  # what each transport can suffer mid-sync
    "inline": (
        "trainer_abort",
        "corrupt_bucket",
        "resend_bucket",
        "engine_kill",
        "engine_stop",
        "daemon_kill",
    ),
    "shm": ("trainer_abort", "engine_kill", "engine_stop", "daemon_kill"),
    "collective": ("trainer_abort", "corrupt_bucket", "engine_kill", "engine_stop", "daemon_kill"),
    # source_death: one source's process dies mid-push (its connection closes, no abort)
    "sharded": ("trainer_abort", "source_death", "engine_kill", "engine_stop", "daemon_kill"),
    "delta": ("trainer_abort", "engine_kill", "engine_stop", "daemon_kill"),
}
# The codes a sync may fail with, per (transport, fault); () means it must succeed.
ENGINE_GONE = ("ENGINE_FAILED", "TIMEOUT")
EXPECTED: dict[tuple[str, str], tuple[str, ...]] = {
    **{(t, "none"): () for t in TRANSPORTS},
    **{(t, "trainer_abort"): ("ABORTED",) for t in TRANSPORTS},
    **{(t, "engine_kill"): ENGINE_GONE for t in TRANSPORTS},
    **{(t, "engine_stop"): ENGINE_GONE for t in TRANSPORTS},
    **{(t, "daemon_kill"): ("UNKNOWN_SYNC", "TIMEOUT") for t in TRANSPORTS},
    ("inline", "corrupt_bucket"): (),  # refused before fan-out, resent, the sync succeeds
    ("inline", "resend_bucket"): (),  # acknowledged again, applied once
    ("collective", "corrupt_bucket"): ("CHECKSUM_MISMATCH",),  # caught by the engines
    # the other source is told the sync failed for all: ABORTED once the dead source's grace
    # ran out, or BAD_MESSAGE when an engine came to a bucket in the shared memory the dead
    # source had already unlinked as it closed ("shm segment ... does not exist")
    ("sharded", "source_death"): ("ABORTED", "BAD_MESSAGE"),
}
BUCKET = 128 * 1024


class Soak:
    def __init__(
        self, workdir: Path, seed: int, fault_rate: float, engine_failpoint: str = "", tp: int = 1
    ) -> None:
        from engines.torch_engine import load_model
        from examples.launch import Cluster
        from examples.tiny import build_tiny_llama

        self.rng = random.Random(seed)
        self.fault_rate = fault_rate
        model = build_tiny_llama(workdir / "model", size="tiny", seed=seed)
        self.state = {k: v.detach().clone() for k, v in load_model(model).state_dict().items()}
        self.cluster = Cluster(
            workdir / "cluster",
            model,
            engines=2,
            daemon_args=[
                "--engine-timeout",
                "2",
                "--sync-timeout",
                "3",
                "--spool",
                str(workdir / "spool"),
                "--log-level",
                "info",
            ],
            engine_args=[
                "--threads",
                "1",
                "--heartbeat-interval",
                "0.5",
                "--delta-base",  # the delta pushes' patches rebuild on each engine's (rank's) base
                *(["--tp", str(tp)] if tp > 1 else []),  # ranks that take slices: every push is cut
                *(["--failpoint", engine_failpoint] if engine_failpoint else []),
            ],
            digest_files=True,  # settle() asks every READY engine what it holds
        )
        self.digests: dict[int, str] = {}
        self.version = 0
        self.counts: Counter[str] = Counter()
        self.wrong_digest = 0
        self.wrong: list[dict[str, Any]] = []  # each READY engine whose fresh digest was not the version's
        self.served: int | None = None  # the version the fleet last settled READY at
        self._failed: tuple[int, str] | None = None  # (version, fault) of a failure to settle
        self.failures: list[dict[str, Any]] = []  # each failed sync: fault, code and cause
        from orchestrator.trainer.delta import DeltaBase, DeltaChooser

        # one trainer's delta state across the soak's clients (each sync opens its own)
        self.delta_base, self.delta_chooser = DeltaBase(), DeltaChooser()
        self.delta_weights: dict[str, Any] | None = None  # the weights of delta_base.version
        self.recent: dict[int, dict[str, Any]] = {}  # the last versions' weights, any transport

    # -- one sync -----------------------------------------------------------------------
    def weights(self, v: int) -> dict:
        from examples.tiny import perturbed
        from messages.buckets import digest

        w = dict(perturbed(self.state, v))
        self.digests[v] = digest(w.items())
        return w

    def small_step(self, v: int) -> dict:
        """Version `v` as a small step (a few values of a few tensors) from the weights the
        trainer's delta copy holds: what a delta push is for."""
        from messages.buckets import digest
        from tests.integration.helpers import small_step

        served = self.served
        if served is not None and served != self.delta_base.version and served in self.recent:
            # the fleet serves a version another push sent: the trainer adopts it as its copy
            self.delta_weights = self.recent[served]
            self.delta_base.adopt(self.delta_weights.items(), served)
        if self.delta_weights is None:
            return self.weights(v)
        w = small_step(self.delta_weights, v, tensors=4, elements=40)
        self.digests[v] = digest(w.items())
        return w

    def engine(self) -> Any:
        names = [p for p in self.cluster.procs if p.name.startswith("engine") and p.popen.poll() is None]
        return self.rng.choice(names)

    def sync(self) -> None:
        from messages.errors import WeightSyncError

        self.version += 1
        v = self.version
        transport = self.rng.choice(TRANSPORTS)
        w = self.small_step(v) if transport == "delta" else self.weights(v)
        self.recent = {k: x for k, x in self.recent.items() if k >= v - 3} | {v: w}
        fault = self.rng.choice(FAULTS[transport]) if self.rng.random() < self.fault_rate else "none"
        self.counts[f"fault:{fault}"] += 1
        self.counts[f"transport:{transport}"] += 1
        try:
            with self.cluster.client(timeout=20.0, retries=1) as c:
                if transport == "delta":
                    self.delta_with_fault(c, v, w, fault)
                elif transport == "inline" and fault != "none":
                    self.inline_with_fault(c, v, w, fault)
                elif transport == "sharded":
                    self.sharded_with_fault(v, w, fault)
                else:
                    self.push_with_fault(c, v, w, transport, fault)
            self.counts["ok"] += 1
            if EXPECTED[(transport, fault)]:  # e.g. an abort that came too late to matter
                self.counts[f"ok_despite:{fault}"] += 1
        except WeightSyncError as err:
            self.counts["failed"] += 1
            self.counts[f"code:{err.code.value}"] += 1
            # A failure that left engines touched must be rolled back when a version was
            # served: settle() reads which from the daemon's history (the client's error may
            # not know: a timeout of its own, a daemon killed mid-sync)
            if self.served is not None:
                self._failed = (v, fault)
            explained = err.code.value in EXPECTED[(transport, fault)]
            self.failures.append(
                {
                    "version": v,
                    "transport": transport,
                    "fault": fault,
                    "code": err.code.value,
                    "message": err.message,
                    "state": err.state,
                    "details": err.details or {},
                    "explained": explained,
                }
            )
            if not explained:
                self.counts["unexplained"] += 1
        self.settle()

    def inline_with_fault(self, c: Any, v: int, w: dict, fault: str) -> None:
        """Bucket by bucket, so a fault can be aimed at one bucket."""
        from messages.buckets import iter_buckets
        from messages.errors import WeightSyncError

        buckets = list(iter_buckets(w.items(), BUCKET))
        sid = c.begin(v, transport="inline").sync_id
        half = len(buckets) // 2
        for b in buckets[:half]:
            c.send_bucket(sid, b)
        if fault == "corrupt_bucket":
            try:
                c.send_bucket(sid, buckets[half], checksum=buckets[half].checksum ^ 1)
                self.unexplained("corrupt_bucket: a corrupted bucket was acknowledged")
            except WeightSyncError as err:
                if err.code.value != "CHECKSUM_MISMATCH":
                    self.unexplained(f"corrupt_bucket: refused with {err.code.value}, not CHECKSUM_MISMATCH")
        elif fault == "resend_bucket":
            c.send_bucket(sid, buckets[half])  # sent twice: acknowledged twice, applied once
        else:
            self.inject(fault, sid)
        for b in buckets[half:]:
            c.send_bucket(sid, b)
        c.finish(sid, len(buckets), digest=self.digests[v])

    def push_with_fault(self, c: Any, v: int, w: dict, transport: str, fault: str) -> None:
        """A whole push; the fault is injected once half the bytes are acknowledged (or,
        for a corrupted collective bucket, one byte flips in flight after its checksum)."""
        import uuid
        from contextlib import ExitStack
        from unittest import mock

        from orchestrator.trainer.group import TrainerGroup

        sid, total = uuid.uuid4().hex, sum(t.numel() * t.element_size() for t in w.values())
        done = {"bytes": 0, "injected": False}

        def progress(n: int) -> None:
            done["bytes"] += n
            if (
                fault not in ("none", "corrupt_bucket")
                and not done["injected"]
                and done["bytes"] * 2 >= total
            ):
                done["injected"] = True
                self.inject(fault, sid)

        with ExitStack() as stack:
            if fault == "corrupt_bucket":
                real, seen = TrainerGroup.start, []

                def start(group: Any, data: Any, seq: int, give_up: Any = None) -> None:
                    seen.append(seq)
                    if len(seen) == 2:
                        data = data.clone()
                        data[len(data) // 2] ^= 0x40
                    real(group, data, seq, give_up)

                stack.enter_context(mock.patch.object(TrainerGroup, "start", start))
            r = c.push(w.items(), v, bucket_bytes=BUCKET, transport=transport, sync_id=sid, progress=progress)
        if r.detail.get("transport") not in (transport, "mixed"):
            self.unexplained(f"asked for {transport}, the daemon chose {r.detail.get('transport')}")

    def delta_with_fault(self, c: Any, v: int, w: dict, fault: str) -> None:
        """A delta push from the soak's one trainer copy, the fault injected into the sync
        the client runs (a refused delta's dense push is a new one) once half the dense
        bytes are acknowledged, or after the first bucket when patches are small."""
        c.delta_base, c.delta_chooser = self.delta_base, self.delta_chooser
        done = {"buckets": 0, "injected": False}

        def progress(n: int) -> None:
            done["buckets"] += 1
            if fault != "none" and not done["injected"] and c.began is not None:
                done["injected"] = True
                self.inject(fault, c.began)

        r = c.push(w.items(), v, bucket_bytes=BUCKET, transport="auto", delta=True, progress=progress)
        if self.delta_base.version == v:
            self.delta_weights = w
        self.counts[f"delta:{r.detail['delta']['chose']}"] += 1

    def sharded_with_fault(self, v: int, w: dict, fault: str) -> None:
        """Two sources, each its own client in its own thread, push the two halves of `w`
        into one sync (both propose the same sync_id, so an abort can name it); the fault
        is injected once source 0 has half its bytes acknowledged. `source_death`: source 1
        stops mid-push and its connection closes without an abort, as when its process
        dies. Raises the failure the surviving sources saw."""
        import threading
        import uuid

        from messages.errors import WeightSyncError

        sid, items = uuid.uuid4().hex, list(w.items())
        how = self.rng.choice(("auto", "collective"))  # shm, or a group per source
        parts = [items[0::2], items[1::2]]
        total = sum(t.numel() * t.element_size() for _, t in parts[0])
        done = {"bytes": 0, "injected": False}
        errors: list[BaseException | None] = [None, None]

        class Died(Exception):
            """Source 1's process 'dies': its client closes without aborting the sync."""

        def progress(n: int) -> None:
            done["bytes"] += n
            if fault not in ("none", "source_death") and not done["injected"] and done["bytes"] * 2 >= total:
                done["injected"] = True
                self.inject(fault, sid)

        def tensors(k: int) -> Any:
            for i, item in enumerate(parts[k]):
                if k == 1 and fault == "source_death" and i == len(parts[k]) // 2:
                    raise Died()
                yield item

        def source(k: int) -> None:
            try:
                with self.cluster.client(timeout=20.0, retries=1) as c:
                    c.push(
                        tensors(k),
                        v,
                        bucket_bytes=BUCKET // 2,
                        transport=how,
                        sync_id=sid,
                        source=(k, 2),
                        progress=progress if k == 0 else None,
                        abort_on_error=fault != "source_death",
                    )
            except BaseException as exc:
                errors[k] = exc

        threads = [threading.Thread(target=source, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if any(t.is_alive() for t in threads):
            import traceback

            stuck = [k for k, t in enumerate(threads) if t.is_alive()]
            frames = sys._current_frames()
            stacks = "".join(
                f"\nsource {k}:\n" + "".join(traceback.format_stack(frames[t.ident]))
                for k, t in enumerate(threads)
                if t.is_alive() and t.ident in frames
            )
            self.unexplained(f"sharded ({how}, {fault}): source(s) {stuck} still pushing after 120 s{stacks}")
        told = [e for e in errors if isinstance(e, WeightSyncError)]
        other = [e for e in errors if e is not None and not isinstance(e, (WeightSyncError, Died))]
        if other:
            self.unexplained(f"sharded: a source raised {other[0]!r}")
        if told:
            raise told[0]

    def unexplained(self, why: str) -> None:
        self.counts["unexplained"] += 1
        self.failures.append(
            {"version": self.version, "fault": "", "code": "", "message": why, "explained": False}
        )

    def inject(self, fault: str, sid: str) -> None:
        if fault == "trainer_abort":  # another trainer client (an operator): `weightsync abort`
            with self.cluster.client(timeout=10.0, retries=1) as other:
                other.abort(sid, "soak")
        elif fault == "engine_kill":
            p = self.engine()
            p.popen.send_signal(signal.SIGKILL)
            p.popen.wait(10)
            self.cluster.start_engine(p.name)
        elif fault == "engine_stop":  # stopped until the daemon counts it lost, then resumed
            p = self.engine()
            p.popen.send_signal(signal.SIGSTOP)
            try:
                self.wait_for(
                    lambda st: any(e["engine_id"] == p.name and e["state"] == "LOST" for e in st["engines"])
                )
            finally:
                p.popen.send_signal(signal.SIGCONT)
        elif fault == "daemon_kill":
            d = self.cluster.daemon
            d.popen.send_signal(signal.SIGKILL)
            d.popen.wait(10)
            self.cluster.start_daemon()

    def wait_for(self, cond: Any, timeout: float = 15.0) -> None:
        from messages.errors import WeightSyncError

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if cond(self.cluster.status(timeout=2.0)):
                    return
            except WeightSyncError:
                pass
            time.sleep(0.05)
        self.unexplained(f"condition not reached in {timeout}s")

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until no sync or rollback runs, then check what READY claims."""
        from messages.errors import WeightSyncError

        deadline = time.monotonic() + timeout
        st: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                st = self.cluster.status(timeout=2.0)
            except WeightSyncError:
                time.sleep(0.2)
                continue
            live = [e for e in st["engines"] if e["state"] != "LOST"]
            busy = (
                st["sync"] is not None
                or st.get("rollback_pending")
                or any(e["state"] in ("JOINING", "LOADING", "FINALIZING") for e in live)
            )
            if not busy and len(live) >= 2:
                break
            time.sleep(0.1)
        else:
            self.counts["unsettled"] += 1
            return
        last = st.get("last_sync") or {}
        if last.get("kind") == "rollback" and last.get("status") == "ROLLED_BACK":
            if last.get("sync_id") != getattr(self, "_last_rollback", None):
                self._last_rollback = last.get("sync_id")
                self.counts["rolled_back"] += 1
        failed, self._failed = self._failed, None
        if failed is not None and self._touched(st, *failed):
            self.counts["failed_touching"] += 1
        if st["state"] == "IDLE" and st.get("dirty") and self.served is not None:
            # settled with nothing served although the spool holds a version: a rollback
            # that failed (or never ran) left the fleet down
            self.counts["unsettled"] += 1
            self.counts["idle_dirty"] += 1
            return
        if st["state"] == "READY":
            self.served = st["version"]
            want = self.digests.get(st["version"])
            ready = [e["engine_id"] for e in st["engines"] if e["state"] == "READY"]
            fresh = self.cluster.fresh_digests(ready)  # what each engine holds, read again now
            for eid in ready:
                got = fresh.get(eid, {})
                if (got.get("version"), got.get("digest")) != (st["version"], want):
                    self.wrong_digest += 1
                    self.wrong.append({"engine_id": eid, "version": st["version"], "want": want, "got": got})

    @staticmethod
    def _touched(st: dict[str, Any], version: int, fault: str) -> bool:
        """Whether the failed sync of `version` left engines touched: the daemon moved it to
        IDLE (a failure of an untouched sync goes back to READY), or the daemon was killed
        mid-sync (it restarts dirty; that move is never journaled)."""
        if fault == "daemon_kill":
            return True
        return any(
            h.get("version") == version
            and h.get("to") == "IDLE"
            and h.get("from") in ("LOADING_BUCKETS", "FINALIZING")
            for h in st.get("history", [])
        )

    # -- the run ------------------------------------------------------------------------
    def double_finalizes(self) -> int:
        """(engine log, sync_id) pairs finalized more than once: a restarted engine appends to
        the same log, but every rollback and catch-up has a new sync_id."""
        doubles = 0
        for log in self.cluster.log_dir.glob("engine-*.log"):
            seen: Counter[str] = Counter()
            for line in log.read_text(errors="replace").splitlines():
                if '"engine_finalized"' in line:
                    try:
                        seen[json.loads(line)["sync_id"]] += 1
                    except (ValueError, KeyError):
                        continue
            doubles += sum(n - 1 for n in seen.values() if n > 1)
        return doubles


def made_by(segment: str, pids: set[int]) -> bool:
    """Whether `segment` (named weightsync.KIND.PID.RANDOM) was made by one of `pids`: a run
    judges only the segments of the processes it started (itself, its daemon and engines),
    never another test's beside it, live or dead."""
    try:
        return int(segment.split(".")[2]) in pids
    except (IndexError, ValueError):
        return False


def leaked_processes(workdir: Path) -> int:
    import psutil

    n = 0
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(str(workdir) in part for part in p.info["cmdline"] or []):
                n += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return n


def run(
    syncs: int,
    seed: int = 0,
    fault_rate: float = 0.25,
    progress: bool = True,
    engine_failpoint: str = "",
    tp: int = 1,
) -> dict[str, Any]:
    from messages.segments import list_segments

    shm_before = set(list_segments())
    with tempfile.TemporaryDirectory(prefix="weightsync-soak-") as tmp:
        work = Path(tmp)
        soak = Soak(work, seed, fault_rate, engine_failpoint, tp)
        t0 = time.monotonic()
        with soak.cluster:
            for i in range(syncs):
                soak.sync()
                if progress and (i + 1) % 25 == 0:
                    print(f"  {i + 1}/{syncs} syncs, {dict(soak.counts)}", flush=True)
        doubles = soak.double_finalizes()
        time.sleep(0.5)
        leaked = leaked_processes(work)
    ours = {os.getpid(), *soak.cluster.started}
    leaked_shm = [n for n in sorted(set(list_segments()) - shm_before) if made_by(n, ours)]
    return {
        "syncs": syncs,
        "ok": soak.counts["ok"],
        "failed": soak.counts["failed"],
        "rolled_back": soak.counts["rolled_back"],
        "failed_touching": soak.counts["failed_touching"],
        "unsettled": soak.counts["unsettled"],
        "idle_dirty": soak.counts["idle_dirty"],
        "double_finalizes": doubles,
        "ready_with_wrong_digest": soak.wrong_digest,
        "wrong_digests": soak.wrong,
        "leaked_processes": leaked,
        "leaked_shm_segments": len(leaked_shm),
        "leaked_shm_names": leaked_shm,
        "seconds": round(time.monotonic() - t0, 1),
        "faults": {k[6:]: n for k, n in sorted(soak.counts.items()) if k.startswith("fault:")},
        "transports": {k[10:]: n for k, n in sorted(soak.counts.items()) if k.startswith("transport:")},
        "delta_chose": {k[6:]: n for k, n in sorted(soak.counts.items()) if k.startswith("delta:")},
        "codes": {k[5:]: n for k, n in sorted(soak.counts.items()) if k.startswith("code:")},
        "unexplained_failures": soak.counts["unexplained"],
        "failures": soak.failures,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.faults.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--syncs", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault-rate", type=float, default=0.25)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--tp", type=int, default=1, help="each engine's tensor-parallel ranks (pushes are cut)")
    args = ap.parse_args(argv)
    r = run(args.syncs, args.seed, args.fault_rate, tp=args.tp)
    r["commit"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    r["command"] = (
        f"python -m tests.faults.soak --syncs {args.syncs} --seed {args.seed} "
        f"--fault-rate {args.fault_rate} --tp {args.tp}"
    )
    print(
        f"syncs {r['syncs']}: ok {r['ok']}, failed {r['failed']} ({r['failed_touching']} after "
        f"touching engines), rolled back {r['rolled_back']}, unsettled {r['unsettled']} "
        f"(IDLE-dirty {r['idle_dirty']}) ({r['seconds']} s)"
    )
    print(
        f"transports: {r['transports']}; faults drawn: {r['faults']}; error codes: {r['codes']}; "
        f"unexplained failures {r['unexplained_failures']}"
    )
    print(
        f"double finalizes {r['double_finalizes']}, READY with wrong digest "
        f"{r['ready_with_wrong_digest']}, leaked processes {r['leaked_processes']}, "
        f"leaked /dev/shm segments {r['leaked_shm_segments']}"
    )
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    bad = (
        r["double_finalizes"]
        or r["ready_with_wrong_digest"]
        or r["leaked_processes"]
        or r["leaked_shm_segments"]
        or r["unsettled"]
        or r["unexplained_failures"]
        or r["rolled_back"] != r["failed_touching"]
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
