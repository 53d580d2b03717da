"""How many compile workers each process of a machine may start.

inductor compiles a graph's GPU kernels in a pool of worker processes: min(32, the cores the
process may run on) of them, started at the first ``torch.compile`` whether or not the compile
cache then holds every kernel, each worker importing torch. Every rank of a machine starts a pool
of its own, and torch does not know of the others: 4 ranks on a 64-core host start 128 workers
(plus a sidecar each), twice the cores, at the moment the ranks trace their graphs on those same
cores. A rank that traces slower holds the others at the first collective.

So distlm gives each rank its share of the cores: the cores this process may use, divided by the
ranks on this host (torchrun's LOCAL_WORLD_SIZE), at most torch's 32 and at least 1. One process
keeps torch's own count, so a one-GPU run is unchanged. ``TORCHINDUCTOR_COMPILE_THREADS``, torch's
own knob, wins when the user set it. The count goes into that variable, which inductor reads when
it is imported and which its workers inherit; it is set before the compiler is imported
(distlm/train/trainer.py), and into inductor's config too where that is already imported.

With one worker, inductor compiles in the rank's own process (no pool): that is where the share
comes to on a machine with as many cores as ranks.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import MutableMapping, Optional

from distlm.config import ConfigError
from distlm.host import local_ranks, usable_cores

ENV = "TORCHINDUCTOR_COMPILE_THREADS"
# torch's own cap (torch._inductor.config.decide_compile_threads)
TORCH_CAP = 32


def share(cores: int, local_ranks: int) -> int:
    """Each of ``local_ranks`` processes' compile workers on ``cores`` cores."""
    return max(1, min(TORCH_CAP, cores // max(1, local_ranks)))


@dataclass(frozen=True)
class CompileWorkers:
    count: int          # workers each rank may start
    cores: int          # cores this process may use
    local_ranks: int    # processes on this host
    source: str         # what chose the count

    @classmethod
    def set(cls, environ: Optional[MutableMapping[str, str]] = None,
            cores: Optional[int] = None) -> "CompileWorkers":
        """Choose this process's count and set it where inductor reads it. A count the user gave
        in the environment stays; so does torch's own where this is the only rank on the host."""
        environ = os.environ if environ is None else environ
        cores = usable_cores() if cores is None else cores
        local = local_ranks(environ)
        given = environ.get(ENV, "").strip()
        if given:
            if not given.isdigit() or int(given) < 1:
                # inductor would fail on it at its import, with a traceback
                raise ConfigError(f"{ENV}={given!r}: the compile workers each rank starts must be a whole "
                                  f"number >= 1 (1: compile in the rank's own process); unset it for distlm's choice")
            return cls(int(given), cores, local, ENV)
        if local <= 1:
            return cls(share(cores, 1), cores, local, "torch's default")
        count = share(cores, local)
        environ[ENV] = str(count)
        config = sys.modules.get("torch._inductor.config")
        if config is not None and environ is os.environ:
            # Imported already (by an earlier compile in this process): its pool, if any, has
            # started; a later one would start with this count.
            config.compile_threads = count
        return cls(count, cores, local, f"{cores} cores shared by {local} ranks on this host")

    def describe(self) -> str:
        return f"compile workers: {self.count} a rank ({self.source})"

