"""benchmarks/tools/final_save.py: the final checkpoint's write against the disk, run as a user runs
it, on the CPU (its plumbing and its JSON; the seconds it gives here are not a GPU host's)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "benchmarks" / "tools" / "final_save.py"


def test_every_measurement_is_a_row_and_the_checkpoint_phases_add_up(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(TOOL), "--config", "tiny", "--dir", str(tmp_path / "disk"),
                           "--repeat", "1", "--json", str(out), "--", "model.vocab_size=256"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [r["what"] for r in rows] == ["disk 1", "disk 8", "to host, pageable", "to host, pinned",
                                         "dcp 1", "dcp 8", "dcp 16", "dcp host 8", "save_checkpoint"]
    # every write takes time; on a CPU the state is already on the host, so its copies may round to 0
    assert all(r["s"] > 0 for r in rows if not r["what"].startswith("to host")), rows
    assert all(r["s"] >= 0 for r in rows), rows
    saved = rows[-1]
    assert set(saved["phases"]) == {"checkpoint state", "checkpoint write", "checkpoint checksums",
                                    "checkpoint marker"}, saved
    assert abs(sum(saved["phases"].values()) - saved["s"]) < 0.05, saved
    # the console shows the same rows, one JSON object a line, after the header
    printed = [json.loads(line) for line in done.stdout.splitlines()]
    assert printed[0]["config"] == "tiny" and printed[1:] == rows
    assert not (tmp_path / "disk").exists()  # what it wrote is removed
