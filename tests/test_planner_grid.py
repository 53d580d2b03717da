"""The planner's whole output on a grid of layouts against tests/fixtures/planner_grid.json.

The fixture holds what ``estimate()`` returned, field by field, for dense and MoE models under
DDP, FSDP2, HSDP, TP, PP, cp and ep (and their compositions, with and without activation
checkpointing, across nodes or not, under AdamW, Muon and Lion), and the candidates
``layouts()`` lists with the notes of ``skipped_layouts()``. The estimates were written
before the axes' costs moved into their own files (distlm/layout/), so that the move could
not change a number: a term the planner now sums from the axes must come out as it did when
it was written inline. The lists were rewritten once, when the planner came to ask the axes'
refusals instead of its copy of some of them: a pipeline is no longer listed for a model
whose blocks need the token ids (speedrun-124m's value embeddings and U-net skips, which the
pipeline axis refuses), a mixture of experts gets HSDP on several nodes as a dense model does,
the notes name the ep degrees that do not divide the experts and no longer the tp and pp
degrees of a model every tp and pp refuses. A change that is meant to move an estimate
rewrites the fixture, and says why:

    python tests/test_planner_grid.py --write
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

from distlm.config import load_config
from distlm.optim import REGISTRY
from distlm.planner import Candidate, estimate, layouts, skipped_layouts

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "planner_grid.json"

MODELS = {
    "gpt2-1.5b": ("gpt2-1.5b", ["model.vocab_size=50257", "model.n_head=20"]),
    "gpt2-1.5b-25-heads": ("gpt2-1.5b", ["model.vocab_size=50257"]),
    "llama-124m-8k": ("llama-124m", ["model.vocab_size=50257", "model.block_size=8192"]),
    "speedrun-124m": ("speedrun-124m", ["model.vocab_size=50257"]),
    "speedrun-moe": ("speedrun-moe", ["model.vocab_size=50257"]),
    "small-moe": (None, ["model.vocab_size=512", "model.n_layer=4", "model.d_model=128", "model.n_head=4",
                         "model.d_ff=512", "model.block_size=128", "model.moe.experts=8", "model.moe.top_k=2",
                         "model.moe.shared=1", "model.moe.d_ff=64"]),
}
DENSE = [(1, 1, 1, 1), (4, 1, 1, 1), (1, 4, 1, 1), (2, 2, 1, 1), (2, 1, 2, 1), (1, 2, 2, 1), (1, 1, 2, 2),
         (1, 2, 1, 2), (2, 1, 1, 2), (2, 2, 2, 2), (1, 1, 4, 1), (1, 1, 1, 4), (4, 2, 1, 1), (1, 8, 1, 1)]
CONTEXT = [dict(cp=4), dict(dp_shard=2, cp=2), dict(tp=2, cp=2), dict(dp_shard=2, tp=2, cp=2)]
EXPERT = [dict(ep=4), dict(dp_shard=2, ep=2), dict(dp_replicate=2, ep=2), dict(dp_shard=4), dict(dp_replicate=4),
          dict(ep=8), dict(dp_shard=4, ep=2)]
PP_SCHEDULES = ("1f1b", "gpipe", "naive")
EVERYWHERE = ("default", "muon")  # the knobs every layout is estimated with; the others, without checkpointing
KNOBS = {
    "default": {},
    "two-per-node": dict(gpus_per_node=2),
    "four-per-node": dict(gpus_per_node=4, inter_gbs=12.5),
    "fp32": dict(compute_bytes=4),
    "no-sp-no-loss-parallel": dict(sequence_parallel=False, loss_parallel=False),
    "fused-loss": dict(fused_loss=True),
    "muon": dict(optimizer="muon"),
    "lion": dict(optimizer="lion", gpus_per_node=1),
}


def candidates(model: str) -> list[Candidate]:
    out = []
    if "moe" in model:
        shapes = [Candidate(**k) for k in EXPERT] + [Candidate(1, 1, 1, 1)]
    elif model == "gpt2-1.5b":
        shapes = [Candidate(*d) for d in DENSE]
    elif model == "llama-124m-8k":
        shapes = [Candidate(*d) for d in DENSE[:3] + DENSE[6:8]] + [Candidate(**k) for k in CONTEXT]
    elif model == "speedrun-124m":
        shapes = [Candidate(*d) for d in DENSE[:2] + DENSE[4:7]]
    else:
        return []  # listed for layouts() and skipped_layouts() only
    for lay in shapes:
        for ac in ("none", "full"):
            for schedule in (PP_SCHEDULES if lay.pp > 1 else ("1f1b",)):
                out.append(dataclasses.replace(lay, ac=ac, schedule=schedule))
    return out


def plain(value):
    """An estimate's field as JSON keeps it (tuples as lists)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    return value


def outputs() -> dict:
    out = {"estimates": {}, "layouts": {}, "skipped": {}}
    for model, (preset, overrides) in MODELS.items():
        m = load_config(preset, overrides).model
        for lay in candidates(model):
            if lay.pp > m.n_layer:
                continue
            for knob, kw in KNOBS.items():
                if knob not in EVERYWHERE and (lay.ac != "none" or lay.schedule != "1f1b"):
                    continue
                kw = dict(kw)
                if "optimizer" in kw:
                    kw["optimizer"] = REGISTRY[kw["optimizer"]]
                est = estimate(m, lay, 64, 4, 80, **kw)
                fields = {f.name: plain(getattr(est, f.name)) for f in dataclasses.fields(est) if f.name != "layout"}
                fields["tokens_per_s"] = est.tokens_per_s
                out["estimates"][f"{model} {lay.name} {lay.schedule} {knob}"] = fields
        for gpus in (1, 2, 4, 6, 8, 16):
            for gpn in (None, 2, 4):
                if gpn is not None and gpus % gpn:
                    continue
                out["layouts"][f"{model} {gpus} {gpn}"] = [f"{c.name} {c.schedule}" for c in layouts(gpus, m, gpn)]
            out["skipped"][f"{model} {gpus}"] = skipped_layouts(gpus, m)
    return out


def differences(want, got, where: str = "") -> list[str]:
    """Where two outputs differ: floats to 1e-12 relative (a sum taken in another order), the
    rest exactly."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{where}.{k}: missing" for k in want if k not in got]
        out += [f"{where}.{k}: new" for k in got if k not in want]
        return out + [d for k in want if k in got for d in differences(want[k], got[k], f"{where}.{k}")]
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{where}: {len(want)} entries, now {len(got)}: {want} -> {got}"]
        return [d for i, (a, b) in enumerate(zip(want, got)) for d in differences(a, b, f"{where}[{i}]")]
    if isinstance(want, float) or isinstance(got, float):
        if isinstance(want, (int, float)) and isinstance(got, (int, float)) \
                and math.isclose(want, got, rel_tol=1e-12, abs_tol=1e-12):
            return []
    elif want == got:
        return []
    return [f"{where}: {want!r} -> {got!r}"]


def unordered_axes(out: dict) -> dict:
    """``inter_axes`` as a set: the axes are listed in the registry's order, the fixture's in
    the order the planner's inline terms were written (ep before dp_shard)."""
    for est in out["estimates"].values():
        est["inter_axes"] = sorted(est["inter_axes"])
    return out


def test_the_grid_is_what_it_was():
    want = unordered_axes(json.loads(FIXTURE.read_text()))
    got = unordered_axes(json.loads(json.dumps(outputs())))
    found = differences(want, got)
    assert not found, f"{len(found)} differences:\n" + "\n".join(found[:40])


def test_the_comparison_sees_a_changed_term():
    """A term moved by one part in a million is caught, as is a layout gone from the list."""
    want = json.loads(FIXTURE.read_text())
    key = next(iter(want["estimates"]))
    moved = json.loads(json.dumps(want))
    moved["estimates"][key]["comm_gb"] = want["estimates"][key]["comm_gb"] * (1 + 1e-6) + 1e-6
    assert differences(want, moved) == [f".estimates.{key}.comm_gb: {want['estimates'][key]['comm_gb']!r} -> "
                                        f"{moved['estimates'][key]['comm_gb']!r}"]
    fewer = json.loads(json.dumps(want))
    fewer["layouts"]["gpt2-1.5b 4 None"].pop()
    assert differences(want, fewer) and len(want["estimates"]) > 500


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    FIXTURE.write_text(json.dumps(outputs(), sort_keys=True, separators=(",", ":")).replace('},"', '},\n"') + "\n")
    print(f"wrote {FIXTURE}")
