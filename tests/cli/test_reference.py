"""docs/cli.md is the output of `python -m distlm.cli.reference`: the verb table and the
config dataclasses, written out. A flag, field or preset added without regenerating the page
fails here, with the command that fixes it."""
import dataclasses
import difflib
import os
import subprocess
import sys
from pathlib import Path

from distlm.cli import VERBS, build_parser
from distlm.cli.reference import COMMAND, reference
from distlm.config import SECTIONS, list_presets

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "cli.md"


def test_committed_page_is_the_generated_one():
    assert PAGE.is_file(), f"docs/cli.md is missing; run: {COMMAND}"
    committed, generated = PAGE.read_text(), reference()
    if committed != generated:
        diff = "".join(list(difflib.unified_diff(committed.splitlines(True), generated.splitlines(True),
                                                 "docs/cli.md", "generated"))[:40])
        raise AssertionError(f"docs/cli.md differs from the code; run: {COMMAND}\n{diff}")


def test_page_names_every_verb_flag_field_and_preset():
    """The generator itself: nothing in the verb table or the config tree is left out."""
    page = reference()
    parsers = build_parser().verb_parsers
    for name in VERBS:
        assert f"### `distlm {name}`" in page, name
        for action in parsers[name]._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in page.split(f"### `distlm {name}`", 1)[1].split("\n### ", 1)[0], (name, flag)
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            nested = getattr(cls(), f.name)
            if dataclasses.is_dataclass(nested):  # a nested section (model.moe): a row per field
                for g in dataclasses.fields(nested):
                    assert f"| `{section}.{f.name}.{g.name}` |" in page, f"{section}.{f.name}.{g.name}"
                continue
            assert f"| `{section}.{f.name}` |" in page, f"{section}.{f.name}"
    for preset in list_presets():
        assert f"| `{preset}` |" in page, preset


def test_module_command_prints_the_page():
    """The command the page names is the one that writes it (no terminal width in it)."""
    env_cols = {"COLUMNS": "40", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "distlm.cli.reference"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, **env_cols}, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == reference()
