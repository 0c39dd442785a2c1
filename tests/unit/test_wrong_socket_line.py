"""The line a client says for a WRONG_SOCKET refusal (pure string work)."""

from __future__ import annotations

from messages.errors import wrong_socket_line


def details(socket: str, trainer: str, engine: str) -> dict[str, str]:
    return {"socket": socket, "type": "x", "trainer_addr": trainer, "engine_addr": engine}


def test_a_wildcard_host_becomes_the_host_the_client_used():
    d = details("engine", "tcp://0.0.0.0:5555", "tcp://0.0.0.0:5556")
    assert wrong_socket_line("tcp://daemon:5556", d).endswith("trainer socket (--addr tcp://daemon:5555)")
    d = details("trainer", "tcp://[::]:5555", "tcp://*:5556")
    line = wrong_socket_line("tcp://[fe80::1]:5555", d)
    assert line == (
        "tcp://[fe80::1]:5555 is the daemon's trainer socket; engines (`weightsync engine`) "
        "connect to its engine socket (--connect tcp://[fe80::1]:5556)"
    )


def test_a_bound_host_and_an_ipc_path_are_kept_as_bound():
    d = details("engine", "tcp://10.0.0.5:5555", "tcp://10.0.0.5:5556")
    assert wrong_socket_line("tcp://daemon:5556", d).endswith("(--addr tcp://10.0.0.5:5555)")
    d = details("engine", "ipc:///run/ws/trainer.sock", "ipc:///run/ws/engine.sock")
    assert wrong_socket_line("ipc:///run/ws/engine.sock", d).endswith("(--addr ipc:///run/ws/trainer.sock)")


def test_missing_details_still_name_the_socket_needed():
    assert wrong_socket_line("tcp://h:1", {"socket": "engine"}).endswith("connect to its trainer socket")
    assert (
        wrong_socket_line("tcp://h:1", {})
        == "tcp://h:1 is not the daemon socket this client needs (the trainer socket)"
    )
