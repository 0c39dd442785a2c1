"""Regenerate the documentation that is generated from code:
docs/ARCHITECTURE.md's state table (orchestrator/core/table.py) and engine table
(engines/session.py), and docs/PROTOCOL.md's field tables (messages/schema.py). `python -m orchestrator.cli.docs [--check]`; tests
fail when either drifts."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from engines import session
from messages import protocol_doc
from orchestrator.core import table

ENGINE_TABLE = re.compile(
    r"(<!-- engine table: generated .*? -->\n\n)(.*?)(\n\n<!-- end of engine table -->)", re.S
)


def engine_splice(doc: str) -> str:
    """`doc` with its engine table made anew from the engine session's rows."""
    return ENGINE_TABLE.sub(lambda m: m.group(1) + session.render() + m.group(3), doc)


def architecture_splice(doc: str) -> str:
    return engine_splice(table.splice(doc))


ROOT = Path(__file__).resolve().parents[2]
GENERATED: dict[Path, Callable[[str], str]] = {
    ROOT / "docs" / "ARCHITECTURE.md": architecture_splice,
    ROOT / "docs" / "PROTOCOL.md": protocol_doc.splice,
}


def main(argv: list[str]) -> int:
    stale = []
    for path, splice in GENERATED.items():
        text = path.read_text()
        new = splice(text)
        if new != text:
            stale.append(str(path))
            if "--check" not in argv:
                path.write_text(new)
    if stale and "--check" in argv:
        print("out of date: " + ", ".join(stale), file=sys.stderr)
        return 1
    print("\n".join(f"regenerated {p}" for p in stale) or "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
