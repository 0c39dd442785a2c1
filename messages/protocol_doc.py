"""The field tables of docs/PROTOCOL.md, generated from the wire schema.

`python -m messages.protocol_doc` prints them; `--write docs/PROTOCOL.md` replaces the
text between the GENERATED markers. tests/unit/test_protocol_doc.py fails when the doc
and the schema disagree, so the schema stays the one description of the wire.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import msgspec.inspect as mi

from messages import schema

BEGIN = "<!-- GENERATED from messages/schema.py: python -m messages.protocol_doc --write docs/PROTOCOL.md -->"
END = "<!-- END GENERATED -->"

SECTIONS = [
    (
        "Trainer -> orchestrator",
        (schema.Hello, schema.Status, schema.Begin, schema.Bucket, schema.Finish, schema.Abort),
    ),
    ("Replies", (schema.Ok, schema.Error)),
    (
        "Engine -> orchestrator",
        (
            schema.Register,
            schema.Heartbeat,
            schema.Goodbye,
            schema.Loaded,
            schema.Prepared,
            schema.Finalized,
            schema.Committed,
            schema.Failed,
        ),
    ),
    (
        "Orchestrator -> engine",
        (
            schema.Load,
            schema.OpenStream,
            schema.FanoutOpen,
            schema.Finalize,
            schema.Commit,
            schema.Served,
            schema.Abort,
        ),
    ),
    (
        "Nested",
        (
            schema.TensorMeta,
            schema.Patch,
            schema.ParamSpec,
            schema.Probe,
            schema.Ref,
            schema.CollectiveOffer,
            schema.GroupRef,
        ),
    ),
]


def _type(t: mi.Type) -> str:
    if isinstance(t, mi.Metadata):
        return _type(t.type)
    if isinstance(t, mi.UnionType):
        return " or ".join(_type(x) for x in t.types)
    if isinstance(t, mi.NoneType):
        return "nil"
    if isinstance(t, (mi.VarTupleType, mi.ListType)):
        return f"array of {_type(t.item_type)}"
    if isinstance(t, mi.StructType):
        return t.cls.__name__
    if isinstance(t, mi.LiteralType):
        return " or ".join(f"`{v}`" for v in t.values)
    if isinstance(t, mi.DictType):
        return "map"
    names: dict[type, str] = {
        mi.IntType: "int",
        mi.StrType: "str",
        mi.BoolType: "bool",
        mi.FloatType: "float",
        mi.AnyType: "any",
    }
    return names.get(type(t), type(t).__name__)


def _constraints(t: mi.Type) -> str:
    """A field's constraint: its description where the schema gives one, else its bounds."""
    if isinstance(t, mi.UnionType):
        return "; ".join(c for c in (_constraints(x) for x in t.types) if c)
    described = (
        t.extra_json_schema.get("description") if isinstance(t, mi.Metadata) and t.extra_json_schema else None
    )
    if isinstance(t, mi.Metadata):
        t = t.type
    out = (
        [described]
        if described
        else [
            fmt.format(getattr(t, attr))
            for attr, fmt in (
                ("ge", ">= {}"),
                ("gt", "> {}"),
                ("le", "<= {}"),
                ("lt", "< {}"),
                ("min_length", "length >= {}"),
                ("max_length", "length <= {}"),
                ("pattern", "matches `{}`"),
            )
            if getattr(t, attr, None) is not None
        ]
    )
    if isinstance(t, (mi.VarTupleType, mi.ListType)):
        inner = _constraints(t.item_type)
        if inner:
            out.append(f"each: {inner}")
    return "; ".join(out)


def table(cls: type[msgspec.Struct]) -> str:
    info = mi.type_info(cls)
    if not isinstance(info, mi.StructType):
        raise TypeError(f"{cls!r} is not a message struct")
    head = f"### `{cls.__struct_config__.tag or cls.__name__}`"
    rows = ["| field | type | constraint | default |", "|---|---|---|---|"]
    for f in info.fields:
        if f.name == "v":
            continue
        value = f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
        default = "required" if f.required else f"`{value!r}`"
        rows.append(f"| `{f.encode_name}` | {_type(f.type)} | {_constraints(f.type) or ''} | {default} |")
    return "\n".join([head, "", *rows])


def generate() -> str:
    parts = [
        BEGIN,
        "",
        "Every header also carries `v` (int, must be "
        f"{schema.PROTOCOL_VERSION}) and `type` (the tag after each heading).",
        "",
    ]
    for title, classes in SECTIONS:
        parts += [f"## Fields: {title}", ""]
        for cls in classes:
            parts += [table(cls), ""]
    parts.append(END)
    return "\n".join(parts)


def splice(doc: str) -> str:
    if BEGIN not in doc or END not in doc:
        return doc.rstrip("\n") + "\n\n" + generate() + "\n"
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + generate() + tail


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--write":
        path = Path(argv[1])
        path.write_text(splice(path.read_text()))
        return 0
    sys.stdout.write(generate() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
