"""TRL's weight-transfer protocol over weightsync: `WeightSyncTransfer(addr)` is the object
an AsyncGRPO-style trainer calls (`init_weight_transfer`, `pause`, `send_weights`,
`resume`, `destroy`), so its weight syncs get weightsync's guarantees.

Rules:
- `send_weights(iterator)` streams the (name, tensor) pairs in order as one push of the
  next version and returns only when every engine is READY at it (each finalized once,
  digests equal, canaries if given); any failure raises (a `WeightSyncError` with its
  code), never a silent return; the client's deadlines bound every wait, so it never
  hangs. `.version` is the version it last committed: the label vLLM engines put on what
  they generate from then on.
- `pause` and `resume` send nothing: a weightsync engine pauses its own server for the
  sync (`weightsync engine --pause-mode`) and resumes it once its post-load step ran, so
  no request sees half-loaded weights whatever the trainer does between the calls.
- Versions continue from what the fleet serves: a trainer restarted against a running
  fleet commits the next version, never one it already served.
- This module imports no TRL: the protocol is structural.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from orchestrator.trainer.client import SyncResult, TrainerClient


class WeightSyncTransfer:
    def __init__(
        self,
        addr: str,
        *,
        delta: bool = False,
        transport: str = "auto",
        bucket_bytes: int | None = None,
        window: int | None = None,
        probes: Any = (),
        **client_options: Any,
    ) -> None:
        self.addr = addr
        self.client_options = client_options
        self.push_options: dict[str, Any] = {"transport": transport, "window": window, "probes": probes}
        if bucket_bytes is not None:
            self.push_options["bucket_bytes"] = bucket_bytes
        self.delta = delta
        self.client: TrainerClient | None = None
        self.version: int | None = None  # the version last committed (None: none yet)
        self.last: SyncResult | None = None

    def init_weight_transfer(self) -> None:
        """Connect to the daemon and learn the version the fleet serves."""
        if self.client is None:
            self.client = TrainerClient(self.addr, **self.client_options)
        self.version = self.client.fleet().last_ready_version

    def pause(self) -> None:
        """Nothing to send: each engine pauses its own server during the sync."""

    def resume(self) -> None:
        """Nothing to send: each engine resumed when its post-load step ran."""

    def send_weights(self, iterator: Iterable[tuple[str, Any]]) -> None:
        """One push of the next version; returns when every engine is READY at it."""
        if self.client is None:
            self.init_weight_transfer()
        client = self.client
        if client is None:  # init_weight_transfer sets it; for the type checker
            raise RuntimeError("weightsync client not connected")
        r = client.push(iterator, client.next_version(self.version), delta=self.delta, **self.push_options)
        self.version, self.last = r.version, r

    def destroy(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
