"""Where torch.compile keeps what it compiled, so a second run, or another rank, pays less.

torch's inductor keeps compiled graphs (its FX-graph cache), the traced forward and backward
(the AOTAutograd cache) and the generated kernels on disk, keyed by the graph, the torch
version and the device. By default it puts them under the system's temporary folder, which a
reboot or a cleaner may empty, and which other users of the machine can write. distlm points
them at a folder of the user's (train.compile_cache):

    auto    $DISTLM_CACHE_DIR, else $XDG_CACHE_HOME/distlm, else ~/.cache/distlm; with
            compile/ under it. TORCHINDUCTOR_CACHE_DIR, when the user set it, wins (torch's
            own knob; inductor also sets it to its default once it has run in a process).
    off     torch's defaults, untouched
    PATH    that folder

Every rank of a machine uses the same folder; torch writes its entries whole (temporary file
then rename), so ranks that compile the same graph at once do not corrupt each other's entry.
The folder can be copied to another machine with the same torch and card (what a fresh GPU
machine needs to start warm).

The cache is set by environment variable because that is the one place torch reads it, and
inductor's compile workers (subprocesses) inherit it; it is set before anything is compiled.
What the first step took from the cache is read from torch's counters, so the log says
whether the run started cold or warm.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import MutableMapping, Optional

from distlm.cache_home import OWN_ENV, cache_home, unusable

INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def cache_root(setting: str, environ: MutableMapping[str, str]) -> Optional[Path]:
    """The folder train.compile_cache names (None: leave torch's defaults)."""
    if setting == "off":
        return None
    if setting != "auto":
        return Path(setting).expanduser()
    return cache_home(environ) / "compile"


def _entries(folder: Path) -> int:
    """Files already in the FX-graph cache (fxgraph/ holds a folder of entries per graph key):
    any means a run has compiled into this folder before."""
    fx = folder / "fxgraph"
    try:
        return sum(1 for _ in fx.rglob("*") if _.is_file())
    except OSError:
        return 0


def _torch_default(value: str) -> bool:
    """Whether TORCHINDUCTOR_CACHE_DIR holds torch's own default folder: inductor writes it
    there the first time it looks for its cache, so in a process that compiled something
    before, the variable says nothing of the user's wishes."""
    utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    return utils is not None and os.path.abspath(value) == os.path.abspath(utils.default_cache_dir())


@dataclass(frozen=True)
class CompileCache:
    folder: Optional[Path]   # where inductor's caches go; None = torch's defaults
    entries: int             # FX-graph cache files found there before this run: > 0 means warm
    warning: Optional[str]   # a one-line warning when the folder asked for cannot be used
    source: str = "train.compile_cache"  # what chose the folder, for the log

    @property
    def warm(self) -> bool:
        return self.entries > 0

    @classmethod
    def open(cls, setting: str, environ: Optional[MutableMapping[str, str]] = None) -> "CompileCache":
        """Point inductor's caches at the folder ``setting`` names, creating it (mode 0700). A
        folder that cannot be made or written gives a warning and torch's defaults, never a
        failed run: a cache only saves time."""
        environ = os.environ if environ is None else environ
        if setting == "auto" and environ.get(INDUCTOR_ENV) and not _torch_default(environ[INDUCTOR_ENV]):
            folder = Path(environ[INDUCTOR_ENV])
            return cls(folder, _entries(folder), None, INDUCTOR_ENV)
        folder = cache_root(setting, environ)
        if folder is None:
            return cls(None, 0, None)
        why = unusable(folder)
        if why is not None:
            return cls(None, 0, f"warning: train.compile_cache: {folder} is not usable ({why}); compiling "
                                f"without it, in torch's default folder (set train.compile_cache=PATH, "
                                f"{OWN_ENV}, or train.compile_cache=off)")
        environ[INDUCTOR_ENV] = str(folder)
        return cls(folder, _entries(folder), None)

    def describe(self) -> str:
        if self.folder is None:
            return "compile cache: torch's default folder"
        state = f"warm, {self.entries} files" if self.warm else "cold, empty"
        return f"compile cache: {self.folder} ({state}; {self.source})"

    def report(self, seconds: float) -> str:
        """The line after the first step: what it took from the cache, and how long the
        step took (compilation included) after set-up."""
        hits, misses = cache_counters()
        kind = "warm" if hits and not misses else "cold" if misses and not hits else "partly warm" if hits else "none"
        where = str(self.folder) if self.folder is not None else "torch's default folder"
        split = compiler_split()
        said = "" if split is None else (
            f"; in the compiler {split.total:.1f} s (tracing {split.tracing:.1f}, loading from the cache "
            f"{split.loading:.1f}, compiling {split.compiling:.1f}), the rest {max(0.0, seconds - split.total):.1f} s")
        return (f"first step {seconds:.1f} s after set-up, compilation included; compile cache {kind}: "
                f"{hits} graphs loaded, {misses} compiled ({where}){said}")


@dataclass(frozen=True)
class CompilerSplit:
    """Where torch.compile's seconds went so far in this process, from torch's own timers
    (torch._dynamo.utils.compilation_time_metrics): what a warm cache leaves to pay is
    tracing (dynamo runs the Python of each graph again to check it and find its key) and
    loading (the cached graph's code and kernels), not compiling."""
    total: float      # dynamo's compile calls, plus backward graphs compiled when first needed
    tracing: float    # dynamo's bytecode tracing
    loading: float    # graphs taken from the AOTAutograd cache
    compiling: float  # inductor compiling graphs it did not find


# torch's timer names (torch 2.11-2.13); a name a later torch drops counts as 0
_TIMERS = {"total": ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler"),
           "tracing": ("bytecode_tracing",), "loading": ("AOTAutogradCache.inductor_load",),
           "compiling": ("compile_fx_inner",)}


def compiler_split() -> Optional[CompilerSplit]:
    """None when nothing was compiled (the compiler was never imported, or never ran)."""
    utils = sys.modules.get("torch._dynamo.utils")
    timers = getattr(utils, "compilation_time_metrics", None) if utils is not None else None
    if not timers:
        return None
    return CompilerSplit(**{field: sum(sum(timers.get(name, ())) for name in names) for field, names in _TIMERS.items()})


def cache_counters() -> tuple[int, int]:
    """(graphs loaded from the cache, graphs compiled) so far in this process: inductor's
    FX-graph cache hits and misses (0, 0 when nothing was compiled)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:  # nothing compiled: the compiler was never imported
        return 0, 0
    c = utils.counters["inductor"]
    return int(c["fxgraph_cache_hit"]), int(c["fxgraph_cache_miss"])
