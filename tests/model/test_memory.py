"""The planner's memory per GPU against peaks measured on a GPU (tests/fixtures/memory_measurements.json:
each with its card, date, commit and command). The estimate picks the auto micro-batch and runs the
start-up memory check, so it must hold for every registered optimizer, the speedrun recipe and a
sharded large model: within 10% of each peak."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from distlm.config import load_config
from distlm.parallel.dims import ParallelDims
from distlm.train.fast_defaults import Device, memory_estimate

RECORDS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "memory_measurements.json").read_text())


def test_every_registered_optimizer_is_measured():
    from distlm.optim import REGISTRY
    measured = {o.split("=")[1] for r in RECORDS for o in r["overrides"] if o.startswith("optim.name=")}
    assert measured == set(REGISTRY)


@pytest.mark.parametrize("record", RECORDS, ids=[r["name"] for r in RECORDS])
def test_the_estimate_is_within_ten_percent_of_the_measured_peak(record):
    cfg = load_config(record["config"], [*record["overrides"], "model.vocab_size=50257"])
    r, s, t, p = record["layout"]
    dims = ParallelDims(r, s, t, p, world_size=r * s * t * p)
    est = memory_estimate(cfg, Device("cuda", 139.0), dims, cfg.train.micro_batch_size)
    error = (est.total_gb - record["peak_gib"]) / record["peak_gib"]
    assert abs(error) <= 0.10, f"{record['name']}: planned {est.total_gb:.2f} GiB, measured {record['peak_gib']} ({error:+.1%})"
