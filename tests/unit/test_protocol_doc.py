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
