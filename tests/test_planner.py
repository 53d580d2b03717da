"""`distlm plan`: the memory estimate against a measured peak, and the command's output.

The measurement is PyTorch's own memory profiler over one real training step (forward,
backward, AdamW) on CPU: parameters, gradients, optimizer state, activations and
temporaries, at their peak together. The planner is asked about the same model in fp32.
The time estimate is held to the throughputs recorded in tests/fixtures/planner_measurements.json,
and the two-level network (GPUs per node) to the mesh's axis order.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from distlm.cli import main
from distlm.config import load_config
from distlm.model.gpt import GPT
from distlm.model.loss import lm_loss
from distlm.parallel.parallelize import apply_activation_checkpointing
from distlm.planner import COLLECTIVES, Candidate, crossing_axes, estimate, explain, layouts, plan

SMALL = ["model.vocab_size=512", "model.n_layer=4", "model.d_model=128", "model.n_head=4", "model.d_ff=512",
         "model.block_size=128"]


def measured_peak_bytes(cfg, batch: int, ac: str, tmp_path) -> float:
    torch.manual_seed(0)
    model = GPT(cfg.model)
    if ac != "none":
        apply_activation_checkpointing(model, ac)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.block_size))
    y = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.block_size))

    def step():
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()  # AdamW allocates its state on the first step; measure a steady one
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step()
    out = tmp_path / "timeline.json"
    with pytest.warns(FutureWarning):  # deprecated for CUDA in favour of memory snapshots; the CPU path stays
        prof.export_memory_timeline(str(out), device="cpu")
    import json
    _, sizes = json.loads(out.read_text())
    return float(max(sum(s) for s in sizes))


@pytest.mark.parametrize("extra,batch,ac", [
    ([], 8, "none"),
    (["model.mlp=swiglu", "model.position=rope", "model.norm=rmsnorm", "model.tie_embeddings=false"], 8, "none"),
    ([], 16, "full"),
])
def test_estimate_within_25_percent_of_measured_peak(extra, batch, ac, tmp_path):
    cfg = load_config(None, SMALL + extra)
    measured = measured_peak_bytes(cfg, batch, ac, tmp_path)
    est = estimate(cfg.model, Candidate(1, 1, 1, 1, ac=ac), batch, batch, 80, compute_bytes=4)
    ratio = est.total_gb * 2**30 / measured
    assert 0.75 <= ratio <= 1.25, f"estimate {est.total_gb * 2**10:.1f} MiB vs measured {measured / 2**20:.1f} MiB"


def test_sharding_divides_model_state():
    cfg = load_config("gpt2-1.5b", ["model.vocab_size=50257", "model.n_head=20"])
    one = estimate(cfg.model, Candidate(4, 1, 1, 1), 64, 8, 80)
    fsdp = estimate(cfg.model, Candidate(1, 4, 1, 1), 64, 8, 80)
    tp = estimate(cfg.model, Candidate(2, 1, 2, 1), 64, 8, 80)
    assert fsdp.optim_gb == pytest.approx(one.optim_gb / 4, rel=1e-6)
    assert tp.activations_gb < one.activations_gb / 1.5  # TP + SP splits most saved tensors
    assert one.comm_gb > 0 and fsdp.comm_gb > one.comm_gb  # ZeRO-3 gathers parameters besides reducing
    names = {lay.name for lay in layouts(4, cfg.model)}
    assert {"ddp4", "fsdp4", "ddp2xtp2", "fsdp2xpp2", "tp2xpp2", "fsdp4+ac"} <= names


def test_plan_command_prints_a_ranked_table_and_a_recommendation(capsys):
    assert main(["plan", "--config", "gpt2-1.5b", "--gpus", "4", "--global-batch", "64", "--micro-batch", "8",
                 "model.n_head=20"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "layout" not in line]
    assert len(rows) == len(layouts(4, load_config("gpt2-1.5b", ["model.n_head=20"]).model))
    assert all(row.split("|")[2].strip() == "8" for row in rows)  # the micro-batch column: --micro-batch as given
    assert "recommended:" in out and "parallel." in out.split("recommended:")[1]


def test_plan_says_its_estimates_are_bf16_under_float8(capsys):
    """The planner does not model float8: with train.fp8 set it says so, once, and prints the
    same table as without it; without train.fp8 it says nothing of float8."""
    args = ["plan", "--config", "gpt2-1.5b", "--gpus", "4", "--micro-batch", "8"]
    assert main(args) == 0
    bf16 = capsys.readouterr().out
    assert main([*args, "train.fp8=tensorwise"]) == 0
    fp8 = capsys.readouterr().out
    assert "fp8" not in bf16
    note = [line for line in fp8.splitlines() if "fp8" in line]
    assert note == ["train.fp8=tensorwise: these are bf16 estimates; float8's effect on memory and time is not "
                    "modelled (measured figures: docs/results/float8.md)"]
    assert [line for line in fp8.splitlines() if line.startswith("| ")] == \
        [line for line in bf16.splitlines() if line.startswith("| ")]


def test_plan_says_when_nothing_fits(capsys):
    assert main(["plan", "--config", "gpt2-1.5b", "--gpus", "1", "--gpu-mem-gb", "4"]) == 1
    assert "no layout fits in 4 GiB" in capsys.readouterr().out


def test_plan_rejects_a_split_the_model_cannot_take(capsys):
    assert main(["plan", "--config", "gpt2-1.5b", "--gpus", "4", "parallel.tp=2"]) == 2
    assert "does not divide model.n_head=25" in capsys.readouterr().err


# ---- the time model against recorded throughputs ------------------------------------

MEASUREMENTS = Path(__file__).resolve().parent / "fixtures" / "planner_measurements.json"
RECORDS = json.loads(MEASUREMENTS.read_text())
# Entries that measured code since changed (TP before its gradient fix) stay in the file for the
# record but are not held to the time model, which describes the current code.
CURRENT = [r for r in RECORDS if not r.get("superseded")]
REQUIRED = {"name", "card", "gpus", "gpus_per_node", "config", "overrides", "global_batch", "micro_batch", "layout",
            "tok_s", "source"}


def test_measurements_file_is_well_formed():
    """An entry the lead adds by hand is checked before the model is judged by it."""
    assert isinstance(RECORDS, list) and RECORDS
    for r in RECORDS:
        assert REQUIRED <= set(r), f"{r.get('name')}: missing {sorted(REQUIRED - set(r))}"
        lay = r["layout"]
        assert set(lay) == {"dp_replicate", "dp_shard", "tp", "pp"}, r["name"]
        assert lay["dp_replicate"] * lay["dp_shard"] * lay["tp"] * lay["pp"] == r["gpus"], r["name"]
        assert r["gpus"] % r["gpus_per_node"] == 0, r["name"]
        if r.get("superseded"):
            assert r["superseded"] is True and len(r.get("superseded_note", "")) > 20, r["name"]
    names = {(r["card"], tuple(sorted((k, v) for k, v in r["layout"].items() if v > 1))) for r in CURRENT}
    assert ("NVIDIA H100 80GB HBM3", (("tp", 2),)) in names and ("NVIDIA H100 80GB HBM3", (("dp_shard", 2),)) in names


def estimate_record(r: dict):
    cfg = load_config(r["config"], r["overrides"])
    knobs = {k: r[k] for k in ("peak_tflops", "intra_gbs", "inter_gbs", "compute_bytes") if k in r}
    return estimate(cfg.model, Candidate(**r["layout"]), r["global_batch"], r["micro_batch"], r.get("gpu_mem_gb", 80),
                    gpus_per_node=r["gpus_per_node"], **knobs)


@pytest.mark.parametrize("record", CURRENT, ids=[r["name"] for r in CURRENT])
def test_time_estimate_within_20_percent_of_recorded_throughput(record):
    est = estimate_record(record)
    ratio = est.tokens_per_s / record["tok_s"]
    terms = ", ".join(f"{k} {v:.0f}" for k, v in est.time_ms.items() if v)
    assert 0.8 <= ratio <= 1.2, (f"{record['name']}: estimated {est.tokens_per_s:,.0f} tok/s vs measured "
                                 f"{record['tok_s']:,.0f} ({ratio:.2f}x); ms: {terms}")


def test_tp_pays_more_than_its_bytes():
    """The first model charged TP only bytes / bandwidth and put TP2 at 2.4x its measured
    throughput. At micro-batch 8 the host's time per block call is what TP adds most."""
    est = estimate_record(record(TP2_MB8))
    assert est.time_ms["tp_host"] > est.time_ms["tp_comm"] > 0


def record(name: str) -> dict:
    return next(r for r in RECORDS if r["name"] == name)


TP2_AFTER = "gpt2-1.5b TP2 (SP + loss parallel), 2 x H100, after the gradient fix"
TP2_MB8 = "gpt2-1.5b TP2 (SP + loss parallel), 2 x H100, bf16 gathers, micro 8"
TP2_MB16 = "gpt2-1.5b TP2 (SP + loss parallel), 2 x H100, bf16 gathers, micro 16"
TWO_NODES = "gpt2-124m-1024 DDP2, two 1-GPU nodes on one host (network path)"
ONE_LAUNCHER = "gpt2-124m-1024 DDP2, 2 x H100, one launcher (NVLink)"


@pytest.mark.parametrize("rec", [r for r in CURRENT if "measured_fwd_bwd_ms" in r], ids=lambda r: r["name"])
def test_terms_match_the_measured_phases(rec):
    """Where a record has bench's split of the step (forward/backward + optimizer, the JSON's
    phases), the optimizer term is held to the measured optimizer phase (20%), and the memory
    estimate to bench's peak (25%, as on CPU). The older FSDP2 H100 record's 22.3 ms came
    without that split and from another run; OPTIMIZER_S_PER_PARAM follows the newer one."""
    est = estimate_record(rec)
    assert est.time_ms["optimizer"] == pytest.approx(rec["measured_optimizer_ms"], rel=0.2), rec["name"]
    assert est.total_gb == pytest.approx(rec["measured_peak_gib"], rel=0.25), rec["name"]


def test_tp2_waits_for_its_host_at_micro_batch_8_and_not_at_16():
    """TP2's profile at micro-batch 8 (2026-11-27, recorded in 8beaf32): 784 ms of compute kernels, 922 ms in NCCL
    kernels (which include the wait for the other rank) and 1,289 ms with no kernel running, of
    a 3,040 ms profiled step. The estimate must say the same: compute near the kernels' time, the
    GPU waiting on the host for about as long as it computes. At micro-batch 16 (half the block
    calls for the same tokens, measured 1.84x faster) the host is no longer what it waits for."""
    rec = record(TP2_MB8)
    prof, est = rec["measured_profile_ms"], estimate_record(rec).time_ms
    kernels = sum(prof[k] for k in ("matmul", "fused element-wise", "eager element-wise", "attention"))
    assert est["compute"] == pytest.approx(kernels, rel=0.2)
    assert prof["idle"] / prof["profiled_step"] > 0.3 and est["tp_host"] > 0.8 * est["compute"]
    assert est["compute"] > 10 * est["optimizer"]
    mb16 = estimate_record(record(TP2_MB16))
    assert mb16.time_ms["tp_host"] == 0
    assert mb16.tokens_per_s / estimate_record(rec).tokens_per_s == pytest.approx(
        record(TP2_MB16)["tok_s"] / rec["tok_s"], rel=0.1)
    # the step the gradient fix replaced spent 3x longer in the optimizer than the model allows
    before = record("gpt2-1.5b TP2 (SP + loss parallel), 2 x H100, before the gradient fix")
    assert before["superseded"] and est["optimizer"] < before["measured_optimizer_ms"] / 2.5


def test_inter_node_model_against_two_nodes_on_one_host():
    """DDP2 of gpt2-124m with its gradient all-reduce on NCCL's network path (2.0 GB/s) against
    the same run over NVLink: the exposed communication and the slowdown the planner predicts."""
    two, one = record(TWO_NODES), record(ONE_LAUNCHER)
    est_two, est_one = estimate_record(two), estimate_record(one)
    assert est_two.inter_axes == ("dp_replicate",) and est_two.nodes == 2 and not est_one.inter_axes
    assert est_two.time_ms["dp_pp_exposed"] == pytest.approx(two["measured_exposed_comm_ms"], rel=0.2)
    slowdown, measured = est_one.tokens_per_s / est_two.tokens_per_s, one["tok_s"] / two["tok_s"]
    assert slowdown == pytest.approx(measured, rel=0.2), (slowdown, measured)


@pytest.mark.parametrize("lay,gpn,axes", [
    (Candidate(1, 1, 2, 1), 1, ("tp",)),
    (Candidate(1, 4, 1, 1), 2, ("dp_shard",)),
    (Candidate(2, 2, 1, 1), 2, ("dp_replicate",)),
    (Candidate(2, 2, 2, 1), 4, ("dp_replicate",)),
    (Candidate(1, 2, 2, 2), 8, ()),
    (Candidate(1, 1, 8, 2), 8, ("pp",)),
    (Candidate(1, 1, 3, 1), 4, ("tp",)),  # groups of 3 straddle nodes of 4
])
def test_crossing_axes_follow_the_mesh_order(lay, gpn, axes):
    assert crossing_axes(lay, gpn) == axes


def test_hsdp_keeps_fsdp_traffic_inside_a_node():
    m = load_config("gpt2-1.5b", ["model.vocab_size=50257", "model.n_head=20"]).model
    kw = dict(gpus_per_node=2, intra_gbs=150, inter_gbs=25)
    hsdp = estimate(m, Candidate(2, 2, 1, 1), 64, 8, 80, **kw)
    fsdp = estimate(m, Candidate(1, 4, 1, 1), 64, 8, 80, **kw)
    assert hsdp.inter_axes == ("dp_replicate",) and fsdp.inter_axes == ("dp_shard",)
    # only the all-reduce of each GPU's half of the gradients leaves the node
    assert hsdp.inter_gb == pytest.approx(hsdp.sent_gb["dp_replicate"]) and hsdp.inter_gb < fsdp.inter_gb / 3
    assert hsdp.step_s < fsdp.step_s
    assert "across nodes: gradient all-reduce (dp_replicate)" in explain(hsdp, [hsdp, fsdp], 80)
    one_node = [e for e in plan(m, 4, 80, 64, 8, gpus_per_node=4)]
    assert one_node and all(e.inter_gb == 0 and not e.inter_axes for e in one_node)
    # on one node FSDP4 is not slowed by the network, so it is the one ahead
    flat = {e.layout.name: e for e in one_node}
    assert flat["fsdp4"].step_s == pytest.approx(estimate(m, Candidate(1, 4, 1, 1), 64, 8, 80).step_s)
    with pytest.raises(ValueError, match="gpus_per_node=3"):
        plan(m, 4, 80, 64, 8, gpus_per_node=3)


def table_rows(out: str) -> dict:
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] != "layout":
            rows[cells[0]] = cells
    return rows


def test_plan_command_names_the_collectives_that_cross_nodes(capsys):
    args = ["plan", "--config", "gpt2-1.5b", "--gpus", "4", "--global-batch", "64", "--micro-batch", "8",
            "model.n_head=20", "--inter-node-gbs", "25"]
    assert main([*args, "--gpus-per-node", "2"]) == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("| layout"))
    col = [c.strip() for c in head.strip("|").split("|")].index("inter-node GB/step")
    rows = table_rows(out)
    hsdp, fsdp = rows["ddp2xfsdp2"], rows["fsdp4"]
    assert hsdp[col].endswith("(dp_replicate)") and fsdp[col].endswith("(dp_shard)")
    assert float(hsdp[col].split()[0]) < float(fsdp[col].split()[0])
    names = list(rows)
    assert names.index("ddp2xfsdp2") < names.index("fsdp4")  # ranked ahead across slow links
    best = out.split("recommended: ")[1].split()[0]  # the explanation names what its row's column does
    axes = rows[best][col].split("(")[1].rstrip(")").split(", ")
    assert "2 nodes of 2" in out and f"across nodes: {COLLECTIVES[axes[0]]}" in out
    assert main([*args, "--gpus-per-node", "4"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert rows and all(r[col] == "0" for r in rows.values()) and "ddp2xfsdp2" not in rows
    assert "across nodes" not in out


def auto_micro(local: int, pp: int) -> int:
    """What the auto micro-batch must be where everything fits: the largest divisor of the
    local batch up to 64, under PP one that leaves a multiple of pp microbatches."""
    sizes = [d for d in range(min(local, 64), 0, -1) if local % d == 0]
    return next((d for d in sizes if (local // d) % pp == 0), sizes[0])


@pytest.mark.parametrize("gpus,gpn", [(2, None), (4, 2)])
def test_plan_command_picks_an_auto_micro_batch_per_layout(gpus, gpn, capsys):
    """gpt2-124m-1024 leaves train.micro_batch_size auto; `distlm plan` used to crash on it.
    Each layout gets what `distlm train` would pick on that GPU, and says so."""
    cfg = load_config("gpt2-124m-1024", [])
    assert cfg.train.micro_batch_size is None and cfg.model.loss_chunk is None
    args = ["plan", "--config", "gpt2-124m-1024", "--gpus", str(gpus), *(["--gpus-per-node", str(gpn)] if gpn else [])]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "global batch 64, micro-batch auto" in out and "at most 75% of 80 GiB" in out
    head = next(line for line in out.splitlines() if line.startswith("| layout"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    micro, total = cols.index("micro-batch"), cols.index("total GiB")
    rows = table_rows(out)
    lays = {lay.name: lay for lay in layouts(gpus, cfg.model, gpn)}
    assert set(rows) == set(lays)
    for name, row in rows.items():  # 80 GiB holds every layout's largest candidate
        lay = lays[name]
        assert int(row[micro]) == auto_micro(64 // (lay.dp_replicate * lay.dp_shard), lay.pp), name
        assert float(row[total]) <= 0.75 * 80, name
    if gpus == 2:
        assert (rows["ddp2"][micro], rows["tp2"][micro], rows["pp2"][micro]) == ("32", "64", "32")
        # the memory is the estimate fast_defaults makes, its loss_chunk (8192 where the model computes
        # its own loss) included, not the whole logits of an unresolved auto
        from distlm.parallel.dims import ParallelDims
        from distlm.train.fast_defaults import Device, choose
        c = choose(cfg, Device("cuda", 80.0), ParallelDims(2, 1, 1, 1, world_size=2))
        assert c.cfg.model.loss_chunk == 8192 and float(rows["ddp2"][total]) == round(c.estimate.total_gb, 2)
    else:
        assert "2 nodes of 2" in out and rows["ddp2xfsdp2"][micro] == "16" and rows["tp4"][micro] == "64"
    best = out.split("recommended:")[1]
    assert f"at micro-batch {rows[best.split()[0]][micro]} " in best
    # less memory, smaller micro-batches: the rule reads --gpu-mem-gb
    assert main([*args, "--gpu-mem-gb", "16"]) == 0
    small = table_rows(capsys.readouterr().out)
    tp = f"tp{gpus}"
    assert int(small[tp][micro]) < int(rows[tp][micro]) and float(small[tp][total]) <= 0.75 * 16
    assert all(int(small[n][micro]) <= int(rows[n][micro]) for n in rows)


def test_plan_needs_a_micro_batch_or_a_rule():
    m = load_config("gpt2-124m-1024", []).model
    with pytest.raises(ValueError, match="micro_batch is required"):
        plan(m, 2, 80, 64, None)


def test_plan_command_rejects_bad_network_values(capsys):
    assert main(["plan", "--config", "gpt2-1.5b", "--gpus", "4", "--gpus-per-node", "3"]) == 2
    assert "--gpus-per-node 3" in capsys.readouterr().err
    assert main(["plan", "--config", "gpt2-1.5b", "--gpus", "4", "--inter-node-gbs", "0"]) == 2
    assert "--inter-node-gbs 0" in capsys.readouterr().err


def test_tp2_at_micro_batch_32_is_its_compute_plus_its_collectives():
    """TP2 at micro-batch 32 on the GPU's timeline (2026-11-27 06:44 UTC, `bench --profile`): 778 ms of
    compute kernels, 205 ms of NCCL with no compute beside it, nothing hidden. The estimate must
    split the step the same way: compute near the kernels' time, TP's collectives added in full
    (not overlapped), and no host term (at 32 the host keeps up)."""
    rec = record("gpt2-1.5b TP2 (SP + loss parallel), 2 x H100, micro 32, 2026-11-27 06:44")
    prof, est = rec["measured_timeline_ms"], estimate_record(rec).time_ms
    assert prof["comm_hidden"] < 0.01 * prof["comm_exposed"]
    assert est["compute"] == pytest.approx(prof["compute"], rel=0.2)
    assert est["tp_comm"] == pytest.approx(prof["comm_exposed"], rel=0.35)
    assert est["tp_host"] == 0
