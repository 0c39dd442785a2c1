"""The daemon's states (one sync at a time) and an engine's lifecycle states."""

from __future__ import annotations

from enum import Enum


class State(str, Enum):
    IDLE = "IDLE"  # no verified version served (start, or after a failure: dirty)
    LOADING_BUCKETS = "LOADING_BUCKETS"  # buckets of one sync are being applied
    FINALIZING = "FINALIZING"  # every engine runs its post-load step, once
    READY = "READY"  # every live engine serves the version, digest verified


ACTIVE = [State.LOADING_BUCKETS, State.FINALIZING]


class EngineState(str, Enum):
    """An engine's lifecycle (core.table.ENGINE_ROWS)."""

    STALE = "STALE"  # holds no verified version (new, failed, or mid-sync when it broke)
    JOINING = "JOINING"  # being brought to the served version from the spool
    LOADING = "LOADING"  # a participant of the running sync
    FINALIZING = "FINALIZING"  # told to run its post-load step
    READY = "READY"  # serves the daemon's version, digest verified
    LOST = "LOST"  # missed its heartbeats, or its connection closed
