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

import logging
import os
import sys
from typing import Optional, Sequence

from distlm.errors import ConfigError

# torchrun sets these in every rank it starts; one of them set means this process is a rank.
RANK_ENV = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")


def under_launcher(environ=os.environ) -> bool:
    return any(k in environ for k in RANK_ENV)


def torchrun_args(nproc: int, distlm_args: Sequence[str]) -> list[str]:
    """torchrun's command line for ``python -m distlm DISTLM_ARGS`` on ``nproc`` local processes."""
    return ["--standalone", f"--nproc_per_node={nproc}", "-m", "distlm", *distlm_args]


def check_before_launch(cfg, nproc: int) -> None:
    """What the ranks would refuse without a GPU on ``nproc`` processes, refused here first,
    before a process is started: the degrees must fill the world (the config's own checks
    have divided the batch by them); the data (or Hugging Face folder) must be there and fit
    the model, and on a CPU the ``nproc`` processes must fit its RAM. A GPU's free memory is
    the ranks' to measure, each on its own GPU (rank 0 alone says a refusal: it is agreed)."""
    from distlm.config import updated
    from distlm.device import resolve_device
    from distlm.layout import Layout
    from distlm.parallel.dims import ParallelDims
    from distlm.tasks import build_task
    from distlm.train.fast_defaults import Device, choose
    from distlm.train.memory_check import check_memory
    dims = ParallelDims(**Layout.of(cfg.parallel).degrees(), world_size=nproc)  # raises as a rank would
    if cfg.task.name == "classify" and not cfg.data.dir:
        # The vendored set, prepared on first use by rank 0: checked here once it is there.
        from distlm.tasks.classify.task import default_data_dir
        default = default_data_dir(cfg)
        if not (default / "manifest.json").is_file():
            return
        cfg = updated(cfg, data={"dir": str(default)})
    resolved = build_task(cfg).resolve(cfg, None, True).cfg
    device = resolve_device(cfg.train.device)
    if device.type == "cpu":  # a GPU's free memory is the rank's to measure, on its GPU
        check_memory(choose(resolved, Device("cpu"), dims).cfg, device, dims,
                     environ={"LOCAL_WORLD_SIZE": str(nproc)})


def launch(nproc: int, distlm_args: Sequence[str]) -> tuple[int, Optional[str]]:
    """Run torchrun's entry point here for ``nproc`` local ranks of ``distlm DISTLM_ARGS``."""
    # torchrun sets it in every rank when it is unset, and warns in five lines that it did:
    # set here, the ranks get the same and the console only the run's own words.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_torchrun(torchrun_args(nproc, distlm_args))


def run_torchrun(args: Sequence[str]) -> tuple[int, Optional[str]]:
    """torchrun's entry point on ``args``, in this process. Returns the exit status (the first
    failed rank's, 128 + the signal's when one stopped the launch, else 0) and what the command
    should say of it (None: the ranks have said it).

    torchrun's own log lines (a rank's exit, the workers it signalled) are held until the
    launch ends: where a rank has said why in distlm's one line (exit 2, 3) or a signal
    stopped the run, they would only repeat it, in 2 to 40 lines; after any other failure (a
    traceback, a rank killed) they say which rank failed, and are written then."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    held = HeldLogs("torch.distributed")
    status, said = 0, None
    try:
        torchrun(list(args))
    except SignalException as e:
        # SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C): torchrun has passed it on to the
        # ranks and waited for them, and the Trainer saves a checkpoint before it stops. The
        # status is the shell's for a process the signal ended; torchrun's own is a traceback.
        status, said = 128 + int(e.sigval), f"stopped by signal {e.sigval.name} (ranks signalled and waited for)"
    except ChildFailedError as e:
        # The ranks have printed their own error (distlm's one line, or a traceback). Pass the
        # first failure's status on, as a shell would see it.
        status = e.get_first_failure()[1].exitcode
        status = status if 0 < status < 256 else (128 - status if -64 < status < 0 else 1)
    finally:
        held.release(replay=status not in (0, 2, 3) and said is None)
        sys.stdout.flush()
    return status, said


class HeldLogs(logging.Filter):
    """Holds the records the handlers of logger ``name`` would write, until ``release``."""

    def __init__(self, name: str):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.handlers = list(logging.getLogger(name).handlers)
        for h in self.handlers:
            h.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False

    def release(self, replay: bool) -> None:
        for h in self.handlers:
            h.removeFilter(self)
        if replay:
            for record in self.records:
                for h in self.handlers:
                    if record.levelno >= h.level:
                        h.handle(record)
        self.records.clear()
