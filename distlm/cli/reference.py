"""docs/cli.md, written from the code: the verb table (distlm/cli/__init__.py, each verb's
signature through signature.py) and the config dataclasses (distlm/config.py).

    python -m distlm.cli.reference > docs/cli.md

tests/cli/test_reference.py fails when the committed page and this output differ, so the
reference cannot fall behind a new flag, field or preset.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import types
import typing

import distlm.cli
from distlm.cli import VERBS, build_parser
from distlm.config import AUTO, PRESET_DIR, SECTIONS, list_presets

COMMAND = "python -m distlm.cli.reference > docs/cli.md"


def _cell(text: str) -> str:
    """Table cells hold one line, and a pipe would end the cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _value_name(action: argparse.Action) -> str:
    if action.choices:
        return "|".join(str(c) for c in action.choices)
    return action.metavar or action.dest.upper()


def _synopsis(name: str, parser: argparse.ArgumentParser) -> str:
    """One line, like argparse's usage but unwrapped: the terminal's width must not change the page."""
    words = [f"distlm {name}"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if not action.option_strings:  # positional
            word = f"{_value_name(action)}..." if action.nargs in ("+", "*") else _value_name(action)
            words.append(f"[{word}]" if action.nargs == "*" else word)
            continue
        flag = action.option_strings[0]
        word = flag if action.nargs == 0 else f"{flag} {_value_name(action)}"
        if action.nargs in ("+", "*"):
            word += "..."
        words.append(word if action.required else f"[{word}]")
    return " ".join(words)


def _default(action: argparse.Action) -> str:
    d = action.default
    if d is None or d is False or d == [] or action.nargs == 0:
        return ""
    return f"`{d}`"


def verb_section(name: str, parser: argparse.ArgumentParser) -> list[str]:
    doc = inspect.getdoc(VERBS[name]) or ""
    out = [f"### `distlm {name}`", "", "```text", _synopsis(name, parser), "```", "", "```text", doc, "```", ""]
    rows = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    if rows:
        out += ["| argument | default | what it sets |", "|---|---|---|"]
        for a in rows:
            arg = ", ".join(a.option_strings) or _value_name(a)
            if a.option_strings and a.nargs != 0:
                arg += f" {_value_name(a)}"
            out.append(f"| `{_cell(arg)}` | {_default(a)} | {_cell(a.help or '')} |")
        out.append("")
    return out


def _type_name(f: dataclasses.Field, hint) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    name = getattr(hint, "__name__", str(hint))
    choices = f.metadata.get("choices")
    if choices:
        name = " \\| ".join(choices)
    if f.metadata.get("auto"):
        name += f" \\| {AUTO}"
    return name


def _field_default(f: dataclasses.Field) -> str:
    if f.metadata.get("auto"):
        return f"`{AUTO}`"
    value = f.default
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == "":
        return '`""`'
    return f"`{value}`"


def config_section(section: str, cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    doc = inspect.getdoc(cls) or ""
    out = [f"### `{section}`", ""]
    if doc and not doc.startswith(cls.__name__ + "("):  # dataclasses write their signature as the docstring
        out += [" ".join(doc.split()), ""]
    out += ["| field | type | default | what it sets |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):  # a nested section: a row per field of its own
            sub = typing.get_type_hints(hints[f.name])
            out += [f"| `{section}.{f.name}.{g.name}` | {_type_name(g, sub[g.name])} | {_field_default(g)} | "
                    f"{_cell(g.metadata.get('help', ''))} |" for g in dataclasses.fields(hints[f.name])]
            continue
        out.append(f"| `{section}.{f.name}` | {_type_name(f, hints[f.name])} | {_field_default(f)} | "
                   f"{_cell(f.metadata.get('help', ''))} |")
    return out + [""]


def _preset_summary(name: str) -> str:
    """The first sentence of the preset file's opening comment."""
    lines = []
    for line in (PRESET_DIR / f"{name}.yaml").read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(lines)
    end = text.find(". ")
    return _cell(text if end < 0 else text[:end + 1])


def reference() -> str:
    parser = build_parser()
    cli_doc = inspect.getdoc(distlm.cli) or ""
    conventions = cli_doc.split("Conventions:", 1)[1] if "Conventions:" in cli_doc else ""
    out = [
        "# CLI and config reference",
        "",
        "Written from the code by `" + COMMAND + "`: the verb table (`distlm/cli/__init__.py`, each verb's",
        "signature) and the config dataclasses (`distlm/config.py`). `tests/cli/test_reference.py` fails when",
        "this page and the code differ; change the code, then regenerate.",
        "",
        "Conventions: " + " ".join(conventions.split()),
        "",
        "## Verbs",
        "",
        "| verb | what it does |",
        "|---|---|",
    ]
    for name, fn in VERBS.items():
        out.append(f"| [`distlm {name}`](#distlm-{name}) | {_cell((inspect.getdoc(fn) or '').splitlines()[0])} |")
    out += ["| `distlm --version` | the version |", ""]
    for name in VERBS:
        out += verb_section(name, parser.verb_parsers[name])
    out += [
        "## Config",
        "",
        "One frozen tree of dataclasses. A setting comes from the field's default, then `--config` (a",
        "YAML file or a preset), then `section.key=value` overrides. `model=PRESET` takes a preset's",
        "architecture; `task=classify` is short for `task.name=classify`. A field whose default is",
        "`auto` is chosen when a run starts, for its device and layout (`distlm/train/fast_defaults.py`),",
        "and the run's `config.yaml` records the value chosen.",
        "",
        "### Presets",
        "",
        "| preset | what it is |",
        "|---|---|",
    ]
    for name in list_presets():
        out.append(f"| `{name}` | {_preset_summary(name)} |")
    out.append("")
    for section, cls in SECTIONS.items():
        out += config_section(section, cls)
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> int:
    print(reference(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
