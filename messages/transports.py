"""The transport seam: how a bucket's bytes travel from a trainer to the engines.

A transport is one `Transport` in the registry, named on the wire (`begin.transport`, an
engine's `register.transports`). What the rest of the code plans with is its capabilities,
never its name:

- `carries`: "frame" (the bytes ride with the bucket message through the daemon, which
  forwards them), "ref" (the bucket message carries a reference (`schema.Ref`) to bytes
  the trainer wrote somewhere its engines read them, on the trainer's host; the daemon only
  vouches for the reference, or reads it to spool or to cut frames for engines that cannot
  read it), "group" (the bytes go by a broadcast in a group the trainer hosts; the daemon
  sees their size only).
- `same_host`: its engines must share the trainer's host.
- the sides, for a "ref" transport: `rings()` makes the trainer's slots (one `Rings` per
  client, kept across pushes), `reader()` the daemon's and each engine's reader of the
  references (one per thread that reads). A transport offered by no side is never chosen.

`register()` adds a transport (a module registers its own at import); `load_modules()`
imports the modules a setting names (`--transport-module`, WEIGHTSYNC_TRANSPORT_MODULES), in
the daemon, the engines and the trainer alike, so a transport defined outside this package
(a test's, a site's) plugs in without a change here. `choose()` is the one rule that picks
a sync's transport from what the trainer asked and what the engines offer.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from messages import schema, segments, shm
from messages.errors import ErrorCode, MessageError

if TYPE_CHECKING:
    import torch

Carrier = Literal["frame", "ref", "group"]
AUTO = "auto"  # begin.transport: the daemon picks (the best transport every end offers)
NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}\Z")


class TransportError(ValueError):
    """A transport module could not be loaded, or a name is taken or malformed."""


class Slots(Protocol):
    """A trainer's slots for one push: bucket `seq` is packed into `slot(seq, n)` and
    announced with `ref(seq, n)`; a slot is reused only after its bucket was acknowledged."""

    @property
    def slots(self) -> int: ...

    def slot(self, seq: int, nbytes: int) -> torch.Tensor: ...  # uint8, nbytes long

    def ref(self, seq: int, nbytes: int) -> schema.Ref: ...


class Rings(Protocol):
    """A client's slots, reserved once and kept for its later pushes."""

    def get(self, window: int, bucket_bytes: int) -> Slots | None:
        """Slots for this push, or None: this transport cannot be used now (the trainer
        falls back to frames)."""
        ...

    def drop(self) -> None:
        """Release the slots (after a failed push an engine may still read one)."""
        ...


class Reader(Protocol):
    """Reads references for one thread: `view` maps the bytes (read-only), `check` makes
    view's checks without reading (a process that only vouches for a reference). Both raise
    a `MessageError` (BAD_MESSAGE) for a reference they refuse."""

    def view(self, name: str, offset: int, size: int) -> memoryview: ...

    def check(self, name: str, offset: int, size: int) -> None: ...

    def prune(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Transport:
    name: str
    carries: Carrier
    same_host: bool = False
    # "auto" prefers the highest of those that every participant can use
    preference: int = 0
    rings: Callable[[], Rings] | None = None  # "ref": the trainer's side
    reader: Callable[[], Reader] | None = None  # "ref": the daemon's and the engines' side
    available: Callable[[], bool] = lambda: True  # usable in this process now (an engine offers it)
    # what owners that died left behind on this host, removed (names); run by the daemon
    # after each sync and at start
    sweep: Callable[[], list[str]] | None = None

    @property
    def through_daemon(self) -> bool:
        """Every byte of a bucket passes through the daemon's process."""
        return self.carries == "frame"

    @property
    def needs_group(self) -> bool:
        return self.carries == "group"


_REGISTRY: dict[str, Transport] = {}


def register(t: Transport) -> Transport:
    """Add `t` (the same object again is a no-op; another under a taken name is refused)."""
    if not NAME.match(t.name) or t.name == AUTO:
        raise TransportError(f"transport name {t.name!r} must match {NAME.pattern} and not be {AUTO!r}")
    if t.carries == "ref" and (t.rings is None or t.reader is None):
        raise TransportError(f"transport {t.name!r} carries references: it needs rings and reader")
    have = _REGISTRY.get(t.name)
    if have is not None and have != t:
        raise TransportError(f"transport {t.name!r} is registered already")
    _REGISTRY[t.name] = t
    return t


def get(name: str) -> Transport | None:
    return _REGISTRY.get(name)


def names() -> tuple[str, ...]:
    """Every registered transport, the most preferred first."""
    return tuple(t.name for t in sorted(_REGISTRY.values(), key=lambda t: -t.preference))


def of_kind(carries: Carrier) -> tuple[Transport, ...]:
    return tuple(t for t in sorted(_REGISTRY.values(), key=lambda t: -t.preference) if t.carries == carries)


def frames() -> Transport:
    """The transport every end speaks: frames through the daemon."""
    return of_kind("frame")[0]


def ref_name(via: str) -> str:
    """The transport a `schema.Ref` names ("" on the wire: shared memory, the one "ref"
    transport of peers that predate `via`)."""
    return via or "shm"


def reader_of(via: str, readers: dict[str, Reader]) -> Reader | None:
    """This thread's reader for references of transport `via` (made on first use and kept
    in `readers`, the caller's), or None: no such "ref" transport here."""
    name = ref_name(via)
    r = readers.get(name)
    if r is None:
        t = _REGISTRY.get(name)
        if t is None or t.reader is None:
            return None
        r = readers[name] = t.reader()
    return r


def view(ref: schema.Ref, readers: dict[str, Reader]) -> memoryview:
    """The bytes `ref` names, read by its transport's reader in `readers` (this thread's):
    a `MessageError` (BAD_MESSAGE) when no transport here carries references by that name,
    or when its reader refuses the reference."""
    reader = reader_of(ref.via, readers)
    if reader is None:
        raise MessageError(
            ErrorCode.BAD_MESSAGE, f"no transport {ref_name(ref.via)!r} carries references here"
        )
    return reader.view(ref.name, ref.offset, ref.size)


def close_readers(readers: dict[str, Reader]) -> None:
    for r in readers.values():
        r.close()
    readers.clear()


def sweep() -> list[str]:
    """Every transport's `sweep`: what dead owners left behind, removed."""
    return [name for t in _REGISTRY.values() if t.sweep is not None for name in t.sweep()]


def load_modules(modules: Iterable[str]) -> None:
    """Import each module (it registers its transports at import)."""
    for mod in modules:
        mod = mod.strip()
        if not mod:
            continue
        try:
            importlib.import_module(mod)
        except Exception as exc:
            raise TransportError(f"transport module {mod!r} could not be loaded: {exc}") from exc


def split_modules(value: str | None) -> tuple[str, ...]:
    """A setting's module list: comma-separated."""
    return tuple(m.strip() for m in (value or "").split(",") if m.strip())


def choose_ref(
    asked: str,
    trainer_host: str,
    daemon_host: str,
    participants: tuple[str, ...],
    host_of: Callable[[str], str],
    offers: Callable[[str], tuple[str, ...]],
) -> tuple[str, tuple[str, ...], bool]:
    """The "ref" plan for a sync: (transport, the participants that read by reference,
    mixed?). A "ref" transport needs each reader on the trainer's host offering it; the
    others take frames the daemon cuts from the references, so a mixed sync needs the
    daemon on the trainer's host too. ("", (), False): frames for all."""
    if not trainer_host:
        return "", (), False
    wanted = [t for t in of_kind("ref") if asked in (AUTO, t.name)]
    for t in wanted:
        able = tuple(
            e for e in participants if (not t.same_host or host_of(e) == trainer_host) and t.name in offers(e)
        )
        if not able or (len(able) < len(participants) and daemon_host != trainer_host):
            continue
        return t.name, able, len(able) < len(participants)
    return "", (), False


def _builtins() -> None:
    """The transports every weightsync process has: frames through the daemon, references
    to same-host shared memory (messages.shm), and the trainer-hosted group
    (messages.distgroup)."""
    register(Transport(schema.FRAMES, "frame"))
    register(
        Transport(
            "shm",
            "ref",
            same_host=True,
            preference=10,
            rings=shm.ShmRings,
            reader=segments.Reader,
            available=segments.available,
            sweep=segments.sweep_stale,
        )
    )
    register(Transport("collective", "group", preference=20))


_builtins()
FRAMES = frames().name  # what every end speaks
