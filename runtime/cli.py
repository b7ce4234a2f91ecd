"""Command-line flags from a config dataclass: `--name=value` or `--name value`; `--preset NAME` applies its overrides
first, and explicit flags win. A flag's help is its field's comment, grouped by the `# group` lines above."""
import dataclasses
import difflib
import inspect
import re

from runtime.errors import UserError

_TRUE, _FALSE = {"1", "true", "yes"}, {"0", "false", "no"}
HELP_COLUMN = 32  # widest "--name=default" that the help aligns


def _field_docs(cls) -> tuple[dict[str, str], dict[str, str]]:
    """({field: the comment at the end of its line}, {field: its group, the last `# name` line above it})."""
    comments, groups, group = {}, {}, ""
    for line in inspect.getsource(cls).splitlines():
        if m := re.fullmatch(r"\s+# (\w+)", line):
            group = m.group(1)
        elif m := re.match(r"\s+(\w+)\s*:[^#]*#\s*(.*)$", line):
            comments[m.group(1)], groups[m.group(1)] = m.group(2).strip(), group
    return comments, groups


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


def help_text(cls, presets: dict, preset: str) -> str:
    """The flags by group, each with its value under `preset` and its comment."""
    comments, groups = _field_docs(cls)
    values = {f.name: f.default for f in dataclasses.fields(cls)} | presets[preset] | {"preset": preset}
    flags = {name: f"--{name}={value!r}" for name, value in values.items()}
    width = max(len(flag) for flag in flags.values() if len(flag) <= HELP_COLUMN)
    lines = [f"usage: train_gpt2.py [--preset {{{','.join(presets)}}}] [--name=value ...]",
             f"values shown: --preset {preset}"]
    for group in dict.fromkeys(groups.values()):
        lines += ["", f"{group}:"]
        lines += [f"  {flags[name]:<{width}}  {comments[name]}" for name in flags if groups.get(name) == group]
    return "\n".join(lines)


def parse_flags(cls, argv: list[str], presets: dict[str, dict]) -> dict[str, object]:
    """The flags given in `argv`, converted to their fields' types; a UserError names any mistake. Prints the help
    (with the values of the preset given, if any) and raises SystemExit(0) for -h/--help."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    types = inspect.get_annotations(cls, eval_str=True)
    given: dict[str, str] = {}
    wants_help, i = False, 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("-h", "--help"):
            wants_help = True
            continue
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument {arg!r}: flags look like --name=value (see --help)")
        name, eq, value = arg[2:].partition("=")
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"; did you mean --{close[0]}?" if close else ""
            raise UserError(f"unknown flag --{name}{hint} (see --help for all flags)")
        if not eq:
            if i >= len(argv):
                raise UserError(f"--{name} needs a value: --{name}=VALUE")
            value = argv[i]
            i += 1
        given[name] = value
    preset = given.get("preset", fields["preset"].default)
    if preset not in presets:
        raise UserError(f"--preset {preset!r} is not a preset; choose one of: {', '.join(presets)}")
    if wants_help:
        print(help_text(cls, presets, preset))
        raise SystemExit(0)
    return {name: _convert(name, types[name], text) for name, text in given.items()}


def parse_config(cls, argv: list[str], presets: dict[str, dict]):
    """A `cls` from `argv`: the defaults, then the preset's values, then the flags."""
    given = parse_flags(cls, argv, presets)
    preset = given.get("preset", next(f.default for f in dataclasses.fields(cls) if f.name == "preset"))
    return cls(**(presets[preset] | given))
