"""One frozen dataclass per wire message (DESIGN.md section 3).

Rules: every field has a wire type the codec checks; new fields get defaults; unknown
fields are ignored by receivers. `TYPE` is the header's `type` string. Payload frames are
never part of a dataclass: the codec hands them out beside the message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

PROTOCOL_VERSION = 1
"""Major version of the wire protocol, checked on every message (independent of the package)."""


# 16 MiB: measured fastest on this project's 2-core host (`python -m bench --bucket-bytes
# 8MiB,16MiB,32MiB,64MiB`): receive buffers past glibc's 32 MiB mmap threshold are fresh
# mappings that page-fault on every bucket, in the daemon and in every engine.
DEFAULT_BUCKET_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "offset": self.offset, "nbytes": self.nbytes}


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """What an engine expects for one checkpoint tensor (sent at register)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True, slots=True)
class Probe:
    """A canary: greedy-decode `max_tokens` after `prompt`; `expected` is the trainer's answer."""

    prompt: tuple[int, ...]
    max_tokens: int = 8
    expected: tuple[int, ...] | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"prompt": list(self.prompt), "max_tokens": self.max_tokens,
                "expected": None if self.expected is None else list(self.expected)}


@dataclass(frozen=True, slots=True)
class ShmRef:
    """Where a bucket lies in shared memory (shm transport): segment name and offset."""

    name: str
    offset: int
    size: int

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "offset": self.offset, "size": self.size}


class Message:
    TYPE: ClassVar[str] = ""
    PAYLOAD: ClassVar[str] = "none"  # "none" | "bucket" (one frame unless shm is set)


# -- trainer -> orchestrator ------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Hello(Message):
    TYPE: ClassVar[str] = "hello"
    id: int = 0
    client: str = ""


@dataclass(frozen=True, slots=True)
class Begin(Message):
    TYPE: ClassVar[str] = "begin"
    sync_id: str
    version: int
    id: int = 0
    senders: int = 1
    expected_buckets: int | None = None
    probes: tuple[Probe, ...] = ()
    host: str = ""  # the trainer's host: engines on it may read buckets from shared memory
    transport: str = "inline"  # "inline" | "shm" | "auto" (shm where every engine can)


@dataclass(frozen=True, slots=True)
class Bucket(Message):
    TYPE: ClassVar[str] = "bucket"
    PAYLOAD: ClassVar[str] = "bucket"
    sync_id: str
    seq: int
    tensors: tuple[TensorMeta, ...]
    checksum: int
    id: int = 0
    sender: int = 0
    shm: ShmRef | None = None


@dataclass(frozen=True, slots=True)
class Finish(Message):
    TYPE: ClassVar[str] = "finish"
    sync_id: str
    buckets: int
    id: int = 0
    sender: int = 0
    digest: str | None = None


@dataclass(frozen=True, slots=True)
class Abort(Message):
    """Trainer -> orchestrator (give the sync up) and orchestrator -> engine (drop it)."""

    TYPE: ClassVar[str] = "abort"
    sync_id: str
    id: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Status(Message):
    TYPE: ClassVar[str] = "status"
    id: int = 0


# -- replies ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Ok(Message):
    TYPE: ClassVar[str] = "ok"
    id: int = 0
    body: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Error(Message):
    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    id: int = 0
    state: str | None = None
    version: int | None = None
    sync_id: str | None = None
    details: dict[str, Any] | None = None


# -- engine -> orchestrator -------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Register(Message):
    TYPE: ClassVar[str] = "register"
    engine_id: str
    backend: str
    id: int = 0
    model: str = ""
    transports: tuple[str, ...] = ("inline",)
    version: int | None = None
    digest: str | None = None
    finalize_count: int = 0
    pid: int | None = None
    host: str = ""
    spec: tuple[ParamSpec, ...] = ()
    cast_ok: bool = False


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    TYPE: ClassVar[str] = "heartbeat"
    engine_id: str
    id: int = 0


@dataclass(frozen=True, slots=True)
class Loaded(Message):
    TYPE: ClassVar[str] = "loaded"
    sync_id: str
    seq: int
    id: int = 0
    sender: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Finalized(Message):
    TYPE: ClassVar[str] = "finalized"
    sync_id: str
    version: int
    digest: str
    id: int = 0
    finalize_count: int = 0
    probes: tuple[tuple[int, ...], ...] = ()
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Failed(Message):
    TYPE: ClassVar[str] = "failed"
    sync_id: str
    code: str
    message: str
    id: int = 0
    seq: int | None = None
    sender: int | None = None
    duplicate: bool = False


# -- orchestrator -> engine -------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Load(Message):
    TYPE: ClassVar[str] = "load"
    PAYLOAD: ClassVar[str] = "bucket"
    sync_id: str
    version: int
    seq: int
    tensors: tuple[TensorMeta, ...]
    checksum: int
    id: int = 0
    sender: int = 0
    shm: ShmRef | None = None


@dataclass(frozen=True, slots=True)
class Finalize(Message):
    TYPE: ClassVar[str] = "finalize"
    sync_id: str
    version: int
    id: int = 0
    probes: tuple[Probe, ...] = ()


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (Hello, Begin, Bucket, Finish, Abort, Status, Ok, Error, Register, Heartbeat,
                Loaded, Finalized, Failed, Load, Finalize)
}
