"""What the first step took from torch.compile's cache, said in one line after it.

torch's inductor keeps compiled graphs (its FX-graph cache), the traced forward and backward
(the AOTAutograd cache) and the generated kernels on disk, keyed by the graph, the torch
version and the device, in ``TORCHINDUCTOR_CACHE_DIR`` (torch's own knob), else a folder of
its own under the system's temporary folder. A second run, or another rank, loads what an
earlier one compiled. The counters and timers are torch's, read after the first step, so the
log says whether the run started cold or warm, how many graphs were loaded or compiled, and
where the compiler's seconds went.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Mapping, Optional

INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def inductor_folder(environ: Optional[Mapping[str, str]] = None) -> str:
    """The folder inductor uses: TORCHINDUCTOR_CACHE_DIR where set (inductor also sets it to
    its default once it has looked for its cache), else torch's default."""
    environ = os.environ if environ is None else environ
    if environ.get(INDUCTOR_ENV):
        return environ[INDUCTOR_ENV]
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    return default_cache_dir()


def first_step_report(seconds: float) -> str:
    """The line after the first step: what it took from the cache, and how long the step
    took (compilation included) after set-up."""
    hits, misses = cache_counters()
    kind = "warm" if hits and not misses else "cold" if misses and not hits else "partly warm" if hits else "none"
    split = compiler_split()
    said = "" if split is None else (
        f"; in the compiler {split.total:.1f} s (tracing {split.tracing:.1f}, loading from the cache "
        f"{split.loading:.1f}, compiling {split.compiling:.1f}), the rest {max(0.0, seconds - split.total):.1f} s")
    return (f"first step {seconds:.1f} s after set-up, compilation included; compile cache {kind}: "
            f"{hits} graphs loaded, {misses} compiled ({inductor_folder()}){said}")


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
