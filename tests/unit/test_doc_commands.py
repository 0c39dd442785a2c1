"""The commands docs/INTEGRATIONS.md (TRL) and docs/MULTINODE.md show are accepted as
written by the parsers that will run them: `weightsync`'s own click command (required
options, unknown options, a model directory that must exist) and the TRL example's
argparse. Parsing only: nothing is started (tests/vllm/test_trl_docs.py runs the TRL ones)."""

from __future__ import annotations

import pytest

from tests.doc_commands import commands, section, substitute

PAGES = [
    ("INTEGRATIONS.md", "TRL"),
    ("MULTINODE.md", "Worked example"),
]


def _parse_weightsync(argv: list[str]) -> None:
    from orchestrator.cli.main import command

    root = command()
    ctx = root.make_context("weightsync", argv[:1])
    sub = root.get_command(ctx, argv[0])
    assert sub is not None, argv
    sub.make_context(argv[0], argv[1:], parent=ctx)  # click's UsageError on a wrong command


@pytest.mark.parametrize(("doc", "heading"), PAGES)
def test_every_weightsync_command_of_the_page_parses(tmp_path, doc, heading):
    model = tmp_path / "model"
    model.mkdir()
    cmds = commands(section(doc, heading))
    ws = [c for c in cmds if c[0] == "weightsync"]
    assert ws, (doc, heading)
    for argv in ws:
        argv = substitute(argv, {"/models/policy": str(model), "/models/llama": str(model)})
        _parse_weightsync(argv[1:])


def test_the_trl_section_shows_the_four_commands_of_a_run():
    """Daemon, vLLM server with the scale-out route, the engine feeding it (with its model),
    the example trainer: the order a user starts them in."""
    import examples.trl_grpo as example

    cmds = commands(section("INTEGRATIONS.md", "TRL"))
    assert [c[:2] for c in cmds] == [
        ["weightsync", "serve"],
        ["weightsync", "vllm-server"],
        ["weightsync", "engine"],
        ["python", "-m"],
    ]
    assert "--enable-scale-out" in cmds[1]
    assert cmds[2][cmds[2].index("--model") + 1] == cmds[1][2]  # the server's model
    assert cmds[3][2] == "examples.trl_grpo"
    a = example.parser().parse_args(cmds[3][3:])
    assert a.model == cmds[1][2] and a.server == "http://127.0.0.1:8000"
    assert a.addr == cmds[0][cmds[0].index("--bind") + 1]
