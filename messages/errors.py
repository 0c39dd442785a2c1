"""Error codes and the exception hierarchy shared by every side of the wire.

Rules: every failure that crosses a process boundary carries an `ErrorCode`; the type of
the exception says whose fault it was (peer: the request was bad; engine: an engine
failed; ours: the daemon broke). Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any


class ErrorCode(str, Enum):
    BAD_MESSAGE = "BAD_MESSAGE"
    UNSUPPORTED_PROTOCOL = "UNSUPPORTED_PROTOCOL"
    INVALID_STATE = "INVALID_STATE"
    UNKNOWN_SYNC = "UNKNOWN_SYNC"
    ABORTED = "ABORTED"  # the trainer (or an operator) aborted the sync
    STALE_VERSION = "STALE_VERSION"
    STALE_BASE = "STALE_BASE"  # a delta against a version the fleet does not serve: push dense
    CHECKSUM_MISMATCH = "CHECKSUM_MISMATCH"
    UNKNOWN_TENSOR = "UNKNOWN_TENSOR"
    SHAPE_MISMATCH = "SHAPE_MISMATCH"
    INCOMPLETE_SYNC = "INCOMPLETE_SYNC"
    DUPLICATE_TENSOR = "DUPLICATE_TENSOR"  # a sharded push: two sources sent the same tensor
    # a sharded push: a source's seat claimed by another, or sources that disagree
    SOURCE_CONFLICT = "SOURCE_CONFLICT"
    NO_ENGINES = "NO_ENGINES"
    ENGINE_FAILED = "ENGINE_FAILED"
    CANARY_MISMATCH = "CANARY_MISMATCH"
    TIMEOUT = "TIMEOUT"
    UNREACHABLE = "UNREACHABLE"  # no daemon accepted a connection (client side)
    DUPLICATE_ENGINE = "DUPLICATE_ENGINE"  # a live engine already holds this engine_id
    TOO_LARGE = "TOO_LARGE"
    # the served digest (journal, spool) was made by another digest scheme: push a new version
    DIGEST_SCHEME_MISMATCH = "DIGEST_SCHEME_MISMATCH"
    UNAUTHORIZED = "UNAUTHORIZED"
    # a message type of the daemon's other socket: an engine at the trainer socket, or a
    # trainer (push, status) at the engine socket; `details` say which socket and both addresses
    WRONG_SOCKET = "WRONG_SOCKET"
    INTERNAL = "INTERNAL"


class MessageError(Exception):
    """A message could not be decoded or validated. Raised by the codec, never asserted."""

    def __init__(self, code: ErrorCode, reason: str) -> None:
        super().__init__(f"{code.value}: {reason}")
        self.code = code
        self.reason = reason


class WeightSyncError(Exception):
    """Base of every typed failure a trainer or engine can see. `.code` is an ErrorCode."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode | None = None,
        state: str | None = None,
        version: int | None = None,
        sync_id: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        if code is not None:
            self.code = code
        super().__init__(f"{self.code.value}: {message}")
        self.message = message
        self.state = state
        self.version = version
        self.sync_id = sync_id
        self.details = details or {}

    def to_fields(self) -> dict[str, Any]:
        """The `error` reply fields for this failure."""
        out: dict[str, Any] = {
            "code": self.code.value,
            "message": self.message,
            "state": self.state,
            "version": self.version,
            "sync_id": self.sync_id,
        }
        if self.details:
            out["details"] = self.details
        return out


class PeerError(WeightSyncError):
    """The request itself was wrong (malformed, oversized, unauthorized)."""

    code = ErrorCode.BAD_MESSAGE


class StateError(WeightSyncError):
    """The request does not fit the daemon's current state; retry after fixing the order."""

    code = ErrorCode.INVALID_STATE


class DataError(WeightSyncError):
    """Tensor data was refused before anything was applied (checksum, name, shape)."""

    code = ErrorCode.CHECKSUM_MISMATCH


class EngineError(WeightSyncError):
    """An engine failed, was lost, or produced the wrong result."""

    code = ErrorCode.ENGINE_FAILED


class SyncTimeout(WeightSyncError):
    code = ErrorCode.TIMEOUT


class InternalError(WeightSyncError):
    """Our fault: a bug or an environment failure inside weightsync."""

    code = ErrorCode.INTERNAL


_CLASS_BY_CODE: dict[ErrorCode, type[WeightSyncError]] = {
    ErrorCode.BAD_MESSAGE: PeerError,
    ErrorCode.UNSUPPORTED_PROTOCOL: PeerError,
    ErrorCode.TOO_LARGE: PeerError,
    ErrorCode.UNAUTHORIZED: PeerError,
    ErrorCode.INVALID_STATE: StateError,
    ErrorCode.UNKNOWN_SYNC: StateError,
    ErrorCode.ABORTED: StateError,
    ErrorCode.STALE_VERSION: StateError,
    ErrorCode.STALE_BASE: StateError,
    ErrorCode.INCOMPLETE_SYNC: StateError,
    ErrorCode.DIGEST_SCHEME_MISMATCH: StateError,
    ErrorCode.DUPLICATE_TENSOR: DataError,
    ErrorCode.CHECKSUM_MISMATCH: DataError,
    ErrorCode.UNKNOWN_TENSOR: DataError,
    ErrorCode.SHAPE_MISMATCH: DataError,
    ErrorCode.NO_ENGINES: EngineError,
    ErrorCode.ENGINE_FAILED: EngineError,
    ErrorCode.CANARY_MISMATCH: EngineError,
    ErrorCode.TIMEOUT: SyncTimeout,
    ErrorCode.UNREACHABLE: SyncTimeout,
    ErrorCode.DUPLICATE_ENGINE: PeerError,
    ErrorCode.SOURCE_CONFLICT: PeerError,
    ErrorCode.WRONG_SOCKET: PeerError,
    ErrorCode.INTERNAL: InternalError,
}


# The daemon's two sockets, as named in a WRONG_SOCKET refusal's `details.socket`: who
# connects to each, and the option that names that address on the command line.
SOCKETS = {
    "trainer": ("trainers (`weightsync push`, `status`, TrainerClient)", "--addr"),
    "engine": ("engines (`weightsync engine`)", "--connect"),
}
_WILDCARD_HOSTS = ("0.0.0.0", "*", "[::]", "::")


def _reachable(bound: str, reached: str) -> str:
    """`bound` (an address the daemon bound, as ZeroMQ reports it) as a peer that reached
    `reached` would connect to it: a wildcard host (0.0.0.0, *, ::) becomes the host of
    `reached`; anything else is kept as bound."""
    scheme, sep, rest = bound.partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not colon or host not in _WILDCARD_HOSTS:
        return bound
    r_scheme, r_sep, r_rest = reached.partition("://")
    r_host = r_rest.rpartition(":")[0]
    if r_scheme != "tcp" or not r_sep or not r_host:
        return bound
    return f"tcp://{r_host}:{port}"


def wrong_socket_line(reached: str, details: Mapping[str, object]) -> str:
    """The one line a client says for a WRONG_SOCKET refusal: which of the daemon's sockets
    `reached` is, who connects there, and the address of the socket this client needs (from
    `details`: `socket` is the one reached, `trainer_addr` / `engine_addr` what the daemon
    bound). Pure string work: no I/O."""
    here = str(details.get("socket", ""))
    want = "engine" if here == "trainer" else "trainer"
    if here not in SOCKETS:
        return f"{reached} is not the daemon socket this client needs (the {want} socket)"
    who, flag = SOCKETS[want]
    bound = details.get(f"{want}_addr")
    addr = f" ({flag} {_reachable(bound, reached)})" if isinstance(bound, str) and bound else ""
    return f"{reached} is the daemon's {here} socket; {who} connect to its {want} socket{addr}"


def error_class(code: ErrorCode) -> type[WeightSyncError]:
    return _CLASS_BY_CODE.get(code, WeightSyncError)


def make_error(
    code: ErrorCode,
    message: str,
    *,
    state: str | None = None,
    version: int | None = None,
    sync_id: str | None = None,
    details: dict[str, Any] | None = None,
) -> WeightSyncError:
    """Build the right WeightSyncError subclass for `code`."""
    return error_class(code)(
        message, code=code, state=state, version=version, sync_id=sync_id, details=details
    )
