"""verl's checkpoint engine over weightsync: `backend: weightsync` with
`custom_backend_module: orchestrator.trainer.verl` (verl imports this module on every
worker, which registers the class).

    actor_rollout_ref.rollout.checkpoint_engine:
      backend: weightsync
      custom_backend_module: orchestrator.trainer.verl
      engine_kwargs:
        weightsync: {addr: "tcp://daemon:5555", engine_addr: "tcp://daemon:5556",
                     model: /path/to/hf/checkpoint}

Rules:
- One class, two sides, as verl builds it: on the actor (verl passes `is_master`),
  `send_weights` on the master rank is one weightsync push of what the actor yields, as
  version `global_steps` (or the next one when verl gives none), and returns only when
  every engine committed it; any failure raises (a `WeightSyncError` with its code; a
  version that does not move forward is refused with STALE_VERSION, nothing sent). The
  other actor ranks drain the iterator (they take part in its gathers).
- On a rollout worker (verl passes no `is_master`), the instance runs a holding engine
  (`engines.holding`) registered with the daemon at `engine_addr`; `receive_weights`
  yields what it received only once the daemon made the version its served version (its
  `served` notice, sent after the READY is journaled), so verl's server adapter never sees
  a version whose sync failed, in its commit phase included (it raises ABORTED instead).
  The next sync waits until the adapter has read the tensors.
- `prepare`, `build_topology`, `init_process_group` and `finalize` exchange nothing: the
  daemon is the rendezvous and its fan-out the data path.
- What stays verl's: the load into its inference server (`server_adapter.update_weights`)
  and that server's post-load step; weightsync's digest covers the tensors the holding
  engine received, not what the server holds after its own load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator
from typing import TYPE_CHECKING, Unpack

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from engines.holding import HoldingReceiver
from orchestrator.trainer.client import ClientOptions, TrainerClient

if TYPE_CHECKING:
    import torch

    # what verl's actor hands `send_weights`: (name, tensor) pairs, from a generator or an
    # async one
    Weights = Iterable[tuple[str, torch.Tensor]] | AsyncGenerator[tuple[str, torch.Tensor], None]

_END = object()


def _sync_iter(weights: Weights, loop: asyncio.AbstractEventLoop) -> Iterator[tuple[str, torch.Tensor]]:
    """verl's weights as a plain iterator for the push thread (an async iterator is
    stepped on the caller's loop)."""
    if hasattr(weights, "__anext__"):
        while True:
            try:
                yield asyncio.run_coroutine_threadsafe(weights.__anext__(), loop).result()
            except StopAsyncIteration:
                return
    else:
        yield from weights


# verl is not installed where mypy runs (pyproject: ignore_missing_imports for verl.*), so
# CheckpointEngine is untyped; a backend must subclass it to register.
@CheckpointEngineRegistry.register("weightsync")
class WeightSyncCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    def __init__(
        self,
        bucket_size: int,
        is_master: bool | None = None,
        *,
        addr: str = "tcp://127.0.0.1:5555",
        engine_addr: str | None = None,
        model: str | None = None,
        engine_id: str | None = None,
        timeout: float = 600.0,
        transport: str = "auto",
        **client_options: Unpack[ClientOptions],
    ) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.addr = addr
        self.timeout = timeout
        self.transport = transport
        self.client_options = client_options
        self.client: TrainerClient | None = None
        self.receiver: HoldingReceiver | None = None
        self.version: int | None = None  # the last version this side pushed or read
        if is_master is None:  # verl's rollout side
            if engine_addr is None or model is None:
                raise ValueError("weightsync rollout side needs engine_kwargs engine_addr and model")
            self.receiver = HoldingReceiver(model, engine_addr, engine_id, timeout=timeout)

    # -- the steps verl's CheckpointEngineManager runs around every update ----------------
    def prepare(self) -> dict[str, object]:
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, object]]
    ) -> tuple[dict[str, list[object]], dict[str, list[object]]]:
        return {}, {}

    def init_process_group(self, **kwargs: object) -> None:
        return None

    def finalize(self) -> None:
        return None

    # -- actor side --------------------------------------------------------------------------
    def _push(
        self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None
    ) -> dict[str, int | float]:
        if self.client is None:
            self.client = TrainerClient(self.addr, timeout=self.timeout, **self.client_options)
        version = self.client.next_version(self.version) if global_steps is None else int(global_steps)
        t0 = time.perf_counter()
        r = self.client.push(weights, version, bucket_bytes=self.bucket_size, transport=self.transport)
        self.version = r.version
        return {
            "weightsync/version": r.version,
            "weightsync/seconds": time.perf_counter() - t0,
            "weightsync/bytes": r.bytes,
            "weightsync/engines": len(r.engines),
        }

    async def send_weights(self, weights: Weights, global_steps: int | None = None) -> dict[str, int | float]:
        loop = asyncio.get_running_loop()
        if not self.is_master:
            await asyncio.to_thread(lambda: [None for _ in _sync_iter(weights, loop)])
            return {}
        return await asyncio.to_thread(self._push, _sync_iter(weights, loop), global_steps)

    # -- rollout side ------------------------------------------------------------------------
    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        if self.receiver is None:
            raise RuntimeError("receive_weights runs on verl's rollout side (built without is_master)")
        it = self.receiver.read(global_steps)
        first = await asyncio.to_thread(next, it, _END)  # waits for the daemon's `served`
        if first is _END:
            return
        yield first  # type: ignore[misc]
        for item in it:  # held in memory now: nothing blocks
            yield item
        self.version = self.receiver.last_read

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
