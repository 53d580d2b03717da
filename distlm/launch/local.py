"""`distlm train --nproc-per-node N`: N processes on this machine, started by torchrun itself.

    distlm train --nproc-per-node 4 --config speedrun-124m parallel.dp_replicate=4 ...
    # the same processes as
    torchrun --standalone --nproc_per_node 4 -m distlm train --config speedrun-124m parallel.dp_replicate=4 ...

torchrun is a Python program (torch.distributed.run). Its own start imports torch before it starts
a single rank. A torchrun started from the shell does that import without the bytecode distlm
keeps (distlm/bytecode.py), where the installation keeps none. Started here, torch's entry point
runs in the distlm process, after the bytecode folder is set. So its import reads that bytecode,
and the ranks inherit PYTHONPYCACHEPREFIX. Nothing else differs: the same rendezvous (a local
c10d store), the same environment for each rank, the same restarts (none) and the same exit
handling.

One machine only; across machines, start torchrun or the SLURM script (docs/multi-node.md).
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

# torchrun sets these in every rank it starts; one of them set means this process is a rank.
RANK_ENV = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")


def under_launcher(environ=os.environ) -> bool:
    return any(k in environ for k in RANK_ENV)


def torchrun_args(nproc: int, distlm_args: Sequence[str]) -> list[str]:
    """torchrun's command line for ``python -m distlm DISTLM_ARGS`` on ``nproc`` local processes."""
    return ["--standalone", f"--nproc_per_node={nproc}", "-m", "distlm", *distlm_args]


def launch(nproc: int, distlm_args: Sequence[str]) -> tuple[int, Optional[str]]:
    """Run torchrun's entry point here. Returns the exit status (the first failed rank's, 128 +
    the signal's when one stopped the launch, else 0) and what the command should say of it
    (None: the ranks and torchrun have said it)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(torchrun_args(nproc, distlm_args))
    except SignalException as e:
        # SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C): torchrun has passed it on to the
        # ranks and waited for them, and the Trainer saves a checkpoint before it stops. The
        # status is the shell's for a process the signal ended; torchrun's own is a traceback.
        return 128 + int(e.sigval), f"stopped by signal {e.sigval.name} (ranks signalled and waited for)"
    except ChildFailedError as e:
        # Each rank has printed its own error (distlm's one line, or a traceback); torchrun has
        # printed which ranks exited. Pass the first failure's status on, as a shell would see it.
        status = e.get_first_failure()[1].exitcode
        return (status if 0 < status < 256 else 1), None
    finally:
        sys.stdout.flush()
    return 0, None
