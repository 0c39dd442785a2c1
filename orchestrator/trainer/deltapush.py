"""A delta push (`TrainerClient.push(delta=True)`): each tensor sent as a patch against
the copy of what this trainer pushed last, when that pays, else dense.

Rules: the first delta push, or one the daemon refuses (STALE_BASE: the fleet no longer
serves our copy's version, an engine keeps no base), goes dense in the same call (a new
sync) and says so; a push that fails otherwise leaves the copy as it was. Over a
transport where delta pushes measured slower than dense ones (`DeltaChooser`), it goes
dense and says why. The result's `detail["delta"]` says what was sent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from messages.cuts import Planned
from messages.delta import Mode
from messages.errors import ErrorCode, WeightSyncError
from messages.liblog import get_logger
from messages.replies import JsonObject
from orchestrator.trainer.delta import DeltaBase, DeltaChooser, DeltaStats
from orchestrator.trainer.results import SyncResult

if TYPE_CHECKING:
    import torch

    from messages.buckets import Cast
    from orchestrator.trainer.options import PushArgs

log = get_logger("trainer")
# the client's one push: (named tensors, version, sync_id=, base=, and the push's options)
Push = Callable[..., SyncResult]


def push_delta(
    push: Push,
    base: DeltaBase,
    pace: DeltaChooser,
    named_tensors: Iterable[tuple[str, torch.Tensor | Cast]],
    version: int,
    *,
    sync_id: str | None,
    transport: str,
    delta_mode: Mode,
    kw: PushArgs,
) -> SyncResult:
    reiterable = not isinstance(named_tensors, Iterator)
    against = base.version
    go, why = pace.choose(transport) if delta_mode == "auto" else (True, f"delta_mode {delta_mode}")
    refused: JsonObject = {}
    if against is not None and go:
        base.stats = DeltaStats()
        planned = Planned()  # engines whose ranks take boxes get each box patched
        try:
            result = push(
                base.encode(named_tensors, delta_mode, planned),
                version,
                sync_id=sync_id,
                base=against,
                planned=planned,
                **kw,
            )
        except WeightSyncError as err:
            base.rollback()
            if err.code is not ErrorCode.STALE_BASE:
                raise
            base.forget()
            if not reiterable and base.stats.tensors:  # consumed: the caller pushes again
                raise
            log.warning("delta_refused", version=version, reason=err.message)
            why = f"the daemon refused a delta: {err.message}"
            refused = {"refused": {"base": against, "message": err.message, **err.details}}
            sync_id = None  # the dense push is a new sync
        except BaseException:
            base.rollback()
            raise
        else:
            base.commit(version)
            pace.record(
                transport, result.detail["transport"], "delta", result.seconds, base.stats.dense_bytes
            )
            result.detail["delta"] = {"base": against, "chose": "delta", "why": why, **base.stats.view()}
            return result
    elif against is None:
        why = "no copy of the served version yet"
    try:
        result = push(base.record(named_tensors), version, sync_id=sync_id, **kw)
    except BaseException:
        base.forget()
        raise
    base.commit(version)
    pace.record(transport, result.detail["transport"], "dense", result.seconds, result.bytes)
    result.detail["delta"] = {"base": None, "chose": "dense", "why": why, **refused, **base.stats.view()}
    return result
