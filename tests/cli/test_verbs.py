"""The CLI is one table of plain typed verbs: the parser is read from their signatures, and
the module docstring and the verbs-at-a-glance table of docs/runs.md list every verb."""
import re
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Literal, Optional, Sequence

import pytest

from distlm import cli
from distlm.cli.signature import add_verb, call

ROOT = Path(__file__).resolve().parents[2]


def test_docstring_and_guide_list_every_verb():
    in_doc = set(re.findall(r"^\s+distlm (\w+)", cli.__doc__, re.M))
    readme = (ROOT / "docs" / "runs.md").read_text().split("## The verbs at a glance")[1].split("\n## ")[0]
    in_readme = set(re.findall(r"^\| `distlm (\w+)", readme, re.M))
    assert in_doc == set(cli.VERBS), in_doc ^ set(cli.VERBS)
    assert in_readme == set(cli.VERBS), in_readme ^ set(cli.VERBS)


def test_no_dunder_import_in_the_package():
    paths = list((ROOT / "distlm").rglob("*.py"))
    assert len(paths) > 50, ROOT  # the package itself, not an empty folder
    for path in paths:
        assert "__import__(" not in path.read_text(), path


def toy(names: Annotated[Sequence[str], "some names"], /, *,
        out: Annotated[str, "where to write"],
        n: Annotated[int, "how many"] = 3,
        mode: Literal["fast", "exact"] = "exact",
        dry_run: Annotated[bool, "change nothing"] = False,
        rate: Optional[float] = None) -> int:
    """Do the toy thing.

    A longer description."""
    toy.got = (list(names), out, n, mode, dry_run, rate)
    return 0


@pytest.fixture
def parser():
    p = cli.Parser(prog="distlm")
    sub = p.add_subparsers(dest="verb", required=True)
    add_verb(sub, "toy", toy, {"out": {"metavar": "DIR"}})
    return p


def test_the_parser_is_read_from_the_signature(parser, capsys):
    args = parser.parse_args(["toy", "a", "b", "--out", "o", "--n", "5", "--mode", "fast", "--dry-run",
                              "--rate", "0.5"])
    assert call(args._fn, args) == 0 and toy.got == (["a", "b"], "o", 5, "fast", True, 0.5)
    args = parser.parse_args(["toy", "a", "--out", "o"])
    call(args._fn, args)
    assert toy.got == (["a"], "o", 3, "exact", False, None)  # the defaults are the function's
    with pytest.raises(SystemExit):
        parser.parse_args(["toy", "a", "--out", "o", "--help"])
    help_text = capsys.readouterr().out
    assert "Do the toy thing.\n\nA longer description." in help_text
    assert "--out DIR" in help_text and "how many (default: 3)" in help_text and "{fast,exact}" in help_text
    assert "(default: None)" not in help_text and "(default: False)" not in help_text
    for argv, needle in [(["toy", "--out", "o"], "NAMES"), (["toy", "a"], "--out"),
                         (["toy", "a", "--out", "o", "--mode", "slow"], "invalid choice"),
                         (["toy", "a", "--out", "o", "--n", "1", "--n", "2"], "--n given twice (1 and 2)")]:
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        err = capsys.readouterr().err.splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: distlm toy: ") and needle in err[0]


def test_help_shows_defaults_as_a_user_reads_it():
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    gen, export = [subprocess.Popen([sys.executable, "-m", "distlm", verb, "--help"], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for verb in ("generate", "export")]
    out, err = gen.communicate(timeout=120)
    assert gen.returncode == 0 and err == ""
    flat = " ".join(out.split())
    for needle in ["--max-new-tokens N tokens sampled per completion (default: 200)",
                   "0 = greedy; higher = more varied (default: 0.8)", "0 = off (default: 200)",
                   "--checkpoint RUN_OR_CKPT"]:
        assert needle in flat, needle
    out, err = export.communicate(timeout=120)
    assert export.returncode == 0 and "RUN_OR_CKPT OUT" in out and "{fp32,bf16,fp16}" in out
