"""Light commands stay light: building the parser, `--help`, usage errors and
`--print-config` never import torch (whose import alone takes seconds on a small box).
Checked on the module table, not on a clock, so a loaded machine cannot make it flaky."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Each command line runs through `python -m distlm` (runpy, as the console does), in one
# fresh interpreter; the exit status and whether torch got imported are recorded per line.
PROBE = textwrap.dedent("""
    import json, runpy, sys
    lines = json.loads(sys.argv[1])
    out = []
    for argv in lines:
        sys.argv = ["distlm", *argv]
        try:
            runpy.run_module("distlm", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code
        out.append([argv, code, "torch" in sys.modules])
        if "torch" in sys.modules:
            break  # the rest would pass whatever they import
    print("PROBE " + json.dumps(out))
""")

LIGHT = [
    ["--help"],
    ["--version"],
    ["train", "--help"],
    ["predict", "--help"],
    ["export", "--help"],
    ["demo", "--help"],
    ["train", "--max-steps", "5"],                   # a config field written as a flag
    ["train", "train.max_stpes=5"],                  # a misspelt override
    ["eval"],                                        # a required flag missing
    ["generate", "--checkpoint", "x", "--device", "tpu"],  # a bad choice
    ["train", "--config", "demo", "--print-config"],
    ["frobnicate"],                                  # an unknown verb
]


def run_probe(lines):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(lines)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    got = next(line for line in r.stdout.splitlines() if line.startswith("PROBE "))
    return json.loads(got[len("PROBE "):]), r


def test_light_commands_do_not_import_torch():
    results, r = run_probe(LIGHT)
    heavy = [" ".join(argv) for argv, _, torch_loaded in results if torch_loaded]
    assert not heavy, f"imported torch: distlm {heavy[0]}"
    assert len(results) == len(LIGHT)
    codes = {" ".join(argv): code for argv, code, _ in results}
    assert codes["--help"] == 0 and codes["train --config demo --print-config"] in (0, None)
    assert codes["train --max-steps 5"] == 2 and codes["train train.max_stpes=5"] == 2 and codes["eval"] == 2
    assert codes["frobnicate"] == 2
    assert "use train.max_steps=5" in r.stderr and "qk_norm: true" in r.stdout


def test_the_heavy_errors_keep_their_exit_status(tmp_path, capsys):
    """A CheckpointError (2) and a TrainingStopped (3) are still told from a bug, though the CLI
    no longer imports their modules up front."""
    from distlm.checkpoint.errors import CheckpointError
    from distlm.cli import _status_of
    from distlm.train.faults import TrainingStopped
    assert _status_of(CheckpointError("x")) == 2 and _status_of(TrainingStopped("y")) == 3
    assert _status_of(RuntimeError("a bug")) is None
    from distlm.cli import main
    assert main(["eval", "--checkpoint", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
