"""The set-up line, read by the start-up reports."""
import re
import sys
import textwrap
from pathlib import Path

from distlm.train.metrics import SetupClock

ROOT = Path(__file__).resolve().parents[2]


def _module(tmp_path, monkeypatch, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))


def test_the_reports_read_the_setup_line():
    sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))
    try:
        import speedrun_report
        import startup
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "tools"))
    clock = SetupClock()
    clock.phases = [("device and process group", 0.4), ("compiler import", 1.2), ("weights", 1.0)]
    line = clock.line()
    assert line.startswith("set-up 2.6 s (device and process group 0.4, compiler import 1.2, weights 1.0)"), line
    age = re.search(r"; ([0-9.]+) s since the process started$", line).group(1)  # Linux's /proc
    row = startup.parse(line + "\n")
    assert row["phases"] == {"device and process group": 0.4, "compiler import": 1.2, "weights": 1.0}
    assert speedrun_report.SETUP.search(line).group(1) == age and row["since_start_s"] == float(age)
