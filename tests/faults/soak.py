"""`python -m tests.faults.soak --syncs 500`: many syncs with random faults injected.

A daemon with a spool and two torch engines; a trainer pushes version after version;
before some syncs a fault is drawn (trainer abort, corrupted bucket, resent bucket,
engine SIGKILL, engine SIGSTOP past its deadline, daemon SIGKILL and restart). After each
sync the daemon must settle at READY (or IDLE when nothing could be repaired), and every
READY engine must hold the digest of the version the daemon says it serves. Prints:
syncs ok / failed / rolled back, double finalizes, READY with a wrong digest, leaked
processes and /dev/shm segments; the last four must be 0 (exit code 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

FAULTS = ["trainer_abort", "corrupt_bucket", "resend_bucket", "engine_kill", "engine_stop", "daemon_kill"]
BUCKET = 128 * 1024


class Soak:
    def __init__(self, workdir: Path, seed: int, fault_rate: float) -> None:
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
            engine_args=["--threads", "1", "--heartbeat-interval", "0.5"],
        )
        self.digests: dict[int, str] = {}
        self.version = 0
        self.counts: Counter[str] = Counter()
        self.wrong_digest = 0
        self.failures: list[dict[str, Any]] = []  # each failed sync: fault, code and cause

    # -- one sync -----------------------------------------------------------------------
    def weights(self, v: int) -> dict:
        from examples.tiny import perturbed
        from messages.buckets import digest

        w = dict(perturbed(self.state, v))
        self.digests[v] = digest(w.items())
        return w

    def engine(self) -> Any:
        names = [p for p in self.cluster.procs if p.name.startswith("engine") and p.popen.poll() is None]
        return self.rng.choice(names)

    def sync(self) -> None:
        from messages.buckets import iter_buckets
        from messages.errors import WeightSyncError

        self.version += 1
        v = self.version
        w = self.weights(v)
        fault = self.rng.choice(FAULTS) if self.rng.random() < self.fault_rate else "none"
        self.counts[f"fault:{fault}"] += 1
        transport = self.rng.choice(["inline", "shm"])
        try:
            with self.cluster.client(timeout=20.0, retries=1) as c:
                if fault == "none":
                    c.push(w.items(), v, bucket_bytes=BUCKET, transport=transport)
                else:
                    buckets = list(iter_buckets(w.items(), BUCKET))
                    sid = c.begin(v)["sync_id"]
                    half = len(buckets) // 2
                    for b in buckets[:half]:
                        c.send_bucket(sid, b)
                    self.inject(fault, c, sid, buckets[half])
                    for b in buckets[half:]:
                        c.send_bucket(sid, b)
                    c.finish(sid, len(buckets), digest=self.digests[v])
            self.counts["ok"] += 1
        except WeightSyncError as err:
            self.counts["failed"] += 1
            self.counts[f"code:{err.code.value}"] += 1
            self.failures.append(
                {
                    "version": v,
                    "fault": fault,
                    "code": err.code.value,
                    "message": err.message,
                    "state": err.state,
                    "details": err.details or {},
                }
            )
            if not explained(err):
                self.counts["unexplained"] += 1
        self.settle()

    def inject(self, fault: str, c: Any, sid: str, bucket: Any) -> None:
        from messages.errors import WeightSyncError

        if fault == "trainer_abort":
            c.abort(sid, "soak")  # the sync is gone: the next send_bucket fails, typed
        elif fault == "corrupt_bucket":
            try:
                c.send_bucket(sid, bucket, checksum=bucket.checksum ^ 1)
            except WeightSyncError:
                pass  # refused before fan-out; the loop resends it correctly
        elif fault == "resend_bucket":
            c.send_bucket(sid, bucket)  # sent twice: acked, applied once
        elif fault == "engine_kill":
            p = self.engine()
            p.popen.send_signal(signal.SIGKILL)
            p.popen.wait(10)
            self.cluster.start_engine(p.name)
        elif fault == "engine_stop":
            p = self.engine()
            p.popen.send_signal(signal.SIGSTOP)
            time.sleep(3.0)  # past the 2 s engine deadline
            p.popen.send_signal(signal.SIGCONT)
        elif fault == "daemon_kill":
            d = self.cluster.daemon
            d.popen.send_signal(signal.SIGKILL)
            d.popen.wait(10)
            self.cluster.start_daemon()

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
        if st["state"] == "READY":
            want = self.digests.get(st["version"])
            for e in st["engines"]:
                if e["state"] == "READY" and e["digest"] != want:
                    self.wrong_digest += 1

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


def explained(err: Any) -> bool:
    """A failure names its cause: any code but a bare INVALID_STATE, or an INVALID_STATE
    that says which sync ended how, or which sync or rollback is in the way."""
    if err.code.value != "INVALID_STATE":
        return True
    return any(w in err.message for w in ("already ended", "already completed", "running", "rolling"))


def ours_or_orphaned(segment: str) -> bool:
    """A segment this run leaked: made by this process (the trainer), or by one that is gone
    and left it behind. Other live processes' segments (another test run) are theirs."""
    import os

    try:
        pid = int(segment.split(".")[2])
    except (IndexError, ValueError):
        return True  # not a name we make: nobody else should have put it there
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
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


def run(syncs: int, seed: int = 0, fault_rate: float = 0.25, progress: bool = True) -> dict[str, Any]:
    from messages.shm import list_segments

    shm_before = set(list_segments())
    with tempfile.TemporaryDirectory(prefix="weightsync-soak-") as tmp:
        work = Path(tmp)
        soak = Soak(work, seed, fault_rate)
        t0 = time.monotonic()
        with soak.cluster:
            for i in range(syncs):
                soak.sync()
                if progress and (i + 1) % 25 == 0:
                    print(f"  {i + 1}/{syncs} syncs, {dict(soak.counts)}", flush=True)
        doubles = soak.double_finalizes()
        time.sleep(0.5)
        leaked = leaked_processes(work)
    leaked_shm = [n for n in sorted(set(list_segments()) - shm_before) if ours_or_orphaned(n)]
    return {
        "syncs": syncs,
        "ok": soak.counts["ok"],
        "failed": soak.counts["failed"],
        "rolled_back": soak.counts["rolled_back"],
        "unsettled": soak.counts["unsettled"],
        "double_finalizes": doubles,
        "ready_with_wrong_digest": soak.wrong_digest,
        "leaked_processes": leaked,
        "leaked_shm_segments": len(leaked_shm),
        "seconds": round(time.monotonic() - t0, 1),
        "faults": {k[6:]: n for k, n in sorted(soak.counts.items()) if k.startswith("fault:")},
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
    args = ap.parse_args(argv)
    r = run(args.syncs, args.seed, args.fault_rate)
    print(
        f"syncs {r['syncs']}: ok {r['ok']}, failed {r['failed']}, rolled back {r['rolled_back']}, "
        f"unsettled {r['unsettled']} ({r['seconds']} s)"
    )
    print(
        f"faults injected: {r['faults']}; error codes: {r['codes']}; "
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
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
