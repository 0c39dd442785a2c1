"""`examples/trl_grpo.py`'s docstring names exactly the flags its parser takes."""

from __future__ import annotations

import argparse
import re

import examples.trl_grpo as example


def _parser_flags() -> set[str]:
    return {
        o
        for a in example.parser()._actions
        if a.help is not argparse.SUPPRESS
        for o in a.option_strings
        if o.startswith("--") and o != "--help"
    }


def test_the_example_docstring_lists_every_flag_and_only_real_ones():
    doc = example.__doc__ or ""
    usage = doc[doc.index("python -m examples.trl_grpo") : doc.index("The trainer is")]
    section = doc[doc.index("Flags:") : doc.index("What is recorded")]
    flags = _parser_flags()
    assert set(re.findall(r"--[a-z][a-z-]*", usage)) == flags
    assert set(re.findall(r"`(--[a-z][a-z-]*)", section)) == flags
