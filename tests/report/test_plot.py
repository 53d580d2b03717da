"""The plot's library imported on a thread beside the final checkpoint's write
(distlm/report/plot.py PlotImport): joined before the plot, its error raised in the caller."""
import importlib
import subprocess
import sys

import pytest

from distlm.report import plot


def test_the_import_runs_on_its_own_thread_and_sets_no_display_backend():
    # A finder that only records which thread asked for pyplot, then lets the normal ones load it.
    code = ("import sys, threading\n"
            "seen = []\n"
            "class Spy:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'matplotlib.pyplot': seen.append(threading.current_thread().name)\n"
            "sys.meta_path.insert(0, Spy())\n"
            "from distlm.report.plot import PlotImport\n"
            "PlotImport().join()\n"
            "import matplotlib; print(seen, matplotlib.get_backend().lower())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["['distlm", "plot", "import']", "agg"]


def test_a_failed_import_is_raised_by_join(monkeypatch):
    def broken(name, *a, **k):
        raise ImportError(f"no module named {name!r} (test)")
    monkeypatch.setattr(plot.importlib, "import_module", broken)
    p = plot.PlotImport()
    with pytest.raises(ImportError, match="matplotlib"):
        p.join()
    monkeypatch.undo()
    assert importlib.import_module("matplotlib") is not None
