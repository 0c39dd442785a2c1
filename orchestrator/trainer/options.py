"""The options a trainer passes through (`TrainerClient`'s, `push`'s as wrappers pass
them on), typed once, and what `push_module` needs of a client: below the client, so the
modules that wrap a push (module, lora, watch, the delta push) name them without
importing the client.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, TypedDict, Unpack

import zmq

from messages import schema
from messages.delta import Mode
from messages.keys import ClientKeys
from orchestrator.trainer.stream import Progress

if TYPE_CHECKING:
    import torch

    from messages.buckets import Cast
    from orchestrator.trainer.results import SyncResult
    from orchestrator.trainer.shard import ShardPlans


class PushOptions(TypedDict, total=False):
    """`push`'s options as a caller that wraps it passes them on (`Watcher.push_options`):
    how the tensors travel, not which tensors they are."""

    bucket_bytes: int
    window: int | None
    probes: Sequence[schema.Probe]
    sync_id: str | None
    abort_on_error: bool
    progress: Progress | None
    transport: str
    rollback_wait: float
    engines_wait: float
    delta_mode: Mode


class AdapterPushOptions(PushOptions, total=False):
    """`push_adapter`'s options: PushOptions and `delta` (an adapter push is partial)."""

    delta: bool


class ModulePushOptions(AdapterPushOptions, total=False):
    """`push_module`'s options: AdapterPushOptions and `partial` (a `filter` leaving
    tensors out)."""

    partial: bool


class ModuleCallOptions(ModulePushOptions, total=False):
    """`TrainerClient.push_module`'s options: ModulePushOptions and the sharding
    (`orchestrator.trainer.module.push_module`'s `sharded`, `source`)."""

    sharded: bool
    source: tuple[int, int] | None


class ClientOptions(TypedDict, total=False):
    """`TrainerClient`'s options as an adapter passes them on (verl's sets `timeout`)."""

    retries: int
    finish_timeout: float
    ctx: zmq.SyncContext | None
    source: int
    keys: ClientKeys | None
    connect_timeout: float
    collective_host: str


class ConnectOptions(ClientOptions, total=False):
    """ClientOptions and `timeout` (TRL's transfer passes them all on)."""

    timeout: float


class PushArgs(TypedDict):
    """What `push` hands its one dense or delta push (`_push`), besides the tensors."""

    bucket_bytes: int
    window: int | None
    probes: Sequence[schema.Probe]
    abort_on_error: bool
    progress: Progress | None
    transport: str
    rollback_wait: float
    partial: bool
    engines_wait: float
    source: tuple[int, int] | None
    plan: int | None


class Pusher(Protocol):
    """What `push_module` and `push_adapter` use of a `TrainerClient`."""

    plans: ShardPlans

    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor | Cast]],
        version: int,
        *,
        source: tuple[int, int] | None = None,
        plan: int | None = None,
        **kw: Unpack[ModulePushOptions],
    ) -> SyncResult: ...
