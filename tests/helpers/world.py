"""One gloo world that runs every multi-process scenario of the test run for its size.

    torchrun --standalone --nproc_per_node N tests/helpers/world.py PLAN.json

PLAN.json: {"scenarios": [{"kind": ..., "name": ..., "result": PATH, ...}, ...]}. Each scenario
is run by the module of its kind (``KINDS``), one after the other, in one process group: the
ranks pay torch's and distlm's imports and the rendezvous once for all of them. Rank 0 writes
each scenario's result to its "result" path (JSON, or torch.save where the path ends in .pt)
and what it printed beside it (PATH.stdout), both as the scenario ends.

A scenario that fails writes its traceback to PATH.error-attemptA-rankR and the process
exits, so that torchrun (--max_restarts) starts the world again. A new attempt skips every
scenario with a result, and every scenario that failed in two attempts: the first failure may
be a peer's death (a scenario that kills a rank on purpose, a lost node), and a second says the
scenario itself fails, which then costs the tests of that scenario only. Scenarios of kind "cli" run `distlm ARGV`
and come last: the command line takes the process group down when it returns.
"""
from __future__ import annotations

import datetime
import io
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers package

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=60)  # every group of the world: a hang ends in a minute


def _cli(job: dict) -> dict:
    from distlm.cli import main
    return {"rc": main([str(a) for a in job["argv"]])}


def _kinds() -> dict:
    from helpers import context_jobs, float8_jobs, muon_jobs, nan_jobs, trainer_jobs
    return {"train": trainer_jobs.run, "context": context_jobs.run, "muon": muon_jobs.run,
            "float8": float8_jobs.run, "nan": nan_jobs.run, "cli": _cli}


class _Tee(io.TextIOBase):
    """What a scenario prints, kept for its result and still shown in the launch's log."""

    def __init__(self, stream):
        self.stream, self.kept = stream, io.StringIO()

    def write(self, s):
        self.kept.write(s)
        return self.stream.write(s)

    def flush(self):
        self.stream.flush()


def _finished(s: dict) -> bool:
    path = Path(s["result"])
    failed = {e.name.rsplit("-rank", 1)[0] for e in path.parent.glob(path.name + ".error-attempt*")}
    return path.exists() or len(failed) >= 2


def _save(path: Path, result, printed: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".pt":
        torch.save(result, tmp)
    else:
        tmp.write_text(json.dumps(result, indent=1))
    path.with_name(path.name + ".stdout").write_text(printed)
    os.replace(tmp, path)  # the result appears whole: a later attempt skips only what ended


def main(plan_path: str) -> None:
    from distlm.parallel.dims import _attempt_store
    torch.set_num_threads(1)
    scenarios = json.loads(Path(plan_path).read_text())["scenarios"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = _attempt_store(world, TIMEOUT)  # a key prefix per torchrun attempt, as distlm's own start
    dist.init_process_group("gloo", timeout=TIMEOUT, store=store, rank=rank if store else -1,
                            world_size=world if store else -1)
    done = [[_finished(s) for s in scenarios] if rank == 0 else None]
    dist.broadcast_object_list(done, src=0)  # one answer for all ranks: files may appear meanwhile
    kinds, todo = _kinds(), [s for s, finished in zip(scenarios, done[0]) if not finished]
    for s in [s for s in todo if s["kind"] != "cli"] + [s for s in todo if s["kind"] == "cli"]:
        t0, tee = time.perf_counter(), _Tee(sys.stdout)
        if rank == 0:
            print(f"world {world}: scenario {s['name']} ({s['kind']})", flush=True)
        try:
            sys.stdout = tee
            result = kinds[s["kind"]](s)
        except BaseException:
            sys.stdout = tee.stream
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            Path(s["result"] + f".error-attempt{attempt}-rank{rank}").write_text(traceback.format_exc())
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        finally:
            sys.stdout = tee.stream
        if rank == 0:
            _save(Path(s["result"]), result, tee.kept.getvalue())
            print(f"world {world}: scenario {s['name']} took {time.perf_counter() - t0:.1f} s", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
