"""A trainer on a lab host, driven by the test over its stdin and stdout (one JSON object
a line each way): the test's own process sits outside every lab namespace, so what a
trainer does on its host, this process does for it.

A push's weights are `examples.tiny.perturbed` for its version (`"change": "all"`) or a
small step from the last push (`"sparse"`: 50 elements of 3 tensors); `"delta": true`
sends it as a delta, through the client named by `"client"` (kept across pushes: it
holds the base copy). Requests, each with an "id" its answer carries: {"op": "push",
"version": V, "transport": T, "bucket_bytes": B, "timeout": S, ...}, {"op": "status"},
{"op": "quit"}; `"source": [k, n]` pushes this trainer's part of a sharded push (the
version's tensors k, k+n, ... in name order) as source k of n. Pushes run one after another on one thread (a kept client is used by the
thread that made it only); each status on a thread of its own, so one can be asked while
a push runs. Each answer: {"ok": true, "result": ..., "seconds": S} or
{"ok": false, "code": CODE, "message": M, "seconds": S}. Started as
`python -m tests.lab.agent MODEL_DIR DAEMON_ADDR [HOST]` (HOST: its address for a group's
store).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from engines.torch_engine import load_model
from examples.tiny import perturbed
from messages.errors import WeightSyncError
from orchestrator.trainer.client import TrainerClient
from tests.integration.helpers import small_step


def main(argv: list[str]) -> int:
    # its stderr is the fleet's agent.log: the library's log, and every thread's stack when
    # the test sends SIGUSR1 (a push that does not answer)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    model_dir, addr = argv[0], argv[1]
    host = argv[2] if len(argv) > 2 else ""
    state = {k: v.detach().clone() for k, v in load_model(model_dir).state_dict().items()}
    current = dict(state)  # what this trainer pushed last (a sparse step starts from it)
    lock = threading.Lock()
    clients: dict[str, TrainerClient] = {}  # a delta push keeps its base copy in its client

    def weights(req: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The version's weights: every element perturbed ("all"), or a small step from
        the last push ("sparse": a few elements of a few tensors)."""
        v = int(req["version"])
        if req.get("change", "all") == "sparse":
            return small_step(current, seed=v)
        return dict(perturbed(state, v))

    def say(answer: dict[str, Any]) -> None:
        with lock:
            sys.stdout.write(json.dumps(answer, default=str) + "\n")
            sys.stdout.flush()

    def serve(req: dict[str, Any]) -> None:
        t0 = time.monotonic()
        op = req.get("op")
        try:
            if op == "push":
                timeout = float(req.get("timeout", 30.0))
                w = weights(req)
                source = req.get("source")
                src = (int(source[0]), int(source[1])) if source else None
                mine = w if src is None else {n: w[n] for n in sorted(w)[src[0] :: src[1]]}
                keep = str(req.get("client", ""))  # a named client lives on (its delta base)
                c = clients.get(keep) if keep else None
                if c is None:
                    c = TrainerClient(
                        addr,
                        timeout=timeout,
                        finish_timeout=timeout,
                        retries=int(req.get("retries", 3)),
                        collective_host=host,
                    )
                    if keep:
                        clients[keep] = c
                try:
                    r = c.push(
                        mine.items(),
                        int(req["version"]),
                        bucket_bytes=int(req.get("bucket_bytes", 256 << 10)),
                        transport=str(req.get("transport", "auto")),
                        rollback_wait=float(req.get("rollback_wait", 120.0)),
                        engines_wait=float(req.get("engines_wait", 0.0)),
                        delta=bool(req.get("delta", False)),
                        source=src,
                    )
                finally:
                    if not keep:
                        c.close()
                current.clear()
                current.update(w)
                result: Any = {
                    "state": r.state,
                    "digest": r.digest,
                    "detail": r.detail,
                    "seconds": r.seconds,
                    "bytes": r.bytes,
                }
            elif op == "status":
                with TrainerClient(addr, timeout=float(req.get("timeout", 5.0)), retries=0) as c:
                    result = c.status()
            else:
                raise ValueError(f"unknown op {op!r}")
            answer: dict[str, Any] = {"ok": True, "result": result}
        except WeightSyncError as exc:
            answer = {"ok": False, "code": exc.code.value, "message": str(exc)}
        except Exception as exc:  # the test reads the failure; the agent serves on
            answer = {"ok": False, "code": type(exc).__name__, "message": str(exc)}
        answer["id"], answer["seconds"] = req.get("id"), time.monotonic() - t0
        say(answer)

    pushes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pushes")
    say({"ready": True})
    for line in sys.stdin:
        req: dict[str, Any] = json.loads(line)
        if req.get("op") == "quit":
            break
        if req.get("op") == "push":
            pushes.submit(serve, req)
        else:
            threading.Thread(target=serve, args=(req,), daemon=True).start()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
