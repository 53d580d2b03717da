"""A background import: modules imported on a thread of its own (the Trainer's plot import,
beside the final checkpoint's write), joined before they are needed; and the set-up line read
by the start-up reports."""
import re
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from distlm.train.metrics import SetupClock
from distlm.train.setup import BackgroundImport

ROOT = Path(__file__).resolve().parent.parent


def _module(tmp_path, monkeypatch, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))


def test_the_import_runs_on_another_thread_and_join_waits_for_it(tmp_path, monkeypatch):
    # the module blocks until the test lets it finish: join() must wait for the whole import
    _module(tmp_path, monkeypatch, "startup_slow_mod", """
        import threading
        import startup_gate
        ran_on = threading.current_thread().name
        startup_gate.release.wait()
        done = True
        """)
    gate = type(sys)("startup_gate")
    gate.release = threading.Event()
    monkeypatch.setitem(sys.modules, "startup_gate", gate)
    monkeypatch.delitem(sys.modules, "startup_slow_mod", raising=False)
    bg = BackgroundImport(["startup_slow_mod"], name="slow import").start()
    waiter = threading.Thread(target=bg.join)
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive(), "join() returned before the import had finished"
    gate.release.set()
    waiter.join()
    bg.join()
    mod = sys.modules["startup_slow_mod"]
    assert mod.done and mod.ran_on != threading.main_thread().name


def test_a_failed_import_is_raised_by_join_in_the_caller(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "startup_broken_mod", "raise ImportError('no such compiler here')\n")
    monkeypatch.delitem(sys.modules, "startup_broken_mod", raising=False)
    bg = BackgroundImport(["startup_broken_mod"]).start()
    with pytest.raises(ImportError, match="no such compiler here"):
        bg.join()
    with pytest.raises(ImportError):  # every join says so, not only the first
        bg.join()


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
