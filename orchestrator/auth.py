"""ZeroMQ CURVE authentication: keys on disk, an allowlist per socket, one ZAP handler.

Layout of a keys directory (`weightsync keys generate DIR`):
    server.key, server.key_secret        the daemon's keypair (clients need server.key)
    NAME.key, NAME.key_secret            one keypair per trainer or engine identity
    trainers/NAME.key                    public keys allowed on the trainer socket
    engines/NAME.key                     public keys allowed on the engine socket
Secret files are mode 0600. The daemon's ZAP handler runs on its own thread with its own
socket (pyzmq's ThreadAuthenticator); each ROUTER carries a ZAP domain so a trainer key
cannot register as an engine and an engine key cannot push or read status.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

ROLES = {"trainer": "trainers", "engine": "engines"}


class KeysError(ValueError):
    """A keys directory is missing a file or holds an unreadable key (exit code 2)."""


@dataclass(frozen=True, slots=True)
class ClientKeys:
    server_public: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, sec = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeysError(f"cannot read key {path}: {exc}") from None
    if secret and sec is None:
        raise KeysError(f"{path} holds no secret key")
    return public, sec


def generate(directory: str | Path, trainers: list[str], engines: list[str]) -> list[Path]:
    """Create the server keypair (once) and a keypair per identity, allowlisted by role."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    for role, names in (("trainer", trainers), ("engine", engines)):
        (d / ROLES[role]).mkdir(exist_ok=True)
        for name in names:
            if "/" in name or name.startswith(".") or name == "server":
                raise KeysError(f"bad identity name {name!r}")
    if not (d / "server.key_secret").exists():
        made += [Path(p) for p in zmq.auth.create_certificates(d, "server")]
    for role, names in (("trainer", trainers), ("engine", engines)):
        for name in names:
            if (d / f"{name}.key_secret").exists():
                raise KeysError(f"{d / name}.key_secret exists; not overwriting a key")
            public, secret = zmq.auth.create_certificates(d, name)
            made += [Path(public), Path(secret)]
            shutil.copy(public, d / ROLES[role] / f"{name}.key")
            made.append(d / ROLES[role] / f"{name}.key")
    for p in d.glob("*.key_secret"):
        os.chmod(p, 0o600)
    return made


def client_keys(directory: str | Path, name: str) -> ClientKeys:
    d = Path(directory)
    server_public, _ = _load(d / "server.key", secret=False)
    public, secret = _load(d / f"{name}.key_secret", secret=True)
    return ClientKeys(server_public, public, secret)  # type: ignore[arg-type]


class ServerAuth:
    """The daemon's side: its keypair on each ROUTER and the ZAP allowlists."""

    def __init__(self, ctx: zmq.Context, directory: str | Path) -> None:
        d = Path(directory)
        self.public, self.secret = _load(d / "server.key_secret", secret=True)
        for folder in ROLES.values():
            if not (d / folder).is_dir():
                raise KeysError(f"{d / folder} is missing (run `weightsync keys generate {d}`)")
        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        for role, folder in ROLES.items():
            self.auth.configure_curve(domain=role, location=str(d / folder))

    def apply(self, sock: zmq.Socket, role: str) -> None:
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.zap_domain = role.encode()

    def stop(self) -> None:
        self.auth.stop()
