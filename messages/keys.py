"""CURVE key files: the layout of a keys directory and the keys a peer loads from it.

Layout of a keys directory (`weightsync keys generate DIR`):
    server.key, server.key_secret        the daemon's keypair (clients need server.key)
    NAME.key, NAME.key_secret            one keypair per trainer or engine identity
    trainers/NAME.key                    public keys allowed on the trainer socket
    engines/NAME.key                     public keys allowed on the engine socket
Rules: secret files are mode 0600; a key is never overwritten; an identity name is never
a path. Trainers and engines load their own keys here; the daemon's side (its ZAP
allowlists) is `orchestrator.daemon.auth`.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

ROLES = {"trainer": "trainers", "engine": "engines"}


class KeysError(ValueError):
    """A keys directory is missing a file or holds an unreadable key (exit code 2)."""


@dataclass(frozen=True, slots=True)
class ClientKeys:
    server_public: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket) -> None:  # type: ignore[type-arg]
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def load_key(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) from a key file; a missing or unreadable file is a KeysError."""
    if not path.is_file():
        raise KeysError(f"key file {path} does not exist")
    try:
        public, sec = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeysError(f"cannot read key {path}: {exc}") from None
    if secret and sec is None:
        raise KeysError(f"{path} holds no secret key")
    return public, sec


def generate(directory: str | Path, trainers: list[str], engines: list[str]) -> list[Path]:
    """Create the server keypair (once) and a keypair per identity, allowlisted by role.
    An identity that exists already is kept as it is (not overwritten, not an error), so
    the same command adds identities to an existing directory."""
    d = Path(directory)
    for names in (trainers, engines):
        for name in names:
            if not name or "/" in name or name.startswith(".") or name == "server":
                raise KeysError(f"bad identity name {name!r}")
    d.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    for folder in ROLES.values():
        (d / folder).mkdir(exist_ok=True)
    if not (d / "server.key_secret").exists():
        made += [Path(p) for p in zmq.auth.create_certificates(d, "server")]
    for role, names in (("trainer", trainers), ("engine", engines)):
        for name in names:
            allowed = d / ROLES[role] / f"{name}.key"
            if not (d / f"{name}.key_secret").exists():
                public, secret = zmq.auth.create_certificates(d, name)
                made += [Path(public), Path(secret)]
            if not allowed.exists():
                shutil.copy(d / f"{name}.key", allowed)
                made.append(allowed)
    for p in d.glob("*.key_secret"):
        os.chmod(p, 0o600)
    return made


def client_keys(directory: str | Path, name: str) -> ClientKeys:
    d = Path(directory)
    server_public, _ = load_key(d / "server.key", secret=False)
    public, secret = load_key(d / f"{name}.key_secret", secret=True)
    if secret is None:  # load_key refused it already; for the type checker
        raise KeysError(f"{d / name}.key_secret holds no secret key")
    return ClientKeys(server_public, public, secret)
