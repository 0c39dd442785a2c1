"""The `weightsync` command (see docs/ and README): the typer app assembled from one module
per command family (serve, engine, fleet, push, checkout), and `main`, which turns a usage
error into one line. The exit codes are in `orchestrator.cli.util`, beside their names."""

from __future__ import annotations

import re
import sys
from enum import Enum
from pathlib import Path
from typing import Any, Optional, Protocol

import typer

from messages import transports
from orchestrator.cli import config as cliconfig
from orchestrator.cli.checkout import bench, demo
from orchestrator.cli.engine import engine
from orchestrator.cli.fleet import abort, status
from orchestrator.cli.push import push, watch
from orchestrator.cli.serve import keys_generate, serve, vllm_server
from orchestrator.cli.util import EXIT_INTERRUPTED, EXIT_OK, _usage

# rich_markup_mode=None: plain click help and errors (help text keeps its [brackets], a
# usage error is the one line main() prints, never a panel).
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    help="Weight sync between RL trainers and inference engines. Every option can "
    "also come from WEIGHTSYNC_<OPTION> or a TOML --config file.",
)


@app.callback()
def root(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(
        None,
        "--config",
        envvar="WEIGHTSYNC_CONFIG",
        help="TOML file of option defaults: top-level keys for every command, [serve], [push] ... tables",
    ),
    transport_modules: str = typer.Option(
        "",
        "--transport-modules",
        envvar="WEIGHTSYNC_TRANSPORT_MODULES",
        help="modules to import that register transports (comma-separated; the daemon, engines and trainers alike)",
    ),
) -> None:
    """Weight sync between RL trainers and inference engines."""
    try:
        transports.load_modules(transports.split_modules(transport_modules))
    except transports.TransportError as exc:
        _usage(str(exc))
    try:
        if ctx.invoked_subcommand not in (None, "config"):  # `config show` checks what it shows
            cliconfig.check_env(ctx.command, (ctx.invoked_subcommand,))
        if config is not None:
            ctx.default_map = cliconfig.default_map(cliconfig.load(config), ctx.command, f"config {config}")
    except cliconfig.ConfigFileError as exc:
        _usage(str(exc))


config_app = typer.Typer(
    help="Settings: what each option is and where it came from.", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(
    ctx: typer.Context,
    command: Optional[list[str]] = typer.Argument(None, help="only these commands"),
    as_json: bool = typer.Option(False, "--json", help="a JSON list on stdout"),
) -> None:
    """Print every option's effective value and its source (flag, env, config file, default)."""
    try:
        cliconfig.show(ctx.find_root(), tuple(command or ()), as_json)
    except cliconfig.ConfigFileError as exc:
        _usage(str(exc))


# The commands, in the order `weightsync --help` and `config show` list them.
app.command()(serve)
app.command("vllm-server", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
    vllm_server
)
app.command()(engine)
keys_app = typer.Typer(help="CURVE keys for `serve --keys`.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(keys_app, name="keys")
keys_app.command("generate")(keys_generate)
app.command()(status)
app.command()(abort)
app.command()(push)
app.command()(watch)
app.command()(demo)
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(bench)


class Runnable(Protocol):
    """What `main` calls on the click command typer builds (typer's click or click's own)."""

    def main(self, *, args: list[str] | None, prog_name: str, standalone_mode: bool) -> object: ...


class UsageContext(Protocol):
    """What a usage error's message reads of its click context."""

    @property
    def command_path(self) -> str: ...

    def get_parameter_source(self, name: str) -> Enum | None: ...


class UsageMessage(Protocol):
    """A click usage error, as far as its one line is concerned."""

    def format_message(self) -> str: ...


def command() -> Runnable:
    """The click command behind `weightsync`, each option wired to its WEIGHTSYNC_* variable."""
    cmd = typer.main.get_command(app)
    cliconfig.wire_envvars(cmd)
    return cmd


def _usage_text(exc: UsageMessage, ctx: UsageContext | None) -> str:
    """click's message on one line; "(env var: ...)" only when the value came from there."""
    text = " ".join(exc.format_message().split())
    param = getattr(exc, "param", None)
    if ctx is not None and param is not None and param.name:
        source = ctx.get_parameter_source(param.name)
        if source is not None and source.name != "ENVIRONMENT":
            text = re.sub(r" \(env var: '[^']*'\)", "", text)
    return text


# Typer carries its own copy of click (typer._click): its exception classes, by their names.
_CLICK: dict[str, Any] = {c.__name__: c for c in typer.BadParameter.__mro__[:-2]}


def main(argv: list[str] | None = None) -> None:
    """Run `weightsync`; a usage error is one line on stderr naming the command, exit 2."""
    try:
        rv = command().main(args=argv, prog_name="weightsync", standalone_mode=False)
    except _CLICK["UsageError"] as exc:
        ctx: UsageContext | None = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError":  # `weightsync`, `weightsync keys`: the help
            print(exc.format_message())
            sys.exit(EXIT_OK)
        where = ctx.command_path if ctx is not None else "weightsync"
        print(f"error: {where}: {_usage_text(exc, ctx)} (see '{where} --help')", file=sys.stderr)
        sys.exit(exc.exit_code)
    except _CLICK["ClickException"] as exc:
        print(f"error: {' '.join(exc.format_message().split())}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(rv if isinstance(rv, int) else 0)
