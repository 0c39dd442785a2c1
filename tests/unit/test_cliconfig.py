"""Every option of every command can come from its flag, its WEIGHTSYNC_* variable or a
TOML config file, in that order; `weightsync config show` says which one won."""

from __future__ import annotations

import io
import json
import os
import types
import typing
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from orchestrator.cli import command
from orchestrator.cli import config as cliconfig
from orchestrator.cli.util import transport_name

CLI = command()


def run(args, env=None):
    """(exit code, stdout, stderr) of `weightsync ARGS` in this process, under `env`."""
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                rv = CLI.main(list(args), prog_name="weightsync", standalone_mode=False)
                code = rv if isinstance(rv, int) else 0  # an Exit comes back as its code
            except Exception as exc:  # click's UsageError carries its exit code and message
                code = getattr(exc, "exit_code", 1)
                err.write(str(exc))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return code, out.getvalue(), err.getvalue()


ALL = [
    (path, p) for path, cmd in cliconfig.commands(CLI) if path[0] != "config" for p in cliconfig.options(cmd)
]


def sharing(p):
    """Every option of every command read from the same variable as `p`."""
    return [o for _, o in ALL if o.envvar == p.envvar]


def sample(p, tmp_path):
    """A valid value for option `p`: as env text, as TOML value, as `config show` reports it."""
    ann = p.type_descriptor.annotation
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    base = args[0] if typing.get_origin(ann) in (typing.Union, types.UnionType) and args else ann
    if p.is_flag or base is bool:
        return "true", True, True
    if base is int:  # a WEIGHTSYNC_* variable reaches every command with that option
        v = max([7] + [getattr(o.type_descriptor.parameter_info, "min", None) or 0 for o in sharing(p)])
        return str(v), v, v
    if base is float:
        return "1.5", 1.5, 1.5
    if base is Path:
        if getattr(p.type_descriptor.parameter_info, "dir_okay", True) is False:  # a file option
            f = tmp_path / "file.json"
            f.write_text("[]")
            return str(f), str(f), str(f)
        return str(tmp_path), str(tmp_path), str(tmp_path)
    if typing.get_origin(base) is typing.Literal:  # one every command sharing the variable takes
        shared = [typing.get_args(o.type_descriptor.annotation) for o in sharing(p)]
        v = [c for c in typing.get_args(base) if all(c in choices for choices in shared)][-1]
        return v, v, v
    if p.multiple:
        return "alpha", ["alpha"], ["alpha"]
    if getattr(p.callback, "__name__", "") == transport_name.__name__:  # a registered transport's name
        return "inline", "inline", "inline"
    return "alpha", "alpha", "alpha"


def show(env=None, args=()):
    code, out, err = run([*args, "config", "show", "--json"], env)
    assert code == 0, err
    return {(row["command"], row["option"]): row for row in json.loads(out)}


def norm(v):
    return list(v) if isinstance(v, (tuple, list)) else v


@pytest.mark.parametrize("path,opt", ALL, ids=[f"{' '.join(p)}:{o.name}" for p, o in ALL])
def test_each_option_from_env_and_from_the_config_file(path, opt, tmp_path):
    key = cliconfig.key_of(opt)
    flag = "--" + key.replace("_", "-")
    env_text, toml_value, shown = sample(opt, tmp_path)
    name = " ".join(path)

    row = show({opt.envvar: env_text})[(name, flag)]
    assert opt.envvar == "WEIGHTSYNC_" + key.upper()
    assert (row["source"], norm(row["value"])) == ("env", shown)

    table = "[" + ".".join(path) + "]"
    toml_text = json.dumps(toml_value) if not isinstance(toml_value, bool) else str(toml_value).lower()
    cfg = tmp_path / "weightsync.toml"
    cfg.write_text(f"{table}\n{key} = {toml_text}\n")
    row = show(args=["--config", str(cfg)])[(name, flag)]
    assert (row["source"], norm(row["value"])) == ("config file", shown)

    row = show({opt.envvar: env_text}, args=["--config", str(cfg)])[(name, flag)]
    assert row["source"] == "env"  # the variable beats the file


def test_top_level_keys_apply_to_every_command_that_has_the_option(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('addr = "tcp://10.0.0.5:5555"\n')
    rows = show(args=["--config", str(cfg)])
    for cmd in ("push", "status", "abort"):
        assert rows[(cmd, "--addr")]["value"] == "tcp://10.0.0.5:5555"
        assert rows[(cmd, "--addr")]["source"] == "config file"


def test_a_flag_beats_the_environment(tmp_path):
    (tmp_path / "ckpt").mkdir()
    code, out, err = run(
        ["push", str(tmp_path / "ckpt"), "--version", "1", "--window", "0"], {"WEIGHTSYNC_WINDOW": "3"}
    )
    # the flag's 0 was used (and refused), not the variable's 3 (which would have gone on
    # to read the empty checkpoint directory)
    assert code == 2 and "greater than or equal to 1" in err and "checkpoint" not in err.lower(), err
    code, out, err = run(["push", str(tmp_path / "ckpt"), "--version", "1"], {"WEIGHTSYNC_WINDOW": "3"})
    assert code == 2 and "checkpoint" in err.lower(), err
    code, out, err = run(["push", str(tmp_path / "ckpt"), "--version", "1"], {"WEIGHTSYNC_WINDOW": "0"})
    assert code == 2 and "greater than or equal to 1" in err, err  # validated like the flag


def test_an_unknown_config_key_is_a_one_line_usage_error(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[push]\nwindoww = 3\n")
    code, out, err = run(["--config", str(cfg), "config", "show"])
    assert code == 2 and "windoww" in err


def test_a_misspelled_table_is_a_one_line_usage_error_naming_it(tmp_path):
    cfg = tmp_path / "typo.toml"
    cfg.write_text("[serv]\nmin-engines = 2\n")
    code, out, err = run(["--config", str(cfg), "config", "show"])
    assert code == 2 and "[serv]" in err and str(cfg) in err and "serve" in err, err
    assert "\n" not in err.strip()


@pytest.mark.parametrize("text", ['[serve]\nmin-engines = "two"\n', 'min-engines = "two"\n'])
def test_a_bad_value_in_the_file_is_refused_naming_the_file(tmp_path, text):
    cfg = tmp_path / "value.toml"
    cfg.write_text(text)
    code, out, err = run(["--config", str(cfg), "config", "show"])
    assert code == 2 and str(cfg) in err and "two" in err and "WEIGHTSYNC_" not in err, err


@pytest.mark.parametrize("args", [["config", "show"], ["serve", "--state-db", "/nonexistent/x.db"]])
def test_a_bad_value_in_the_environment_is_refused_naming_the_variable(tmp_path, args):
    code, out, err = run(args, env={"WEIGHTSYNC_MIN_ENGINES": "two"})
    assert code == 2 and "WEIGHTSYNC_MIN_ENGINES='two'" in err and "config" not in err.split(":")[0], err


CHOICES = [
    ("push", "transport", "inlin"),
    ("engine", "backend", "torhc"),
    ("engine", "pause-mode", "kep"),
    ("serve", "log-level", "verbose"),
    ("demo", "size", "huge"),
]


@pytest.mark.parametrize("command,key,bad", CHOICES)
def test_a_choice_outside_its_options_is_refused_up_front_naming_file_or_variable(
    tmp_path, command, key, bad
):
    """Every choice-valued option is checked before anything runs: in the config file
    (naming it; `config show` too) and in its WEIGHTSYNC_* variable (naming it), exit 2.
    (`transport = "inlin"` was reported without its source, and `backend = "torhc"`
    exited 3 at engine startup.)"""
    cfg = tmp_path / "choice.toml"
    cfg.write_text(f'[{command}]\n{key} = "{bad}"\n')
    code, out, err = run(["--config", str(cfg), "config", "show"])
    assert code == 2 and str(cfg) in err and bad in err, err
    var = "WEIGHTSYNC_" + key.replace("-", "_").upper()
    code, out, err = run(["config", "show"], env={var: bad})
    assert code == 2 and f"{var}={bad!r}" in err, err
    code, out, err = run([command, f"--{key}", bad])
    assert code == 2 and bad in err, err


def test_a_number_for_a_string_option_in_the_file_is_refused(tmp_path):
    """`spool = 5` silently created the directory ./5."""
    cfg = tmp_path / "num.toml"
    cfg.write_text("[serve]\nspool = 5\n")
    code, out, err = run(["--config", str(cfg), "config", "show"])
    assert code == 2 and str(cfg) in err and "--spool takes a string" in err, err
    assert not (Path.cwd() / "5").exists()
