"""The folder of the user's that distlm keeps its caches in, and whether a folder can hold one.

    $DISTLM_CACHE_DIR, else $XDG_CACHE_HOME/distlm, else ~/.cache/distlm

Under it: bytecode/ (Python's compiled imports where the installation keeps none,
distlm/bytecode.py). Light: the program's entry reads it before torch is imported.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Mapping, Optional

OWN_ENV = "DISTLM_CACHE_DIR"


def cache_home(environ: Mapping[str, str]) -> Path:
    if environ.get(OWN_ENV):
        return Path(environ[OWN_ENV]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".cache")
    return Path(base).expanduser() / "distlm"


def unusable(folder: Path) -> Optional[str]:
    """None when the folder can be made (mode 0700) and written to, else why not (one phrase)."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as e:
        return e.strerror or type(e).__name__
    return None
