"""weightsync as a vLLM weight-transfer backend (`WeightTransferEngineFactory`).

A vLLM server started with `--weight-transfer-config '{"backend": "weightsync"}'` takes
updates through its own routes: `/init_weight_transfer_engine`, `/start_weight_update`,
`/update_weights` (one call per bucket), `/finish_weight_update`. The bytes of each bucket
come by broadcast from the trainer over the group the orchestrator planned
(`update_info.group`), into one receive buffer per worker; nothing but metadata crosses
HTTP. The orchestrator still decides begin, finalize-once, commit and rollback: vLLM's
own guard refuses a `finish` without a `start`, and the digest is read back through the
extension (`ws_native_info`), exactly as for the extension's own path.

Registered by the `vllm.general_plugins` entry point (`register`), which vLLM runs in
every process it starts, workers included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from messages.buckets import Digester

if TYPE_CHECKING:
    from engines.vllm.extension import MacWire, TransferInfo
    from engines.vllm.loading import TensorWire
    from messages.distgroup import Member
    from messages.replies import JsonObject

BACKEND = "weightsync"


# vLLM is skipped by mypy (pyproject: follow_imports = "skip"), so its base classes are Any;
# subclassing them is how a backend registers, hence the three `ignore[misc]` below.
@dataclass
class WeightSyncInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    """Body of `/init_weight_transfer_engine`: this host's address for the group sockets."""

    bind: str = ""


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """Body of one `/update_weights`: a bucket announced by the orchestrator."""

    sync_id: str = ""
    group: JsonObject = field(default_factory=dict)  # the group's wire form (`GroupRef.to_wire()`)
    size: int = 0
    checksum: int = 0
    tensors: list[TensorWire] = field(default_factory=list)
    seq: int = 0
    mac: MacWire | None = None  # with keys: [key hex, source, tag hex] (engines/vllm/extension.py)


class WeightSyncTransferEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):  # type: ignore[misc]
    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.member: Member | None = None
        self.bind = ""
        self.digester: Digester | None = None
        self.digest: str | None = None
        self.finalize_count = 0
        self.loaded = 0
        self.seconds = 0.0

    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        from messages.distgroup import Member

        self.bind = init_info.bind
        self.member = Member(self.bind, rank_offset=int(getattr(self.parallel_config, "rank", 0) or 0))

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self.digester, self.digest, self.loaded = Digester(), None, 0

    def update_weights(self, update_info: JsonObject) -> None:
        # The base class ends with torch.accelerator.synchronize(); on a CPU-only build there
        # is no accelerator to wait for (the broadcast already completed), so skip it there.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, info: WeightSyncUpdateInfo) -> None:
        if self.member is None or self.digester is None:
            raise RuntimeError("update_weights before init_weight_transfer_engine / start_weight_update")
        t0 = time.perf_counter()
        buf = self.member.receive(info.group, info.size)
        from engines.vllm.extension import verify_mac, verify_received
        from engines.vllm.loading import load_into

        verify_mac(buf, info.seq, info.mac)
        parts = verify_received(buf, info.tensors, info.checksum)
        load_into(
            self.model,
            buf,
            info.tensors,
            self.digester,
            layerwise=True,  # started in
            parts=parts,
        )  # start_weight_update
        self.loaded += len(info.tensors)
        self.seconds += time.perf_counter() - t0

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self.finalize_count += 1
        self.digest = self.digester.hexdigest() if self.digester is not None else None
        self.digester = None

    def info(self) -> TransferInfo:
        return {
            "digest": self.digest,
            "finalize_count": self.finalize_count,
            "loaded": self.loaded,
            "seconds": self.seconds,
            "backend": BACKEND,
        }

    def shutdown(self) -> None:
        if self.member is not None:
            self.member.close()
            self.member = None


def register() -> None:
    """vLLM plugin entry point: make `backend: weightsync` known to the factory."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "WeightSyncTransferEngine")
