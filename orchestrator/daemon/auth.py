"""The daemon's side of CURVE: its keypair on each ROUTER and one ZAP handler.

Rules: the ZAP handler runs on its own thread with its own socket (pyzmq's
ThreadAuthenticator); each ROUTER carries a ZAP domain so a trainer key cannot register
as an engine and an engine key cannot push or read status. The key files and their
layout are `messages.keys`.
"""

from __future__ import annotations

from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from messages.keys import ROLES, KeysError, load_key


class ServerAuth:
    def __init__(self, ctx: zmq.SyncContext, directory: str | Path) -> None:
        d = Path(directory)
        public, secret = load_key(d / "server.key_secret", secret=True)
        if secret is None:
            raise KeysError(f"{d}/server.key_secret holds no secret key")
        self.public, self.secret = public, secret
        for folder in ROLES.values():
            if not (d / folder).is_dir():
                raise KeysError(f"{d / folder} is missing (run `weightsync keys generate {d}`)")
        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        for role, folder in ROLES.items():
            self.auth.configure_curve(domain=role, location=str(d / folder))

    def apply(self, sock: zmq.SyncSocket, role: str) -> None:
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.zap_domain = role.encode()

    def stop(self) -> None:
        self.auth.stop()
