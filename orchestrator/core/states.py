"""The daemon's states (one sync at a time); a module of its own so that the core and the
modules it is assembled from share them without importing each other."""

from __future__ import annotations

from enum import Enum


class State(str, Enum):
    IDLE = "IDLE"  # no verified version served (start, or after a failure: dirty)
    LOADING_BUCKETS = "LOADING_BUCKETS"  # buckets of one sync are being applied
    FINALIZING = "FINALIZING"  # every engine runs its post-load step, once
    READY = "READY"  # every live engine serves the version, digest verified


ACTIVE = [State.LOADING_BUCKETS, State.FINALIZING]
