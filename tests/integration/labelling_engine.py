"""A labelling engine in a process of its own, for tests of the commit phase: a sink engine
that labels its outputs with the version (as vLLM's engine does, `set_label`), run by the
engine `Worker` against a real daemon. vLLM is not needed to have the daemon send `commit`
and wait for `committed`.

argv: MODEL_DIR CONNECT ENGINE_ID MODE, where MODE says what it does when told `commit`:
- `label`: sets the label and answers at once;
- `slow=S`: takes S seconds to set it (a label round trip that takes time);
- `kill`: SIGKILLs itself (lost after its finalize, before the commit completed);
- `hang`: never answers (its heartbeats go on: the daemon's --finalize-timeout ends the sync).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from examples.launch import Cluster, Proc
from messages.checkpoint import checkpoint_spec
from orchestrator.daemon.config import child_env

ROOT = Path(__file__).resolve().parents[2]  # run with -m from here: the checkout imports


def start_labeller(cluster: Cluster, engine_id: str, mode: str) -> Proc:
    """Start one labelling engine on `cluster`'s engine socket; `cluster.stop()` stops it."""
    cluster.log_dir.mkdir(parents=True, exist_ok=True)
    log_path = cluster.log_dir / f"{engine_id}.log"
    with open(log_path, "ab") as fh:
        popen = subprocess.Popen(
            [sys.executable, "-m", __name__, str(cluster.model_dir), cluster.engine_addr, engine_id, mode],
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env({"PYTHONUNBUFFERED": "1"}),
            start_new_session=True,
            cwd=ROOT,
        )
    proc = Proc(engine_id, popen, log_path)
    cluster.procs.append(proc)
    return proc


def main(model_dir: str, connect: str, engine_id: str, mode: str) -> None:
    from engines.sink import SinkEngine
    from engines.worker import Worker

    class LabellingSink(SinkEngine):
        backend = "labelling-sink"

        def __init__(self) -> None:
            super().__init__(model_dir, list(checkpoint_spec(model_dir).values()))
            self.label = ""

        def set_label(self, label: str) -> str:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "hang":
                threading.Event().wait()
            if mode.startswith("slow="):
                time.sleep(float(mode.split("=", 1)[1]))
            self.label = label
            return label

    worker = Worker(LabellingSink(), connect, engine_id, heartbeat_interval=0.5)
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop())
    worker.run()


if __name__ == "__main__":
    main(*sys.argv[1:5])
