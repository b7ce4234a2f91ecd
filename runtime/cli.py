"""Command-line overrides generated from a config dataclass.

Every field of the dataclass is a flag: `--name=value` or `--name value`. `--preset NAME` picks a named set of
overrides first; explicit flags win over the preset. The help text of a flag is the comment on its field, so
the dataclass stays the one place where a setting is described.
"""
import dataclasses
import difflib
import inspect
import re

from runtime.errors import UserError

_TRUE, _FALSE = {"1", "true", "yes"}, {"0", "false", "no"}


def _field_comments(cls) -> dict[str, str]:
    """Map field name -> the comment at the end of its line in the class source."""
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+)\s*:[^#]*#\s*(.*)$", line)
        if m:
            comments[m.group(1)] = m.group(2).strip()
    return comments


def _convert(name: str, kind: type, text: str):
    try:
        if kind is bool:
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            raise ValueError
        return kind(text)
    except ValueError:
        expected = {int: "an integer", float: "a number", bool: "1 or 0", str: "a string"}[kind]
        raise UserError(f"--{name} expects {expected}, got {text!r} (see --help)") from None


HELP_COLUMN = 32  # widest "--name=default" that the help aligns


def _help(cls, presets: dict) -> str:
    comments = _field_comments(cls)
    lines = [f"usage: train_gpt2.py [--preset {{{','.join(presets)}}}] [--name=value ...]", "", "flags:"]
    flags = {f.name: f"--{f.name}={f.default!r}" for f in dataclasses.fields(cls)}
    # one column for the help texts; the few flags longer than HELP_COLUMN (glob defaults) push theirs right
    width = max(len(flag) for flag in flags.values() if len(flag) <= HELP_COLUMN)
    lines += [f"  {flag:<{width}}  {comments.get(name, '')}" for name, flag in flags.items()]
    return "\n".join(lines)


def parse_config(cls, argv: list[str], presets: dict[str, dict]):
    """Build a `cls` instance from `argv`; raises UserError naming the flag on any mistake.

    Prints the help and raises SystemExit(0) for -h/--help.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    types = inspect.get_annotations(cls, eval_str=True)
    given: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(_help(cls, presets))
            raise SystemExit(0)
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument {arg!r}: flags look like --name=value (see --help)")
        name, eq, value = arg[2:].partition("=")
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"; did you mean --{close[0]}?" if close else ""
            raise UserError(f"unknown flag --{name}{hint} (see --help for all flags)")
        if not eq:
            if i + 1 >= len(argv):
                raise UserError(f"--{name} needs a value: --{name}=VALUE")
            i += 1
            value = argv[i]
        given[name] = value
        i += 1

    preset = given.get("preset", fields["preset"].default)
    if preset not in presets:
        raise UserError(f"--preset {preset!r} is not a preset; choose one of: {', '.join(presets)}")
    values = dict(presets[preset])
    values.update({name: _convert(name, types[name], text) for name, text in given.items()})  # --preset included
    return cls(**values)
