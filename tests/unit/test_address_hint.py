"""The address a user most likely meant when ZeroMQ refused theirs (messages.link)."""

from __future__ import annotations

import pytest

from messages.link import address_hint


@pytest.mark.parametrize(
    ("addr", "bind", "hint"),
    [
        ("127.0.0.1:5555", False, "did you mean 'tcp://127.0.0.1:5555'?"),
        ("gpu-node-3.lan:5555", False, "did you mean 'tcp://gpu-node-3.lan:5555'?"),
        ("[::1]:5555", False, "did you mean 'tcp://[::1]:5555'?"),
        ("*:5555", True, "did you mean 'tcp://*:5555'?"),
        ("/run/ws/trainer.sock", False, "did you mean 'ipc:///run/ws/trainer.sock'?"),
        ("./trainer.sock", True, "did you mean 'ipc://./trainer.sock'?"),
    ],
)
def test_a_missing_scheme_names_the_address_meant(addr, bind, hint):
    assert address_hint(addr, bind=bind) == hint


@pytest.mark.parametrize(
    ("addr", "bind"),
    [("*:5555", False), ("localhost", False), ("tcp://127.0.0.1", False), ("127.0.0.1:", True)],
)
def test_no_guess_where_none_is_sure(addr, bind):
    """A connect to `*`, a host without a port, a scheme already there: the usual forms."""
    assert address_hint(addr, bind=bind) == "e.g. tcp://HOST:PORT or ipc:///PATH"
