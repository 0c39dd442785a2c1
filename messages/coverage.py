"""What a sync must cover: every tensor an engine loads, unless the push says it is partial.

One rule, asked on both sides: the daemon before it commits a sync by frame or by reference
(every participant's spec against the names the sync sent), an engine at the end of a
collective stream it prepared (its own spec against the names it received). A tensor left
out would keep the old version's values beside the new ones: the sync is INCOMPLETE_SYNC,
nothing finalized, unless the trainer pushed with `partial` (it means to send only some).
"""

from __future__ import annotations

from collections.abc import Container, Iterable

SHOWN = 8  # names a sentence lists before "..."


def unsent(spec: Iterable[str], sent: Container[str]) -> list[str]:
    """The names of `spec` (what an engine loads) that are not in `sent`, sorted."""
    return sorted(n for n in spec if n not in sent)


def listed(names: list[str]) -> str:
    """`names` for a sentence: the first few, then " ..." if there are more."""
    return ", ".join(names[:SHOWN]) + (" ..." if len(names) > SHOWN else "")
