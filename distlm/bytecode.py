"""Python's compiled imports, kept where the next distlm process finds them.

Python compiles every module it imports to bytecode and normally keeps the result beside the
source (``__pycache__/*.pyc``), so the next import skips the compile. Some installations keep
none and cannot: a container image built with ``PYTHONDONTWRITEBYTECODE=1`` or
``pip install --no-compile``, or a read-only site-packages. There every process compiles
torch's sources again, and torch is large: on the 2-core box, torch's import takes 1.0 s with
its bytecode and 2.5-2.8 s without, and the compiler's (dynamo and inductor, which every
compiled run imports) 1.8 s against 5.2-5.5 s.

So a distlm process started as a program (``distlm VERB``, ``python -m distlm``, each rank under
torchrun) looks, before it imports torch, for torch's bytecode beside its sources. If there is
none it points Python's bytecode at a folder of the user's (``sys.pycache_prefix``, the
``PYTHONPYCACHEPREFIX`` mechanism): the first process writes it there, every later one reads
it. Python checks each file against its source's size and time, so an upgraded package is
compiled again, not run stale. ``PYTHONPYCACHEPREFIX`` is also set in the environment (and
``PYTHONDONTWRITEBYTECODE`` taken out of it), so the processes distlm starts (inductor's compile
workers, the ranks of ``distlm train --nproc-per-node``) read and write the same folder.

    DISTLM_BYTECODE_CACHE=auto   the default: the bytecode/ folder of distlm's cache home
                                 (distlm/cache_home.py), only where torch has no bytecode
    DISTLM_BYTECODE_CACHE=off    leave Python's own behaviour
    DISTLM_BYTECODE_CACHE=PATH   that folder, whether or not torch has bytecode

A ``PYTHONPYCACHEPREFIX`` the user set wins. A folder that cannot be written leaves Python as
it was: a cache only saves time. Ranks that compile one module at once do not collide: Python
writes each file under a temporary name and renames it.

A cold start, an empty folder, has each process compile torch's sources as it imports them,
one file after another: about 10 s of the 13-14 s set-up of a cold run on the GPU machines
(2026-11-28), while the machine's other cores wait. So when the folder holds no bytecode of
torch yet, the process also starts a background one (``python -m distlm.bytecode``, at a lower
priority) that compiles the sources of the packages a training run imports into the folder, on
all cores but one, in the order the run imports them. The importing process finds what it has
written and compiles the rest itself; Python writes each file atomically, so the two never read
half a file. One runs per folder at a time (a lock file in it; ranks started together share
it). ``DISTLM_BYTECODE_PRECOMPILE=off`` leaves the importing process to compile alone.
Measured on the 2-core CPU box (2026-11-28): the whole set (torch, sympy, numpy, jinja2,
networkx, mpmath: 4,995 files) compiles in 9.7 s on 2 workers, about 20 CPU seconds; importing
torch and inductor from an empty folder took 10.6-13.5 s alone and 7.0-9.4 s beside the
background compile on the one other core (3.5-4.8 s warm). A CPU training run, which does not
import the compiler, was not faster (12.9-16.2 s against 13.6-14.7 s): two cores leave the
background nothing of its own. On a GPU machine's 16 or more cores it is not measured yet.

A torchrun started from the shell imports torch before distlm runs, without this folder;
``distlm train --nproc-per-node N`` runs torchrun's entry point after it is set
(distlm/launch/local.py), and ``PYTHONPYCACHEPREFIX`` exported in the shell (to the folder
``distlm env`` names) does the same for torchrun itself.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, MutableMapping, Optional, Sequence

from distlm.cache_home import cache_home, unusable
from distlm.host import usable_cores

OWN_ENV = "DISTLM_BYTECODE_CACHE"
PYTHON_ENV = "PYTHONPYCACHEPREFIX"
# The package whose bytecode tells whether the installation keeps any: the largest import.
CHECKED = ("torch",)
PRECOMPILE_ENV = "DISTLM_BYTECODE_PRECOMPILE"
# What a training run imports that is large enough to matter, largest first. Within torch the
# subpackages that `import torch` and the compiler (dynamo, inductor) load come before the rest
# of it, so the background compile runs ahead of the import that needs them.
PRECOMPILED = ("torch", "sympy", "triton", "numpy", "jinja2", "networkx", "mpmath")
TORCH_FIRST = ("utils", "_C", "nn", "fx", "_subclasses", "_prims_common", "_functorch", "_dynamo", "_inductor",
               "_higher_order_ops", "_library", "_decomp", "_prims", "_refs", "distributed", "cuda", "optim",
               "_export", "export", "autograd", "amp", "backends")
# A lock older than this is from a compile that died: the next process may start another.
LOCK_STALE_S = 600.0


@dataclass(frozen=True)
class BytecodeCache:
    folder: Optional[Path]  # where this process's bytecode goes; None: beside the sources, as Python does
    why: str                # one phrase: what chose it


def has_bytecode(package: str) -> Optional[bool]:
    """Whether the package's ``__init__`` has bytecode beside its source (found without importing
    it); None when the package is not installed or has no source file."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    # cache_from_source honours sys.pycache_prefix; beside the source is what is asked here.
    prefix, sys.pycache_prefix = sys.pycache_prefix, None
    try:
        return os.path.exists(importlib.util.cache_from_source(spec.origin))
    finally:
        sys.pycache_prefix = prefix


def choose(environ: MutableMapping[str, str], packages: Sequence[str] = CHECKED) -> BytecodeCache:
    """Where the bytecode should go, by the rules in the module docstring; changes nothing."""
    setting = environ.get(OWN_ENV, "auto") or "auto"
    if sys.pycache_prefix is not None or environ.get(PYTHON_ENV):
        return BytecodeCache(None if sys.pycache_prefix is None else Path(sys.pycache_prefix),
                             f"{PYTHON_ENV}, the user's")
    if setting == "off":
        return BytecodeCache(None, f"{OWN_ENV}=off")
    if setting == "auto":
        missing = [p for p in packages if has_bytecode(p) is False]
        if not missing:
            return BytecodeCache(None, "the installation keeps its own")
        folder, why = cache_home(environ) / "bytecode", f"{missing[0]} has no bytecode beside its sources"
    else:
        folder, why = Path(setting).expanduser(), OWN_ENV
    problem = unusable(folder)
    if problem is not None:
        return BytecodeCache(None, f"{folder} is not usable: {problem}")
    return BytecodeCache(folder, why)


def use(environ: MutableMapping[str, str] = os.environ, packages: Sequence[str] = CHECKED) -> BytecodeCache:
    """Apply ``choose``'s answer to this process (before its heavy imports) and its children."""
    cache = choose(environ, packages)
    if cache.folder is not None and sys.pycache_prefix is None:
        sys.pycache_prefix = str(cache.folder)
        # The point is to write it, once; PYTHONDONTWRITEBYTECODE was about the source tree. The
        # processes started from here (the ranks of `distlm train --nproc-per-node`, the compiler's
        # workers) import modules this one does not, so they write into the folder too.
        sys.dont_write_bytecode = False
        environ.pop("PYTHONDONTWRITEBYTECODE", None)
        environ[PYTHON_ENV] = str(cache.folder)
    return cache


def _in_folder(package: str, folder: Path) -> Optional[bool]:
    """Whether the package's ``__init__`` already has bytecode in ``folder``; None when the
    package is not installed or has no source file."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    prefix, sys.pycache_prefix = sys.pycache_prefix, str(folder)
    try:
        return os.path.exists(importlib.util.cache_from_source(spec.origin))
    finally:
        sys.pycache_prefix = prefix


def precompile_roots(folder: Path, packages: Sequence[str] = PRECOMPILED) -> list[Path]:
    """The source folders of the packages with no bytecode in ``folder`` yet, in ``packages``'
    order. Bytecode beside the sources does not count: with a folder chosen, Python reads only
    the folder's."""
    roots = []
    for package in packages:
        if _in_folder(package, folder) is False:
            roots.append(Path(importlib.util.find_spec(package).origin).parent)
    return roots


def _lock(folder: Path) -> Optional[Path]:
    """The folder's precompile lock, taken; None when another process holds it."""
    lock = folder / "precompile.lock"
    for _ in range(2):
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return lock
        except FileExistsError:
            try:
                if time.time() - lock.stat().st_mtime < LOCK_STALE_S:
                    return None
                lock.unlink()
            except FileNotFoundError:
                pass
        except OSError:
            return None
    return None


def precompile_in_background(cache: BytecodeCache, environ: MutableMapping[str, str] = os.environ,
                             packages: Sequence[str] = PRECOMPILED) -> Optional[subprocess.Popen]:
    """On a cold folder, start the background compile the module docstring describes; None when
    there is no folder, nothing to compile, it is switched off or another process runs it."""
    if cache.folder is None or environ.get(PRECOMPILE_ENV, "auto") == "off" or not sys.executable:
        return None
    roots = precompile_roots(cache.folder, packages)
    if not roots:
        return None
    lock = _lock(cache.folder)
    if lock is None:
        return None
    cores = usable_cores()
    env = dict(environ, **{PYTHON_ENV: str(cache.folder)})
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    try:
        # More workers than a few dozen only add start-up: the whole set is ~20 CPU seconds.
        workers = max(1, min(cores - 1, 32))
        return subprocess.Popen([sys.executable, "-m", "distlm.bytecode", "--workers", str(workers),
                                 "--lock", str(lock), *map(str, roots)],
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        lock.unlink(missing_ok=True)
        return None


def _sources(root: Path) -> Iterator[Path]:
    """A package's .py files, its own first, then its subfolders; torch's in TORCH_FIRST order."""
    yield from sorted(root.glob("*.py"))
    subdirs = sorted(d for d in root.iterdir() if d.is_dir() and d.name != "__pycache__")
    if root.name == "torch":
        first = [root / name for name in TORCH_FIRST if (root / name).is_dir()]
        subdirs = first + [d for d in subdirs if d not in first]
    for sub in subdirs:
        for folder, dirs, files in os.walk(sub):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            yield from (Path(folder) / f for f in sorted(files) if f.endswith(".py"))


def _compile(path: Path) -> bool:
    # compileall skips a file whose bytecode is already there and current (the importing
    # process may have written it first); quiet=2: a file that does not compile is left to the
    # import, which reports it as Python would.
    import compileall
    return bool(compileall.compile_file(str(path), quiet=2))


def _precompile(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m distlm.bytecode",
                                description="compile packages' sources into PYTHONPYCACHEPREFIX (distlm's cold starts)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--lock", type=Path, help="a lock file to remove when done")
    p.add_argument("roots", nargs="+", type=Path)
    a = p.parse_args(argv)
    try:
        try:
            os.nice(10)  # the importing process comes first
        except OSError:
            pass
        files = [f for root in a.roots for f in _sources(root)]
        if a.workers > 1:
            from concurrent.futures import ProcessPoolExecutor
            with ProcessPoolExecutor(a.workers) as pool:
                list(pool.map(_compile, files, chunksize=8))
        else:
            for f in files:
                _compile(f)
    finally:
        if a.lock is not None:
            a.lock.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(_precompile(sys.argv[1:]))
