"""One torchrun launch per world size for the whole test run (tests/helpers/world.py runs it).

A test module that needs several processes says what to run in them with a module-level

    def world_scenarios(root: Path, data: Path) -> dict[int, list[dict]]

(``root``: the module's folder for the run, ``data``: the tiny prepared data set), scenarios by
world size, each {"kind": ..., "name": ..., ...} (tests/helpers/world.py lists the kinds). The
run's ``worlds`` fixture (tests/conftest.py) gathers the scenarios of every collected module and, on the first
request for a world size, launches that world once with all of them; the module's tests read
``worlds.results(__name__, N)[NAME]``. Starting a world of 4 ranks costs about 15 CPU-seconds
of imports and rendezvous on the 2-core box, before any scenario runs: one launch per size
instead of one per module and size is most of what it saves.

Under pytest-xdist (`make test` runs two workers) the workers share one folder for the worlds: the
first worker to ask launches them, holding a lock, and the others wait on the lock and read the
same results, so each world still starts once per run.

Worlds start largest first, so a scenario may resume from a checkpoint that a scenario of a
larger world wrote. A scenario that fails fails the tests that read it, with its traceback;
the others keep their results.
"""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORLD = Path(__file__).resolve().parent / "world.py"
PT_KINDS = {"muon", "float8"}  # results holding tensors: torch.save, not JSON
# A restart for the scenario that kills a rank on purpose, and two (a retry, then the skip) for
# each of two failing scenarios.
MAX_RESTARTS = 5
LAUNCH_TIMEOUT_S = 3000  # bounds a hang only: each group's own timeout is a minute


def child_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "GROUP_RANK"):
        env.pop(k, None)
    return env


class Results(Mapping):
    """A world's results for one module, by scenario name; a missing one fails the test that reads it."""

    def __init__(self, worlds: "Worlds", size: int, scenarios: dict[str, dict]):
        self.worlds, self.size, self.scenarios = worlds, size, scenarios

    def __iter__(self):
        return iter(self.scenarios)

    def __len__(self):
        return len(self.scenarios)

    def path(self, name: str) -> Path:
        return Path(self.scenarios[name]["result"])

    def __getitem__(self, name: str):
        path = self.path(name)
        if path.exists():
            if path.suffix == ".pt":
                import torch
                return torch.load(path, weights_only=True)
            return json.loads(path.read_text())
        errors = sorted(path.parent.glob(path.name + ".error-attempt*"))
        if errors:
            pytest.fail(f"scenario {name} failed in the {self.size}-rank world ({errors[0].name}):\n"
                        + errors[0].read_text()[-4000:], pytrace=False)
        log = self.worlds.log(self.size)
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
        pytest.fail(f"scenario {name} did not run: the {self.size}-rank world ended before it "
                    f"(exit {self.worlds.exit_codes.get(self.size)}, log {log}):\n{tail}", pytrace=False)

    def stdout(self, name: str) -> str:
        """What rank 0 printed while the scenario ran."""
        self[name]  # fails as reading the result does
        return self.path(name).with_name(self.path(name).name + ".stdout").read_text()


class Worlds:
    def __init__(self, base: Path, modules: list, data: Path):
        self.base, self.modules, self.data = base, modules, data
        self._plans: dict[int, list[dict]] | None = None
        self._by_module: dict[tuple[str, int], dict[str, dict]] = {}
        self.exit_codes: dict[int, int] = {}

    def root(self, module: str) -> Path:
        folder = self.base / module
        folder.mkdir(exist_ok=True)
        return folder

    def log(self, size: int) -> Path:
        return self.base / f"world{size}.log"

    def plans(self) -> dict[int, list[dict]]:
        if self._plans is None:
            self._plans, data = {}, self.data
            for module in self.modules:
                root = self.root(module.__name__)
                (root / "results").mkdir(exist_ok=True)
                for size, scenarios in module.world_scenarios(root, data).items():
                    named = self._by_module.setdefault((module.__name__, size), {})
                    for s in scenarios:
                        ext = ".pt" if s["kind"] in PT_KINDS else ".json"
                        s = {**s, "result": str(root / "results" / f"{s['name']}{ext}")}
                        assert s["name"] not in named, f"{module.__name__}: two scenarios named {s['name']}"
                        named[s["name"]] = s
                        self._plans.setdefault(size, []).append(s)
            # A scenario marked "first" runs before the others of its world (a rank it kills on
            # purpose then restarts nothing that ran before it).
            for scenarios in self._plans.values():
                scenarios.sort(key=lambda s: not s.get("first"))
        return self._plans

    def results(self, module: str, size: int) -> Results:
        plans = self.plans()
        todo = [n for n in sorted(plans, reverse=True) if n >= size and n not in self.exit_codes]
        if todo:
            with open(self.base / "launch.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # another worker's launch of the same worlds: wait for it
                for n in todo:
                    done = self.base / f"world{n}.exit"
                    if not done.exists():
                        self._launch(n, plans[n])
                        done.write_text(str(self.exit_codes[n]))
                    self.exit_codes[n] = int(done.read_text())
        return Results(self, size, self._by_module.get((module, size), {}))

    def _launch(self, size: int, scenarios: list[dict]) -> None:
        plan = self.base / f"world{size}.json"
        plan.write_text(json.dumps({"scenarios": scenarios}, indent=1))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={size}",
               f"--max_restarts={MAX_RESTARTS}", str(WORLD), str(plan)]
        with open(self.log(size), "w") as log:
            proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                                  timeout=LAUNCH_TIMEOUT_S)
        self.exit_codes[size] = proc.returncode


def modules_with_scenarios(items) -> list:
    """The modules of the collected tests that declare world scenarios, in collection order."""
    seen = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "world_scenarios"):
            seen.setdefault(module.__name__, module)
    return list(seen.values())
