"""The shell commands a doc section shows, read from its fenced ```bash blocks, so a test
runs what the page says rather than a copy of it.

Rules: a section is the text from its `## ` heading to the next one; a command is one
line of a bash block after `\\`-newline continuations are joined, split as the shell
would (comments dropped); placeholders are replaced token by token (`substitute`), nothing
else is touched."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def section(doc: str, heading: str) -> str:
    """The text of the `## ` section of docs/`doc` whose heading starts with `heading`."""
    text = (DOCS / doc).read_text()
    start = text.index("\n## " + heading)
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def commands(text: str) -> list[list[str]]:
    """Every command of every bash block in `text`, each as argv."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                out.append(argv)
    return out


def substitute(argv: list[str], values: Mapping[str, str]) -> list[str]:
    """`argv` with each placeholder in `values` (a whole token, or a port after `:`)
    replaced; a placeholder may not be a substring of another word."""
    pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, values)) + r")(?![\w.])")
    return [pattern.sub(lambda m: values[m.group(1)], a) for a in argv]
