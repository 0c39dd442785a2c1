"""docs/PROTOCOL.md's field tables are the schema's: regenerate them when the schema changes."""

from __future__ import annotations

from pathlib import Path

from messages import protocol_doc, schema

DOC = Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"


def test_protocol_doc_tables_equal_the_schema():
    doc = DOC.read_text()
    assert protocol_doc.splice(doc) == doc, "run: python -m messages.protocol_doc --write docs/PROTOCOL.md"


def test_every_message_type_is_documented():
    documented = {cls for _, classes in protocol_doc.SECTIONS for cls in classes}
    assert set(schema.MESSAGE_TYPES.values()) <= documented
    text = DOC.read_text()
    for name in schema.MESSAGE_TYPES:
        assert f"### `{name}`" in text


def test_architecture_doc_state_table_is_the_code_table():
    from orchestrator.core import table

    doc = (DOC.parent / "ARCHITECTURE.md").read_text()
    assert table.BEGIN in doc and table.END in doc
    assert table.splice(doc) == doc, "run: python -m orchestrator.cli.docs"


def test_the_docs_command_reports_drift(tmp_path, monkeypatch):
    """`python -m orchestrator.cli.docs --check` fails on a doc whose table was edited by hand."""
    from orchestrator.cli import docs

    arch = tmp_path / "ARCHITECTURE.md"
    arch.write_text(
        (DOC.parent / "ARCHITECTURE.md").read_text().replace("| begin | IDLE, READY |", "| begin | IDLE |")
    )
    proto = tmp_path / "PROTOCOL.md"
    proto.write_text(DOC.read_text())
    monkeypatch.setattr(
        docs,
        "GENERATED",
        {
            arch: docs.GENERATED[docs.ROOT / "docs" / "ARCHITECTURE.md"],
            proto: docs.GENERATED[docs.ROOT / "docs" / "PROTOCOL.md"],
        },
    )
    assert docs.main(["--check"]) == 1
    assert docs.main([]) == 0  # regenerates
    assert docs.main(["--check"]) == 0 and "| begin | IDLE, READY |" in arch.read_text()


def test_reliability_doc_cites_only_tests_that_exist():
    """docs/RELIABILITY.md is generated from test runs: every test file and test function it
    names must still exist, or the page describes tests that no longer run."""
    import re

    root = DOC.parents[1]
    text = (DOC.parent / "RELIABILITY.md").read_text()
    sources = "\n".join(p.read_text() for p in (root / "tests").rglob("*.py"))
    for path in set(re.findall(r"\b(tests/[\w/]+\.py)\b", text)):
        assert (root / path).is_file(), path
    for name in set(re.findall(r"\b(test_\w+)\b", text)):
        is_file = any((root / "tests").rglob(f"{name}.py"))
        assert is_file or f"def {name}(" in sources, name


def test_the_readmes_manual_vllm_install_is_what_make_test_runs():
    """README's two install-by-hand commands are the Makefile's (which CI runs), so the
    documented manual install is the tested one: the extra, then the builds that break
    transformers removed."""
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    makefile = (root / "Makefile").read_text()
    assert "pip install -e '.[vllm]'\npip uninstall -y torchvision torchaudio torchcodec\n" in readme
    recipe = makefile.split("$(VENV)/.test:", 1)[1].split("\n\n", 1)[0]
    install, uninstall = (ln.strip() for ln in recipe.splitlines()[1:3])
    assert install.startswith("$(PIP) install -e '.[") and "vllm" in install.split("'")[1]
    assert uninstall == "-$(PIP) uninstall -y torchvision torchaudio torchcodec"
