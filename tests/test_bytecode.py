"""Where a distlm process keeps the bytecode of its imports (distlm/bytecode.py): the rules, on a
package of the test's own, and the program's entry, on torch, in fresh interpreters."""
import os
import py_compile
import subprocess
import sys
from importlib.util import cache_from_source
from pathlib import Path

import pytest

from distlm import bytecode

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package on sys.path with no bytecode beside its source, and a clean interpreter setting."""
    src = tmp_path / "src" / "bytecode_probe_pkg"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(src.parent))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    return src


def test_a_package_without_bytecode_gets_the_cache_home_folder(package, tmp_path):
    env = {"DISTLM_CACHE_DIR": str(tmp_path / "home"), "PYTHONDONTWRITEBYTECODE": "1"}
    assert bytecode.has_bytecode("bytecode_probe_pkg") is False
    cache = bytecode.use(env, packages=("bytecode_probe_pkg",))
    assert cache.folder == tmp_path / "home" / "bytecode"
    assert cache.why == "bytecode_probe_pkg has no bytecode beside its sources"
    assert sys.pycache_prefix == str(cache.folder) and env["PYTHONPYCACHEPREFIX"] == str(cache.folder)
    # this process and the ones it starts write there
    assert sys.dont_write_bytecode is False and "PYTHONDONTWRITEBYTECODE" not in env


def test_a_package_with_bytecode_is_left_as_python_keeps_it(package, tmp_path):
    py_compile.compile(str(package / "__init__.py"), cfile=cache_from_source(str(package / "__init__.py")))
    env = {"DISTLM_CACHE_DIR": str(tmp_path / "home")}
    assert bytecode.has_bytecode("bytecode_probe_pkg") is True
    cache = bytecode.use(env, packages=("bytecode_probe_pkg",))
    assert cache.folder is None and "keeps its own" in cache.why
    assert sys.pycache_prefix is None and "PYTHONPYCACHEPREFIX" not in env
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize("setting, expect", [("off", None), ("PATH", "chosen")])
def test_the_setting_turns_it_off_or_names_the_folder(package, tmp_path, setting, expect):
    folder = tmp_path / "chosen"
    env = {"DISTLM_BYTECODE_CACHE": str(folder) if setting == "PATH" else setting,
           "DISTLM_CACHE_DIR": str(tmp_path / "home")}
    cache = bytecode.choose(env, packages=("bytecode_probe_pkg",))
    assert cache.folder == (folder if expect else None)


def test_the_users_prefix_wins_and_an_unwritable_folder_changes_nothing(package, tmp_path):
    user = {"PYTHONPYCACHEPREFIX": str(tmp_path / "mine"), "DISTLM_BYTECODE_CACHE": str(tmp_path / "x")}
    assert bytecode.choose(user).why == "PYTHONPYCACHEPREFIX, the user's"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {"DISTLM_BYTECODE_CACHE": str(blocker / "bytecode")}
    cache = bytecode.use(env, packages=("bytecode_probe_pkg",))
    assert cache.folder is None and "is not usable" in cache.why
    assert sys.pycache_prefix is None and "PYTHONPYCACHEPREFIX" not in env


def test_an_absent_package_is_not_taken_for_one_without_bytecode(package):
    assert bytecode.has_bytecode("no_such_package_anywhere") is None


def test_the_program_writes_torchs_bytecode_once_and_the_next_process_reads_it(tmp_path):
    """`python -m distlm env` under PYTHONDONTWRITEBYTECODE=1 (an image that keeps no bytecode):
    torch's bytecode lands in the folder, and a second process reads it from there."""
    folder = tmp_path / "bytecode"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "DISTLM_BYTECODE_CACHE": str(folder),
           "DISTLM_BYTECODE_PRECOMPILE": "off",  # the import alone writes it (the background compile: below)
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTHONPYCACHEPREFIX", None)
    first = subprocess.run([sys.executable, "-m", "distlm", "env"], capture_output=True, text=True, env=env,
                           timeout=300)
    assert first.returncode == 0, first.stderr
    assert f"bytecode of the imports: {folder}" in first.stdout
    import torch
    source = Path(os.path.abspath(torch.__file__))
    cached = folder / source.parent.relative_to(source.anchor) / f"__init__.{sys.implementation.cache_tag}.pyc"
    assert cached.is_file(), cached
    stamp = cached.stat().st_mtime_ns
    # The second process finds it there: torch's module records the cached file it ran.
    probe = ("from distlm import bytecode; bytecode.use(); import torch, sys; "
             "print(torch.__cached__); print(sys.pycache_prefix)")
    second = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == [str(cached), str(folder)]
    assert cached.stat().st_mtime_ns == stamp  # read, not written again


# ---- the background compile of a cold start ----------------------------------------------------

def _tree(root: Path) -> None:
    """A package with files at the top, a subpackage and a file that does not compile."""
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("VALUE = 1\n")
    (root / "helpers.py").write_text("def f():\n    return 2\n")
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "broken.py").write_text("def (:\n")


def _cached(folder: Path, source: Path) -> Path:
    source = Path(os.path.abspath(source))
    return folder / source.parent.relative_to(source.anchor) / f"{source.stem}.{sys.implementation.cache_tag}.pyc"


def test_a_cold_folder_gets_the_packages_compiled_in_the_background(package, tmp_path):
    _tree(package)
    folder = tmp_path / "bytecode"
    env = {"DISTLM_BYTECODE_CACHE": str(folder), "PYTHONPATH": str(ROOT)}
    cache = bytecode.use(env, packages=("bytecode_probe_pkg",))
    assert bytecode.precompile_roots(folder, ("bytecode_probe_pkg", "no_such_package_anywhere")) == [package]
    proc = bytecode.precompile_in_background(cache, env, packages=("bytecode_probe_pkg",))
    assert proc is not None
    # While it runs, the lock keeps a second process (another rank) from starting another.
    assert (folder / "precompile.lock").exists()
    assert bytecode.precompile_in_background(cache, env, packages=("bytecode_probe_pkg",)) is None
    assert proc.wait(timeout=120) == 0
    for source in ("__init__.py", "helpers.py", "sub/__init__.py"):
        assert _cached(folder, package / source).is_file(), source
    assert not _cached(folder, package / "sub" / "broken.py").exists()  # left for the import to report
    assert not (folder / "precompile.lock").exists()
    # Warm now: nothing to do.
    assert bytecode.precompile_roots(folder, ("bytecode_probe_pkg",)) == []
    assert bytecode.precompile_in_background(cache, env, packages=("bytecode_probe_pkg",)) is None


def test_it_can_be_switched_off_and_a_stale_lock_is_taken_over(package, tmp_path):
    _tree(package)
    folder = tmp_path / "bytecode"
    folder.mkdir()
    cache = bytecode.BytecodeCache(folder, "test")
    off = {"DISTLM_BYTECODE_PRECOMPILE": "off", "PYTHONPATH": str(ROOT)}
    assert bytecode.precompile_in_background(cache, off, packages=("bytecode_probe_pkg",)) is None
    lock = folder / "precompile.lock"
    lock.write_text("")
    env = {"PYTHONPATH": str(ROOT)}
    assert bytecode.precompile_in_background(cache, env, packages=("bytecode_probe_pkg",)) is None  # a fresh lock
    old = lock.stat().st_mtime - bytecode.LOCK_STALE_S - 1
    os.utime(lock, (old, old))
    proc = bytecode.precompile_in_background(cache, env, packages=("bytecode_probe_pkg",))
    assert proc is not None and proc.wait(timeout=120) == 0
    assert _cached(folder, package / "helpers.py").is_file()
    # No folder (an installation that keeps its own bytecode): nothing starts.
    assert bytecode.precompile_in_background(bytecode.BytecodeCache(None, "x"), env) is None


def test_torchs_own_files_come_first_then_the_subpackages_a_run_imports_first(tmp_path):
    torch_dir = tmp_path / "torch"
    for sub in ("ao", "_inductor", "nn", "utils"):
        (torch_dir / sub).mkdir(parents=True)
        (torch_dir / sub / "m.py").write_text("")
    (torch_dir / "__init__.py").write_text("")
    (torch_dir / "zz.py").write_text("")
    order = [str(p.relative_to(torch_dir)) for p in bytecode._sources(torch_dir)]
    assert order == ["__init__.py", "zz.py", "utils/m.py", "nn/m.py", "_inductor/m.py", "ao/m.py"]


def test_the_program_starts_the_background_compile_with_the_folder_it_chose(monkeypatch):
    from distlm import cli
    chosen = bytecode.BytecodeCache(Path("/somewhere"), "test")
    calls = []
    monkeypatch.setattr(bytecode, "use", lambda: chosen)
    monkeypatch.setattr(bytecode, "precompile_in_background", lambda cache: calls.append(cache))
    monkeypatch.setattr(cli, "main", lambda: 0)
    assert cli.run() == 0
    assert calls == [chosen]
