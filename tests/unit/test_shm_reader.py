"""An engine's mappings of trainer slots: kept across syncs while the slot exists (no
page faults again on the next push), dropped once the trainer unlinked it."""

from __future__ import annotations

from messages.segments import Reader, Segment


def test_prune_keeps_live_slots_mapped_and_drops_unlinked_ones():
    live, gone = Segment(1 << 16, kind="trainer"), Segment(1 << 16, kind="trainer")
    try:
        live.write(b"a" * 100)
        gone.write(b"b" * 100)
        r = Reader()
        assert bytes(r.view(live.name, 0, 3)) == b"aaa" and bytes(r.view(gone.name, 0, 3)) == b"bbb"
        kept = r._maps[live.name][1]
        gone.close()  # the trainer unlinks it
        r.prune()
        assert list(r._maps) == [live.name] and r._maps[live.name][1] is kept
        live.write(b"c" * 3)  # the next push writes the same slot: seen through the same map
        assert bytes(r.view(live.name, 0, 3)) == b"ccc" and r._maps[live.name][1] is kept
        r.close()
        assert r._maps == {}
    finally:
        live.close()
        gone.close()


def test_check_vouches_for_a_slot_without_mapping_it_and_refuses_what_view_refuses():
    """The daemon checks a pure-shm bucket's slot (name, owner, size) but never reads it:
    `check` makes `view`'s checks and maps nothing."""
    import pytest

    from messages.errors import MessageError

    seg = Segment(1 << 16, kind="trainer")
    try:
        r = Reader()
        r.check(seg.name, 0, 1 << 16)
        assert r._maps == {}
        for name, size, why in (
            (seg.name, (1 << 16) + 1, "need"),
            (seg.name[:-1] + ("0" if seg.name[-1] != "0" else "1"), 1, "does not exist"),
            ("../etc/passwd", 1, "not a weightsync segment name"),
        ):
            with pytest.raises(MessageError, match=why):
                r.check(name, 0, size)
        with pytest.raises(MessageError, match="need"):
            r.view(seg.name, 0, (1 << 16) + 1)
        assert r._maps == {}
    finally:
        seg.close()
