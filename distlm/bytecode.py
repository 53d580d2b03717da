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

A torchrun started from the shell imports torch before distlm runs, without this folder;
``distlm train --nproc-per-node N`` runs torchrun's entry point after it is set
(distlm/launch/local.py), and ``PYTHONPYCACHEPREFIX`` exported in the shell (to the folder
``distlm env`` names) does the same for torchrun itself.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import MutableMapping, Optional, Sequence

from distlm.cache_home import cache_home, unusable

OWN_ENV = "DISTLM_BYTECODE_CACHE"
PYTHON_ENV = "PYTHONPYCACHEPREFIX"
# The package whose bytecode tells whether the installation keeps any: the largest import.
CHECKED = ("torch",)


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
