"""`weightsync watch`: a writer process creates step directories as a trainer in
filesystem mode does (one complete, one never completed, one written slowly, two out of
order); the real watcher pushes each complete one as its version through a real daemon
into two torch engines, in order, once, and pushes nothing again after a restart."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from examples.tiny import perturbed
from messages.buckets import digest

from .helpers import running_daemon

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
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "watch",
            str(root),
            "--addr",
            cluster.addr,
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


def _read_until(proc: subprocess.Popen, want, timeout: float) -> list[dict]:
    """Events from the watcher's stdout until `want(events)` holds."""
    events: list[dict] = []
    deadline = time.monotonic() + timeout
    while not want(events):
        assert time.monotonic() < deadline, f"not within {timeout}s: {events}"
        line = proc.stdout.readline()
        assert line, f"watcher exited {proc.poll()}: {events} {proc.stderr.read()[-2000:]}"
        events += _events([line])
    return events


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
        # the incomplete step-2 was never pushed; step-3 only once whole
        assert not [e for e in events if e["version"] == 2], events
        st = cluster.status()
        assert st["state"] == "READY" and st["version"] == 5
        want = digest((k, t.contiguous()) for k, t in perturbed(tiny_state, 5))
        assert {e["digest"] for e in st["engines"]} == {want}
        assert [h["version"] for h in st["history"] if h["to"] == "READY"] == [1, 3, 5]
        last = st["last_sync"]["sync_id"]

        # a restart pushes nothing again: every directory there is served already
        again = _watch(cluster, root)
        try:
            events = _read_until(again, lambda ev: len(ev) == 4, 60)
            again.send_signal(signal.SIGTERM)
            assert again.wait(30) == 0
        finally:
            if again.poll() is None:
                again.kill()
        assert sorted(e["version"] for e in events) == [1, 3, 4, 5], events
        assert {e["event"] for e in events} == {"skipped"}, events
        assert _events(again.stdout.read().splitlines()) == []  # nothing else came
        assert cluster.status()["last_sync"]["sync_id"] == last
