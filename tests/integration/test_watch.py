"""`weightsync watch`: a writer process creates step directories as a trainer in
filesystem mode does (one complete, one never completed, one written slowly, two out of
order); the real watcher pushes each complete one as its version through a real daemon
into two torch engines, in order, once, and pushes nothing again after a restart. It
waits for a daemon that starts after it or restarts under it (SIGKILL, SIGTERM, mid-push)
without using up a step, waits for a sharded step's index, reports a step it cannot read,
and takes real trainers' directory names (HF's tmp- rename, NeMo's step=N)."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import save, save_file

from examples.tiny import perturbed
from messages.buckets import digest

from .helpers import running_daemon, wait_for

pytestmark = pytest.mark.slow

# argv: MODEL_DIR ROOT GO_FILE. Writes step-1 whole, step-2 without one of the shards its
# index names, step-3 slowly (its file grows for ~2 s), step-5; then, once GO_FILE
# exists, step-4 (out of order). Prints each directory's name when it is written.
WRITER = r"""
import json, sys, time
from pathlib import Path
from safetensors.torch import save, save_file
from engines.torch_engine import load_model
from examples.tiny import perturbed
model, root, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
state = {k: v.detach().clone() for k, v in load_model(model).state_dict().items()}
def weights(v):
    return {k: t.contiguous() for k, t in perturbed(state, v)}
def whole(v):
    d = root / f"step-{v}"
    d.mkdir()
    save_file(weights(v), str(d / "model.safetensors"))
    print(d.name, flush=True)
whole(1)
d = root / "step-2"
d.mkdir()
w = weights(2)
names = sorted(w)
half = {k: w[k] for k in names[: len(names) // 2]}
save_file(half, str(d / "model-00001-of-00002.safetensors"))
index = {"weight_map": {k: ("model-00001-of-00002.safetensors" if k in half else "model-00002-of-00002.safetensors") for k in names}}
(d / "model.safetensors.index.json").write_text(json.dumps(index))
print("step-2", flush=True)
d = root / "step-3"
d.mkdir()
blob = save(weights(3))
with open(d / "model.safetensors", "wb") as f:
    step = len(blob) // 5 + 1
    for i in range(0, len(blob), step):
        f.write(blob[i : i + step])
        f.flush()
        time.sleep(0.5)
print("step-3", flush=True)
whole(5)
while not go.exists():
    time.sleep(0.05)
whole(4)
"""


def _events(lines: list[str]) -> list[dict]:
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _watch(cluster, root, *extra: str) -> subprocess.Popen:
    """The watcher on `cluster`'s address (a Cluster, or the address itself)."""
    addr = cluster if isinstance(cluster, str) else cluster.addr
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "watch",
            str(root),
            "--addr",
            addr,
            "--settle",
            "1",
            "--poll",
            "0.2",
            "--json",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def _lines(proc: subprocess.Popen) -> queue.Queue:
    """The watcher's stdout lines as they come (None once it closed), read by a thread so
    that a test waiting for a line that never comes fails at its own deadline."""
    q = _QUEUES.get(proc.pid)
    if q is None:
        q = _QUEUES[proc.pid] = queue.Queue()

        def pump() -> None:
            for line in proc.stdout:
                q.put(line)
            q.put(None)

        threading.Thread(target=pump, daemon=True).start()
    return q


_QUEUES: dict[int, queue.Queue] = {}


def _read_until(proc: subprocess.Popen, want, timeout: float) -> list[dict]:
    """Events from the watcher's stdout until `want(events)` holds."""
    events: list[dict] = []
    deadline = time.monotonic() + timeout
    q = _lines(proc)
    while not want(events):
        left = deadline - time.monotonic()
        assert left > 0, f"not within {timeout}s: {events}"
        try:
            line = q.get(timeout=left)
        except queue.Empty:
            continue
        assert line is not None, f"watcher exited {proc.wait()}: {events} {proc.stderr.read()[-2000:]}"
        events += _events([line])
    return events


def _rest(proc: subprocess.Popen) -> list[dict]:
    """The events an exited watcher printed that no test read yet."""
    q, out = _lines(proc), []
    while (line := q.get(timeout=30)) is not None:
        out.append(line)
    return _events(out)


def test_watch_pushes_each_complete_step_in_order_once(tmp_path, tiny_model_dir, tiny_state):
    root, go = tmp_path / "ckpts", tmp_path / "go"
    root.mkdir()
    with running_daemon(tmp_path / "d", tiny_model_dir, engines=2) as cluster:
        watcher = _watch(cluster, root)
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tiny_model_dir), str(root), str(go)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            pushed = lambda ev: [e["version"] for e in ev if e["event"] == "pushed"]  # noqa: E731
            events = _read_until(watcher, lambda ev: 5 in pushed(ev), 120)
            assert pushed(events) == [1, 3, 5], events
            go.touch()  # now the trainer writes step-4, after step-5
            events += _read_until(watcher, lambda ev: any(e["event"] == "refused" for e in ev), 60)
            refused = [e for e in events if e["event"] == "refused"]
            assert [(e["version"], e["code"]) for e in refused] == [(4, "STALE_VERSION")]
            assert "out of order" in refused[0]["reason"]
            assert writer.wait(30) == 0
            watcher.send_signal(signal.SIGTERM)
            assert watcher.wait(30) == 4  # a version was refused
        finally:
            for p in (watcher, writer):
                if p.poll() is None:
                    p.kill()
        for e in events:  # the watcher's --json output (shown with pytest -s)
            print(json.dumps(e))
        # the incomplete step-2 was never pushed, only reported once it stopped changing;
        # step-3 only once whole
        two = [e for e in events if e["version"] == 2]
        assert [e["event"] for e in two] == ["incomplete"], events
        assert "model.safetensors.index.json names model-00002-of-00002.safetensors" in two[0]["reason"]
        st = cluster.status()
        assert st["state"] == "READY" and st["version"] == 5
        want = digest((k, t.contiguous()) for k, t in perturbed(tiny_state, 5))
        assert {e["digest"] for e in st["engines"]} == {want}
        assert [h["version"] for h in st["history"] if h["to"] == "READY"] == [1, 3, 5]
        last = st["last_sync"]["sync_id"]

        # a restart pushes nothing again: every directory there is served already
        again = _watch(cluster, root)
        try:
            events = _read_until(again, lambda ev: len(ev) == 5, 60)
            again.send_signal(signal.SIGTERM)
            assert again.wait(30) == 0
        finally:
            if again.poll() is None:
                again.kill()
        assert sorted((e["event"], e["version"]) for e in events) == [
            ("incomplete", 2),
            *[("skipped", v) for v in (1, 3, 4, 5)],
        ], events
        assert _rest(again) == []  # nothing else came
        assert cluster.status()["last_sync"]["sync_id"] == last


def _step(root: Path, name: str, state, version: int) -> Path:
    """A whole step directory, as a trainer writes it (one safetensors file)."""
    d = root / name
    d.mkdir()
    save_file(dict(perturbed(state, version)), str(d / "model.safetensors"))
    return d


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()


def _finalizing(cluster, version: int) -> bool:
    try:
        st = cluster.status(timeout=1.0)
    except Exception:
        return False
    return st["state"] == "FINALIZING" and (st.get("sync") or {}).get("version") == version


def test_watch_outlives_its_daemon_started_late_killed_and_stopped_mid_push(
    tmp_path, tiny_model_dir, tiny_state
):
    """The watcher starts before its daemon; the daemon is then SIGKILLed mid-push and kept
    down past --timeout, and SIGTERMed mid-push and restarted at once (same address, same
    state DB): every step is pushed, none counted as failed or given up, and each wait
    is one `waiting` event and one `resumed`."""
    root, work = tmp_path / "ckpts", tmp_path / "d"
    root.mkdir()
    addr = f"ipc://{work}/trainer.sock"  # where Cluster(work) binds its daemon
    watcher = _watch(addr, root, "--timeout", "2")
    pushed = lambda ev: [e["version"] for e in ev if e.get("event") == "pushed"]  # noqa: E731
    waits = lambda ev: [e for e in ev if e.get("event") == "waiting"]  # noqa: E731
    try:
        _step(root, "step-1", tiny_state, 1)
        # no daemon yet: the watcher says it waits (today's watcher exits 4 here)
        events = _read_until(watcher, lambda ev: waits(ev), 30)
        assert events[-1]["for"] == "daemon" and events[-1]["code"] in ("UNREACHABLE", "TIMEOUT"), events
        engine_args = ["--failpoint", "finalize_sleep=1"]  # each push spends 1 s FINALIZING
        with running_daemon(work, tiny_model_dir, engines=2, engine_args=engine_args) as cluster:
            events += _read_until(watcher, lambda ev: 1 in pushed(ev), 60)

            # SIGKILL mid-push, the daemon down until the watcher has waited past --timeout
            _step(root, "step-2", tiny_state, 2)
            wait_for(lambda: _finalizing(cluster, 2), 30, "version 2 FINALIZING")
            cluster.daemon.popen.send_signal(signal.SIGKILL)
            cluster.daemon.popen.wait(10)
            n = len(waits(events))
            events += _read_until(watcher, lambda ev: len(waits(events + ev)) > n, 30)
            cluster.start_daemon()
            events += _read_until(watcher, lambda ev: 2 in pushed(ev), 60)

            # SIGTERM mid-push (the daemon fails the sync INTERNAL as it goes), restarted at once
            _step(root, "step-3", tiny_state, 3)
            wait_for(lambda: _finalizing(cluster, 3), 30, "version 3 FINALIZING")
            cluster.daemon.popen.send_signal(signal.SIGTERM)
            assert cluster.daemon.popen.wait(15) == 0
            cluster.start_daemon()
            events += _read_until(watcher, lambda ev: 3 in pushed(ev), 60)
            st = cluster.status()
        assert _stop(watcher) == 0  # nothing refused or given up
    finally:
        if watcher.poll() is None:
            watcher.kill()
    for e in events:  # the watcher's --json output (shown with pytest -s)
        print(json.dumps(e))
    assert pushed(events) == [1, 2, 3], events
    assert not [e for e in events if e["event"] in ("failed", "gave_up", "refused")], events
    # one `waiting` per wait, each ended by a `resumed`, and the kill's wait names the daemon
    kinds = [e["event"] for e in events if e["event"] in ("waiting", "resumed")]
    assert kinds == ["waiting", "resumed"] * (len(kinds) // 2) and len(kinds) >= 4, kinds
    # the SIGKILL's wait and the SIGTERM's name the step whose push the daemon took down
    said = [(e["for"], e["version"]) for e in waits(events)]
    assert ("daemon", 2) in said and ("daemon", 3) in said, said
    assert st["state"] == "READY" and st["version"] == 3
    want = digest(perturbed(tiny_state, 3))
    assert [e["digest"] for e in st["engines"]] == [want, want]


def test_watch_waits_for_a_sharded_steps_index_and_reports_what_it_cannot_read(
    tmp_path, tiny_model_dir, tiny_state
):
    """A sharded step written shard by shard with its index last is pushed once, after
    the index exists; a truncated step is reported (`incomplete`), never pushed."""
    root = tmp_path / "ckpts"
    root.mkdir()
    with running_daemon(tmp_path / "d", tiny_model_dir, engines=1) as cluster:
        watcher = _watch(cluster, root)
        try:
            d = root / "step-1"
            d.mkdir()
            w = dict(perturbed(tiny_state, 1))
            names = sorted(w)
            shards = {
                "model-00001-of-00002.safetensors": names[: len(names) // 2],
                "model-00002-of-00002.safetensors": names[len(names) // 2 :],
            }
            events: list[dict] = []
            for shard, keys in shards.items():
                save_file({k: w[k] for k in keys}, str(d / shard))
                n = len(events)
                # the shard settles with no index beside it: reported, not pushed (today's
                # watcher pushes the first shard alone and the daemon refuses it)
                events += _read_until(watcher, lambda ev: any(e["version"] == 1 for e in ev), 30)
                new = [e for e in events[n:] if e["version"] == 1]
                assert [e["event"] for e in new] == ["incomplete"], events
                assert "no *.safetensors.index.json yet" in new[0]["reason"], new
            index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
            (d / "model.safetensors.index.json").write_text(json.dumps(index))
            events += _read_until(watcher, lambda ev: any(e["event"] == "pushed" for e in ev), 30)

            bad = root / "step-2"
            bad.mkdir()
            blob = save(dict(perturbed(tiny_state, 2)))
            (bad / "model.safetensors").write_bytes(blob[: len(blob) // 2])  # the writer died
            n = len(events)
            events += _read_until(watcher, lambda ev: any(e["version"] == 2 for e in ev), 30)
            assert [e["event"] for e in events[n:]] == ["incomplete"], events
            assert "model.safetensors: not a readable safetensors file" in events[n]["reason"]
            assert _stop(watcher) == 0
        finally:
            if watcher.poll() is None:
                watcher.kill()
        for e in events:
            print(json.dumps(e))
        assert [(e["event"], e["version"]) for e in events if e["event"] != "incomplete"] == [("pushed", 1)]
        st = cluster.status()
        assert st["state"] == "READY" and st["version"] == 1
        # one sync only: nothing was begun before the index existed
        assert [(h["to"], h["version"]) for h in st["history"]] == [
            ("LOADING_BUCKETS", 1),
            ("FINALIZING", 1),
            ("READY", 1),
        ]
        assert [e["digest"] for e in st["engines"]] == [digest(w.items())]


def test_watch_takes_real_trainers_step_names_and_never_pushes_a_tmp_directory(
    tmp_path, tiny_model_dir, tiny_state
):
    """HF Trainer writes `tmp-checkpoint-N` and renames it `checkpoint-N`: only the final
    name is pushed. NeMo's `...-step=N-consumed_samples=M.0`, `step-N-bf16` and
    `global_step_N` are version N."""
    root = tmp_path / "ckpts"
    root.mkdir()
    with running_daemon(tmp_path / "d", tiny_model_dir, engines=1) as cluster:
        watcher = _watch(cluster, root)
        try:
            # tmp-checkpoint-2 is whole before step-1 is begun: any scan that finds step-1
            # complete finds it complete too (today's watcher pushes it right after step-1)
            _step(root, "tmp-checkpoint-2", tiny_state, 2)
            _step(root, "step-1", tiny_state, 1)
            events = _read_until(watcher, lambda ev: any(e["event"] == "pushed" for e in ev), 30)
            (root / "tmp-checkpoint-2").rename(root / "checkpoint-2")
            events += _read_until(watcher, lambda ev: any(e["event"] == "pushed" for e in ev), 30)
            _step(root, "megatron_gpt--val_loss=1.23-step=3-consumed_samples=96.0", tiny_state, 3)
            _step(root, "step-4-bf16", tiny_state, 4)
            _step(root, "global_step_5", tiny_state, 5)
            events += _read_until(watcher, lambda ev: any(e.get("version") == 5 for e in ev), 60)
            rc = _stop(watcher)
        finally:
            if watcher.poll() is None:
                watcher.kill()
        for e in events:
            print(json.dumps(e))
        assert [(e["event"], e["version"], Path(e["path"]).name) for e in events] == [
            ("pushed", 1, "step-1"),
            ("pushed", 2, "checkpoint-2"),
            ("pushed", 3, "megatron_gpt--val_loss=1.23-step=3-consumed_samples=96.0"),
            ("pushed", 4, "step-4-bf16"),
            ("pushed", 5, "global_step_5"),
        ]
        assert rc == 0
        st = cluster.status()
        assert st["state"] == "READY" and st["version"] == 5
        assert [e["digest"] for e in st["engines"]] == [digest(perturbed(tiny_state, 5))]
