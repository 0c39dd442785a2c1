"""weightsync as the trainer half of vLLM's own RL weight-transfer API: a framework that
drives `WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)` and
`send_weights()` selects weightsync by passing a `WeightSyncTrainerInitInfo`, nothing else.

    from orchestrator.trainer.vllm_native import WeightSyncTrainerInitInfo
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(addr="tcp://daemon:5555", rank=rank),
        client=client, source=ModuleSource(model))
    engine.send_weights()   # every rank, every step: READY on every engine, or a raise

Rules:
- Importing this module registers the engine as `weightsync` in vLLM's trainer factory
  (`register()`, idempotent): a trainer process never runs vLLM's general plugins, and the
  caller imports the init info from here anyway. The worker half (engines/vllm/transfer.py)
  has the same name in vLLM's other factory.
- `trainer_init` connects to the weightsync daemon instead of rendezvousing with each
  server; it learns the version the fleet serves. `send_weights()` is one push of the
  source as the next version (or `version=`): it returns when every engine is READY at it
  (each finalized once, digests equal, canaries if given) and raises otherwise (a
  `WeightSyncError` with its code: the daemon rolled the fleet back to the served version).
- The framework's `client` (vLLM's per-server control plane: init / start / update /
  finish over HTTP or Ray) is kept but never called. Each server is driven by its own
  weightsync engine (`weightsync engine --backend vllm-server`), which already calls those
  routes for every sync, and vLLM's worker refuses a second `start_weight_update` while one
  is active; the daemon, not the trainer, labels the committed version.
- Ranks, as vLLM's contract has it (`send_weights` on every trainer rank, in lockstep):
  with a source that holds everything (`held_names()` None), rank 0 pushes and the others
  only iterate the source (its gathers need them). With a source whose ranks hold parts
  (`held_names()` a set), every rank is one source of a single sharded push and sends the
  names it holds; a name several ranks hold is sent by the lowest of them (learned once,
  over torch.distributed when it is initialized; without it the parts must be disjoint,
  else the daemon refuses the push with DUPLICATE_TENSOR). `world_size` 0 means
  torch.distributed's (1 without it).
- Names are the checkpoint's: training wrappers' components are dropped (`hf_name`).
  vLLM's `ModuleSource` yields parameters only: a persistent buffer the engines hold is
  then missing and the push fails with INCOMPLETE_SYNC unless `partial=True`.
- A failure on the sending rank stops its iteration; the other ranks' gathers (FSDP's
  `full_tensor`) are then left waiting on it, as with vLLM's own engines: the framework's
  step fails on rank 0 and it must tear the group down.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from messages.buckets import Cast
from messages.keys import client_keys
from messages.schema import DEFAULT_ADDR, DEFAULT_BUCKET_BYTES, Probe
from orchestrator.trainer.client import TrainerClient
from orchestrator.trainer.module import hf_name

if TYPE_CHECKING:
    from orchestrator.trainer.results import SyncResult

BACKEND = "weightsync"

Probes = Sequence[Probe] | Callable[[], Sequence[Probe]]


class _Source(Protocol):
    """What this engine uses of vLLM's `WeightSource` (vLLM is not type-checked here)."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]: ...

    def held_names(self) -> Collection[str] | None: ...

    def metadata(self) -> list[object]: ...


# vLLM is skipped by mypy (pyproject: follow_imports = "skip"), so its base classes are Any;
# subclassing them is how a trainer engine registers, hence the `ignore[misc]` below.
@dataclass
class WeightSyncTrainerInitInfo(TrainerInitInfo):  # type: ignore[misc]
    """The trainer side of `backend: weightsync`: where the daemon is and how to push.
    Nothing of it goes to the vLLM servers (their weightsync engines hold that handshake)."""

    backend: ClassVar[str] = BACKEND
    addr: str = DEFAULT_ADDR  # the daemon's trainer address
    transport: str = "auto"  # "auto" or a transport's name ("collective": vLLM's own routes)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    window: int | None = None  # buckets in flight (None: sized from measurements)
    dtype: str | None = None  # cast floating tensors while packing ("bfloat16"), no copy
    partial: bool = False  # the source leaves out tensors the engines hold, on purpose
    delta: bool = False  # patches against the served version (one source only)
    probes: Probes = ()  # canaries every engine must answer (a callable: called per push)
    world_size: int = 0  # trainer ranks (0: torch.distributed's, 1 without it)
    timeout: float = 30.0
    finish_timeout: float = 900.0
    keys: str = ""  # a CURVE key directory (`weightsync keys`): this trainer's key in it
    key_name: str = "trainer"
    collective_host: str = ""  # this host's address for a group's store (collective)
    extra: dict[str, object] = field(default_factory=dict)  # kept for the framework's own use


def _world(info: WeightSyncTrainerInitInfo) -> int:
    if info.world_size > 0:
        return info.world_size
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _owned(held: Collection[str], rank: int, world: int) -> frozenset[str]:
    """The names this rank sends: those it holds that no lower rank holds (over
    torch.distributed when it runs; else what it holds, the parts being disjoint)."""
    dist = torch.distributed
    if world == 1 or not (dist.is_available() and dist.is_initialized()):
        return frozenset(held)
    everyone: list[list[str] | None] = [None] * world
    dist.all_gather_object(everyone, sorted(held))
    lower = {n for part in everyone[:rank] for n in part or ()}
    return frozenset(n for n in held if n not in lower)


class WeightSyncTrainerEngine(TrainerWeightTransferEngine):  # type: ignore[misc]
    """vLLM's `TrainerWeightTransferEngine` over a weightsync daemon (module docstring)."""

    init_info_cls = WeightSyncTrainerInitInfo

    def __init__(
        self,
        *,
        client: object,
        source: _Source,
        is_sender: bool,
        init_info: WeightSyncTrainerInitInfo,
        pusher: TrainerClient | None,
        owned: frozenset[str] | None,
        world: int,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info
        self.pusher = pusher  # None on a rank that only takes part in the gathers
        self.owned = owned  # a sharded push: the names this rank sends (None: one sender)
        self.world = world
        self.version: int | None = None  # the version last committed (None: none yet)
        self.last: SyncResult | None = None  # the last push's result

    @classmethod
    def trainer_init(
        cls, init_info: WeightSyncTrainerInitInfo, *, client: object = None, source: _Source | None = None
    ) -> WeightSyncTrainerEngine:
        # vLLM's factory passes every argument by keyword: the first must be `init_info`
        if not isinstance(init_info, WeightSyncTrainerInitInfo):
            raise TypeError(
                f"backend {BACKEND!r} takes a WeightSyncTrainerInitInfo, not {type(init_info).__name__}"
            )
        if source is None:
            raise ValueError(
                f"backend {BACKEND!r} pushes a WeightSource: pass source= (e.g. ModuleSource(model))"
            )
        world = _world(init_info)
        if not 0 <= init_info.rank < world:
            raise ValueError(f"rank {init_info.rank} of world_size {world}: need 0 <= rank < world_size")
        held = source.held_names()
        owned = None if held is None else _owned(held, init_info.rank, world)
        if owned is not None and world > 1 and init_info.delta:
            raise ValueError("delta=True takes one source: a source that holds parts pushes dense")
        pusher = None
        if init_info.is_sender or owned is not None:
            pusher = TrainerClient(
                init_info.addr,
                timeout=init_info.timeout,
                finish_timeout=init_info.finish_timeout,
                keys=client_keys(init_info.keys, init_info.key_name) if init_info.keys else None,
                collective_host=init_info.collective_host,
            )
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            init_info=init_info,
            pusher=pusher,
            owned=owned,
            world=world,
        )
        if pusher is not None:
            engine.version = pusher.fleet().last_ready_version
        return engine

    def _pairs(self) -> Iterator[tuple[str, torch.Tensor | Cast]]:
        """The source's pairs this rank sends, under checkpoint names (every rank iterates
        the whole source: its gathers run in lockstep)."""
        dtype = getattr(torch, self.init_info.dtype) if self.init_info.dtype else None
        for raw, t in self.source:
            if t is None or (self.owned is not None and raw not in self.owned):
                continue  # not held here, or a lower rank sends it
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                yield hf_name(raw), Cast(t.detach(), dtype)
            else:
                yield hf_name(raw), t.detach()

    def send_weights(self, version: int | None = None) -> None:
        """One push of the source as `version` (default: the next after what this engine
        and the fleet last committed); returns when every engine is READY at it."""
        self.source.metadata()  # may itself be a collective (vLLM's contract): every rank
        pusher = self.pusher
        if pusher is None:  # a rank of a one-sender push: take part in the gathers only
            for _ in self._pairs():
                pass
            return
        info = self.init_info
        v = version if version is not None else pusher.next_version(self.version)
        probes = tuple(info.probes() if callable(info.probes) else info.probes)
        sharded = self.owned is not None and self.world > 1
        self.last = pusher.push(
            self._pairs(),
            v,
            transport=info.transport,
            bucket_bytes=info.bucket_bytes,
            window=info.window,
            probes=probes,
            partial=info.partial,
            delta=info.delta,
            source=(info.rank, self.world) if sharded else None,
        )
        self.version = self.last.version

    def shutdown(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
            self.pusher = None


def register() -> None:
    """Make `backend: weightsync` known to vLLM's trainer factory (idempotent)."""
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, WeightSyncTrainerEngine)


register()
