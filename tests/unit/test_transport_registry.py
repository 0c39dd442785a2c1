"""The transport registry (messages.transports) and the core's planning by capabilities."""

from __future__ import annotations

import pytest

from messages import transports
from messages.errors import ErrorCode, WeightSyncError
from messages.schema import Begin
from orchestrator.core import Core, Limits, State
from orchestrator.core import events as ev


def test_a_begin_naming_an_unknown_transport_is_refused_and_changes_nothing():
    core = Core(Limits(min_engines=0))
    before = core.state
    with pytest.raises(WeightSyncError) as ei:
        core.handle(ev.BeginSync(Begin(sync_id="s1", version=1, transport="nosuch")), 1.0)
    assert ei.value.code is ErrorCode.BAD_MESSAGE and "'nosuch'" in ei.value.message
    assert core.state == before and core.sync is None
    # a name it has opens the sync
    core.handle(ev.BeginSync(Begin(sync_id="s1", version=1, transport=transports.FRAMES)), 2.0)
    assert core.state is State.LOADING_BUCKETS


def test_register_refuses_a_taken_name_a_bad_name_and_a_reference_transport_without_sides():
    with pytest.raises(transports.TransportError):
        transports.register(transports.Transport(transports.FRAMES, "ref"))  # taken
    with pytest.raises(transports.TransportError):
        transports.register(transports.Transport("Bad Name", "frame"))
    with pytest.raises(transports.TransportError):
        transports.register(transports.Transport(transports.AUTO, "frame"))
    with pytest.raises(transports.TransportError):
        transports.register(transports.Transport("sideless", "ref"))
    assert transports.get("sideless") is None


def test_load_modules_names_the_module_that_failed():
    with pytest.raises(transports.TransportError, match="no_such_transport_module"):
        transports.load_modules(["no_such_transport_module"])
    assert transports.split_modules(" a.b, ,c ") == ("a.b", "c")


HOSTS = {"e0": "h1", "e1": "h1", "e2": "h2"}


def choose(asked, trainer_host, daemon_host, offers):
    return transports.choose_ref(
        asked, trainer_host, daemon_host, tuple(HOSTS), HOSTS.__getitem__, offers.__getitem__
    )


def test_references_go_to_the_engines_on_the_trainers_host_the_rest_take_frames_cut_by_a_daemon_there():
    ref = next(t.name for t in transports.of_kind("ref"))
    every = {e: (transports.FRAMES, ref) for e in HOSTS}
    # e2 is on another host: mixed, when the daemon shares the trainer's host
    assert choose(transports.AUTO, "h1", "h1", every) == (ref, ("e0", "e1"), True)
    # the daemon elsewhere cannot cut frames from the references: frames for all
    assert choose(transports.AUTO, "h1", "h2", every) == ("", (), False)
    # an engine that does not offer it takes frames
    some = {**every, "e1": (transports.FRAMES,)}
    assert choose(ref, "h1", "h1", some) == (ref, ("e0",), True)
    # frames asked for, or no host said: no references
    assert choose(transports.FRAMES, "h1", "h1", every) == ("", (), False)
    assert choose(transports.AUTO, "", "h1", every) == ("", (), False)


def test_each_transport_is_planned_by_what_it_carries():
    kinds = {t.name: t.carries for t in (transports.get(n) for n in transports.names()) if t is not None}
    assert {"frame", "ref", "group"} <= set(kinds.values())
    frames = transports.frames()
    assert frames.through_daemon and not frames.needs_group
    group = transports.of_kind("group")[0]
    assert group.needs_group and not group.through_daemon
