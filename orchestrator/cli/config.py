"""Where each option of the `weightsync` command comes from: a flag, a `WEIGHTSYNC_*`
environment variable, or a TOML config file, in that order (then the built-in default).

Rules: this is click's own machinery, not a layering of our own. Every option of every
command gets `envvar=WEIGHTSYNC_<LONG_FLAG>` (`--min-engines` -> `WEIGHTSYNC_MIN_ENGINES`);
the config file (`--config FILE` or `WEIGHTSYNC_CONFIG`) becomes click's `default_map`:
top-level keys apply to every command that has that option, `[serve]`, `[push]`,
`[keys.generate]` ... tables to one command. Keys are the long flag without dashes
(`min-engines` or `min_engines`). `weightsync config show` makes each command's context
the way a run would and prints every value with click's parameter source.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_origin

from orchestrator.daemon.config import Settings

if TYPE_CHECKING:
    from typer.core import TyperOption

ENV_PREFIX = "WEIGHTSYNC_"
SETTINGS_DEFAULTS = {f.name: f.default for f in fields(Settings)}
SKIP = {"help", "config"}


# Typer carries its own copy of click (typer._click), so this module goes by what click's
# objects have (`commands`, `param_type_name`, `make_context`), not by their classes. A
# command: typer's TyperCommand, or a TyperGroup (one with `commands`), which click's
# declared types (`Context.command: Command`) cannot tell apart.
Command = Any


class RootContext(Protocol):
    """What `show` reads of the root command's context (click's `Context`)."""

    @property
    def command(self) -> Command: ...

    @property
    def default_map(self) -> Mapping[str, object] | None: ...


def key_of(p: TyperOption) -> str:
    """The option's name for env and config: its long flag, e.g. `log_json`, `json`."""
    longs = [o for o in p.opts if o.startswith("--")]
    return (longs[0][2:] if longs else p.name or "").replace("-", "_")


def commands(group: Command, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Command]]:
    for name, cmd in sorted(group.commands.items()):
        if hasattr(cmd, "commands"):
            yield from commands(cmd, (*prefix, name))
        else:
            yield (*prefix, name), cmd


def options(cmd: Command) -> list[TyperOption]:
    return [
        p
        for p in cmd.params
        if p.param_type_name == "option" and p.name not in SKIP and not getattr(p, "hidden", False)
    ]


def wire_envvars(group: Command) -> None:
    for _, cmd in commands(group):
        for p in options(cmd):
            if p.envvar is None:
                p.envvar = ENV_PREFIX + key_of(p).upper()
                p.show_envvar = True


class ConfigFileError(ValueError):
    """The config file cannot be read or names an option no command has (exit 2)."""


def load(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigFileError(f"config file {path}: {exc}") from None


def _convert(cmd: Command, p: TyperOption, value: Any, where: str, from_env: bool = False) -> None:
    """Refuse a value the option itself refuses (its type, its range), saying where the
    value came from: click's own conversion, as a run would do it."""
    if isinstance(value, dict) or (isinstance(value, list) and not p.multiple):
        raise ConfigFileError(f"{where}: a table or list is not a value for --{key_of(p).replace('_', '-')}")
    if not from_env and not isinstance(value, str | list) and _takes_text(p):
        # `spool = 5` would silently become the directory ./5
        raise ConfigFileError(
            f"{where}: --{key_of(p).replace('_', '-')} takes a string; quote it if you mean {str(value)!r}"
        )
    if from_env and p.multiple:
        value = p.split_envvar_value(value)
    elif p.multiple and not isinstance(value, list):
        value = [value]
    try:
        p.process_value(cmd.context_class(cmd, info_name=cmd.name), value)
    except Exception as exc:  # click's BadParameter (typer carries its own click)
        message = getattr(exc, "message", None) or str(exc)
        raise ConfigFileError(f"{where}: {message}") from None


def _takes_text(p: TyperOption) -> bool:
    """The option's value is a string, a path or one of named strings (not a number)."""
    ann = getattr(getattr(p, "type_descriptor", None), "annotation", None)
    return ann is str or ann is Path or get_origin(ann) is Literal


def _check_tables(cfg: dict[str, Any], group: Command, where: str) -> None:
    """Every table names a command or a group of commands (`[serve]`, `[keys.generate]`)."""
    paths = {path[: i + 1] for path, _ in commands(group) for i in range(len(path))}

    def walk(node: dict[str, Any], prefix: tuple[str, ...]) -> None:
        for k, v in node.items():
            if not isinstance(v, dict):
                continue
            path = (*prefix, k)
            if path not in paths:
                known = sorted(
                    {p[len(prefix)] for p in paths if len(p) > len(prefix) and p[: len(prefix)] == prefix}
                )
                raise ConfigFileError(
                    f"{where}: [{'.'.join(path)}] is not a command (tables: {', '.join(known)})"
                )
            walk(v, path)

    walk(cfg, ())


def check_env(group: Command, only: tuple[str, ...] = ()) -> None:
    """Every WEIGHTSYNC_* variable set for an option of the commands `only` (all when
    empty) holds a value that option takes: one line naming the variable (exit 2)."""
    from orchestrator.daemon.config import env_value

    for path, cmd in commands(group):
        if only and " ".join(path) not in only and path[0] not in only:
            continue
        for p in options(cmd):
            name = p.envvar if isinstance(p.envvar, str) else None
            if not name or not name.startswith(ENV_PREFIX):
                continue
            value = env_value(name[len(ENV_PREFIX) :])
            if value is not None and value != "":
                _convert(cmd, p, value, f"{name}={value!r} ({' '.join(path)})", from_env=True)


def default_map(cfg: dict[str, Any], group: Command, source: str = "config") -> dict[str, Any]:
    """Click's nested default_map from the file; unknown tables, unknown keys and values
    an option's type refuses are an error (exit 2) naming the file."""
    _check_tables(cfg, group, source)
    out: dict[str, Any] = {}
    common = {k: v for k, v in cfg.items() if not isinstance(v, dict)}
    used: set[str] = set()
    sections: set[str] = set()
    for path, cmd in commands(group):
        by_key = {key_of(p): p.name for p in options(cmd)}
        section: object = cfg
        for part in path:
            section = section.get(part, {}) if isinstance(section, dict) else {}
        if isinstance(section, dict) and section is not cfg:
            sections.add(".".join(path))
        values = {}
        params = {p.name: p for p in options(cmd)}
        name: str | None
        for k, v in common.items():
            if k.replace("-", "_") in by_key:
                name = by_key[k.replace("-", "_")]
                _convert(cmd, params[name], v, f"{source}: {k} = {v!r}")
                values[name] = v
                used.add(k)
        for k, v in section.items() if isinstance(section, dict) and section is not cfg else ():
            if isinstance(v, dict):
                continue
            name = by_key.get(k.replace("-", "_"))
            if name is None:
                raise ConfigFileError(f"{source} [{'.'.join(path)}]: {cmd.name} has no option {k!r}")
            _convert(cmd, params[name], v, f"{source} [{'.'.join(path)}] {k} = {v!r}")
            values[name] = v
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = values
    unknown = set(common) - used
    if unknown:
        raise ConfigFileError(f"{source}: no command has the option(s) {sorted(unknown)}")
    return out


def show(root: RootContext, only: tuple[str, ...], as_json: bool) -> None:
    """Every option of every command (or of `only`), its effective value and its source."""
    group = root.command
    check_env(group, tuple(n for n in only) if only else ())
    rows: list[dict[str, Any]] = []  # an option's value is of any type
    for path, cmd in commands(group):
        name = " ".join(path)
        if path[0] == "config" or (only and name not in only and path[0] not in only):
            continue
        dm: object = root.default_map or {}
        for part in path:
            dm = dm.get(part, {}) if isinstance(dm, dict) else {}
        ctx = cmd.make_context(path[-1], [], parent=root, default_map=dm or None, resilient_parsing=True)
        for p in options(cmd):
            source = ctx.get_parameter_source(p.name)
            value = ctx.params.get(p.name)
            if value is None and p.name in SETTINGS_DEFAULTS:  # unset: the daemon's own default
                value = SETTINGS_DEFAULTS[p.name]
            rows.append(
                {
                    "command": name,
                    "option": "--" + key_of(p).replace("_", "-"),
                    "env": p.envvar,
                    "value": str(value) if isinstance(value, Path) else value,
                    "source": {
                        "COMMANDLINE": "flag",
                        "ENVIRONMENT": "env",
                        "DEFAULT_MAP": "config file",
                        "DEFAULT": "default",
                    }.get(source.name if source else "DEFAULT", "default"),
                }
            )
    if as_json:
        print(json.dumps(rows, default=str))
        return
    from rich.table import Table

    from orchestrator.cli.tables import out_console

    t = Table(
        title="effective settings (flag > WEIGHTSYNC_* env > config file > default)", title_justify="left"
    )
    for col in ("command", "option", "value", "source", "env"):
        t.add_column(col)
    for r in rows:
        t.add_row(
            r["command"], r["option"], "" if r["value"] is None else str(r["value"]), r["source"], r["env"]
        )
    out_console().print(t)
