"""distlm bench: the timed run reports what it says, and the scaling report's arithmetic."""

import pytest

from distlm.bench import scaling
from distlm.bench.throughput import markdown_row, run_bench
from distlm.config import load_config


def test_bench_runs_the_real_step_and_reports(tmp_path):
    cfg = load_config("tiny", ["data.source=synthetic", "model.vocab_size=256", "model.n_layer=2",
                               "model.d_model=32", "model.n_head=2", "model.d_ff=64", "model.block_size=16",
                               "train.global_batch_size=8", "train.micro_batch_size=4", "log.progress=false",
                               "log.tensorboard=false", f"log.root={tmp_path}", "log.name=b"])
    r = run_bench(cfg, warmup=1, steps=3)
    assert r["accum_steps"] == 2 and r["timed_steps"] == 3
    assert r["tokens_per_s"] == pytest.approx(8 * 16 / r["step_s"])
    assert set(r["phases_s"]) == {"data", "forward_backward", "optimizer"}
    assert sum(r["phases_s"].values()) <= r["step_s"] * 1.05
    assert r["mfu"] is None and r["exposed_comm_s"] is None  # no peak for a CPU; one process
    assert "6N + 12*L*d*T" in r["mfu_formula"]
    assert markdown_row(r).count("|") == 14


def fake(n, tps, exposed=None, step=0.1):
    return {"world_size": n, "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / n, "step_s": step,
            "peak_mem_gb": 1.0, "exposed_comm_s": exposed, "compute_comm_ratio": None if not exposed else 2.0,
            "global_batch_size": 8 * n, "micro_batch_size": 4, "device": "H100"}


def test_amdahl_fit_recovers_the_serial_fraction():
    s = 0.1
    ns = [1, 2, 4, 8]
    assert scaling.amdahl_serial_fraction(ns, [1 / (s + (1 - s) / n) for n in ns]) == pytest.approx(s, abs=1e-3)
    assert scaling.amdahl_serial_fraction(ns, ns) == 0.0


def test_negative_scaling_gets_advice_and_plots(tmp_path):
    rows = scaling.analyse([fake(1, 1000.0), fake(2, 800.0, exposed=0.06, step=0.2)], "weak")
    assert rows[1]["speedup"] == pytest.approx(0.8) and rows[1]["weak_eff"] == pytest.approx(0.4)
    notes = scaling.advice(rows, "dp_replicate")
    assert len(notes) == 1 and "micro-batch" in notes[0] and "accumulation" in notes[0]
    assert not scaling.advice(scaling.analyse([fake(1, 1000.0), fake(2, 1980.0, 0.001)], "weak"), "dp_replicate")
    text = scaling.markdown(rows, "weak", 0.5, notes)
    assert "| 2 | 16/4 | 800 | 400 |" in text and "Advisor:" in text
    scaling.plot(rows, tmp_path / "s.png", "weak")
    import matplotlib.image
    assert matplotlib.image.imread(tmp_path / "s.png").ndim == 3


def test_profile_counts_kernels_not_the_ranges_around_them():
    """On a GPU the profiler also reports record_function ranges (c10d's "nccl:all_gather...",
    "Optimizer.step#Muon.step", DDP's forward) with the device time of the kernels inside;
    summed with those kernels they counted communication twice (TP2: 3.1 s of a 2.4 s step)."""
    from types import SimpleNamespace
    import torch
    from distlm.bench.profile import kernel_times, summarize
    cuda = torch.autograd.DeviceType.CUDA

    def evt(key, ms, annotation=False, device=cuda):
        return SimpleNamespace(key=key, self_device_time_total=ms * 1e3, count=2, device_type=device,
                               is_user_annotation=annotation)
    events = [evt("ncclDevKernel_AllGather_RING_LL", 9.0), evt("nccl:all_gather_into_tensor_coalesced", 9.0, True),
              evt("Optimizer.step#Muon.step", 40.0, True), evt("nvjet_sm90_tst_192x192", 5.0),
              evt("aten::mm", 5.0, device=torch.autograd.DeviceType.CPU)]
    rows = kernel_times(SimpleNamespace(key_averages=lambda: events), cuda=True)
    assert [r[0] for r in rows] == ["ncclDevKernel_AllGather_RING_LL", "nvjet_sm90_tst_192x192"]
    s = summarize(rows, steps=1, step_s=0.02)
    assert s["categories_s"] == {"communication": 0.009, "matmul": 0.005} and abs(s["idle_s"] - 0.006) < 1e-12


def test_profile_timeline_splits_hidden_from_exposed_communication():
    """A 10 ms step: compute 0-4 ms and 6-8 ms, communication 3-7 ms (1 ms beside the first
    compute, 1 ms beside the second, 2 ms alone), nothing 8-10 ms. Summed kernel times (10 ms)
    would call the step fully busy."""
    from types import SimpleNamespace
    import torch
    from distlm.bench.profile import kernel_intervals, markdown, summarize, timeline
    ms = 1e-3
    t = timeline([(0, 4 * ms, False), (6 * ms, 8 * ms, False), (3 * ms, 7 * ms, True), (3.5 * ms, 4.5 * ms, True)],
                 steps=1, step_s=10 * ms)
    assert t["compute_s"] == pytest.approx(6 * ms) and t["comm_hidden_s"] == pytest.approx(2 * ms)
    assert t["comm_exposed_s"] == pytest.approx(2 * ms) and t["idle_s"] == pytest.approx(2 * ms)
    # Two steps halve every figure; the events come from the profiler in microseconds.
    cuda = torch.autograd.DeviceType.CUDA

    def evt(name, a, b, annotation=False):
        return SimpleNamespace(name=name, device_type=cuda, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=a, end=b))
    events = [evt("nvjet_sm90_gemm", 0, 4000), evt("ncclDevKernel_ReduceScatter", 2000, 6000),
              evt("nccl:reduce_scatter", 0, 9000, annotation=True)]
    t2 = timeline(kernel_intervals(SimpleNamespace(events=lambda: events)), steps=2, step_s=5 * ms)
    assert t2 == pytest.approx({"compute_s": 2 * ms, "comm_hidden_s": 1 * ms, "comm_exposed_s": 1 * ms,
                                "idle_s": 2 * ms})
    s = summarize([("nvjet_sm90_gemm", 0.004, 1)], steps=2, step_s=5 * ms)
    s["timeline"] = t2
    assert "| communication alone (exposed) | 1.00 | 20.0 |" in markdown(s, "x")


def test_profile_counts_triton_kernels_named_after_collectives_as_compute():
    """Inductor names a fused kernel after the ops it absorbs; the element-wise work around a
    TP reduce-scatter is compute on the GPU's timeline, not a collective."""
    from distlm.bench.profile import categorize
    assert categorize("triton_poi_fused__unsafe_view_cat_reduce_scatter_tensor_split_4") == \
        "fused element-wise/norm (Triton)"
    assert categorize("triton_per_fused__to_copy_add_all_gather_into_tensor_native_layer_norm_backward_10") == \
        "fused element-wise/norm (Triton)"
    assert categorize("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL") == "communication"
    assert categorize("c10d::allreduce_") == "communication"
    assert categorize("Memcpy PtoP (Device -> Device)") == "communication"  # async TP's peer copies
    assert categorize("Memcpy DtoD (Device -> Device)") == "copies/casts/fills"
