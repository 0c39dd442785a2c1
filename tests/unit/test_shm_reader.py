"""An engine's mappings of trainer slots: kept across syncs while the slot exists (no
page faults again on the next push), dropped once the trainer unlinked it."""

from __future__ import annotations

from messages.shm import Reader, Segment


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
