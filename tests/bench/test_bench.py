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


# --- the benchmark suites (benchmarks/run.py) --------------------------------------------------
# Every suite's commands are planned here as `--dry-run` prints them, and each distlm command is
# loaded as distlm would load it: an option renamed, a preset changed or a layout that does not
# match its process count fails here, not on a GPU machine.

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import run as bench_run  # noqa: E402  (benchmarks/run.py)

SUITE_OPTIONS = {  # every suite, and the options that add steps
    "throughput": [["--gpus", "1"], ["--gpus", "4", "--layout", "fsdp4", "--config", "gpt2-1.5b", "--variants",
                                     "m16=train.micro_batch_size=16 model.n_head=20", "--memory-cap-gib", "79",
                                     "--profile", "--ceilings", "--before", "carry/old", "--loss-curves", "200"]],
    "scaling": [["--gpus", "4", "--axis", "ddp", "--independent", "--horovod"], ["--gpus", "4", "--axis", "fsdp"],
                ["--gpus", "2", "--axis", "tp", "--config", "gpt2-1.5b", "--set", "model.n_head=20",
                 "train.micro_batch_size=8"],
                ["--gpus", "2", "--axis", "pp", "--config", "gpt2-355m", "--set", "train.global_batch_size=32",
                 "--pp-sweep", "1,2,4,8"], ["--gpus", "4", "--classify"]],
    "time-to-loss": [["--runs", "baseline speedrun speedrun-docmask baseline@ddp4 speedrun-b64s300@ddp4 "
                      "speedrun-b64s300@ddp4+warm speedrun-b64s450@fsdp4", "--nanogpt", "carry/nanogpt"],
                     ["--runs", "speedrun@ddp4 speedrun@fsdp2", "--launcher", "distlm"]],
    "layouts": [["--gpus", "2", "--layouts", "ddp2,fsdp2,pp2,tp2", "--micro", "8,16,32", "--plan", "--profile"],
                ["--gpus", "4"]],
    "prepare": [["--workers", "1,2", "--size-mb", "64"]],
    "multi-node": [["--gpus", "4"], ["--gpus", "2", "--emulate", "disable", "--compile"]],
    "float8": [["--gpus", "4", "--profile"], ["--gpus", "4", "--items", "loss", "--models", "llama-7b",
                                              "--loss-recipes", "tensorwise,rowwise", "--loss-steps", "200",
                                              "--memory-cap-gib", "79"]],
    "memory": [[], ["--optimizers", "muon", "--micro", "4,8", "--config", "gpt2-355m"]],
    "context": [["--gpus", "4", "--loss-curves", "300"], ["--gpus", "2", "--contexts", "8192", "--large", "none"]],
}


def dry_run(capsys, suite: str, options: list[str]) -> list[list[str]]:
    """The command lines a suite prints under --dry-run, split into words."""
    assert bench_run.main([suite, "--dry-run", *options]) == 0
    lines = [line.rstrip(" &") for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    return [shlex.split(line) for line in lines if line]


def distlm_commands(words: list[str]):
    """(verb, processes, config, overrides) of a distlm command line, else None."""
    if "distlm" in words and words[words.index("distlm") - 1] == "-m":
        at = words.index("distlm") + 1
    else:
        return None
    procs = 1
    for w in words[:at]:
        if w.startswith("--nproc_per_node="):
            procs = int(w.split("=")[1])
    if "--nproc_per_node" in words[:at]:
        procs = int(words[words.index("--nproc_per_node") + 1]) * int(words[words.index("--nnodes") + 1])
    for w in words[at:]:  # distlm train --nproc-per-node=N starts the ranks itself
        if w.startswith("--nproc-per-node="):
            procs = int(w.split("=")[1])
    rest = words[at:]
    config = rest[rest.index("--config") + 1] if "--config" in rest else None
    overrides = [w for w in rest[1:] if re.match(r"^[a-z_]+\.[a-z_0-9.]+=", w)]
    return rest[0], procs, config, overrides


@pytest.mark.parametrize("suite", sorted(SUITE_OPTIONS))
def test_every_suite_plans_commands_that_distlm_accepts(suite, capsys):
    from distlm.config import load_config
    checked = 0
    for options in SUITE_OPTIONS[suite]:
        lines = dry_run(capsys, suite, options)
        assert lines, f"{suite} {options}: no command"
        for words in lines:
            cmd = distlm_commands(words)
            if cmd is None or cmd[0] not in ("train", "bench") or cmd[2] is None:
                continue
            verb, procs, config, overrides = cmd
            if verb == "train":  # a training run reads data: a prepared folder, a mixture or synthetic tokens
                assert any(o.startswith(("data.dir=", "data.mix=", "data.source=synthetic")) for o in overrides), \
                    (suite, words)
            cfg = load_config(config, [o for o in overrides if not o.startswith(("train.resume=", "data.dir="))])
            p = cfg.parallel
            if "--scaling" not in words and "parallel.engine=horovod" not in overrides:
                assert p.dp_replicate * p.dp_shard * p.tp * p.pp * p.cp == procs, (suite, words)
            checked += 1
    if suite != "prepare":
        assert checked, f"{suite}: no distlm command was checked"


def test_time_to_loss_splits_the_global_batch_over_the_gpus(capsys):
    lines = dry_run(capsys, "time-to-loss", ["--runs", "speedrun-b64s300@ddp4 speedrun@fsdp2"])
    cmds = [c for c in map(distlm_commands, lines) if c and c[0] == "train"]
    ddp, fsdp = (load_config_of(c) for c in cmds)
    assert (ddp.parallel.dp_replicate, ddp.train.global_batch_size, ddp.train.micro_batch_size) == (4, 64, 16)
    # the preset sets no micro-batch: auto takes the local batch whole (tests/train/test_speedrun_preset.py)
    assert (fsdp.parallel.dp_shard, fsdp.train.micro_batch_size, fsdp.train.compile_scope) == (2, None, "block")


def load_config_of(cmd):
    from distlm.config import load_config
    return load_config(cmd[2], [o for o in cmd[3] if not o.startswith("data.dir=")])


def test_bad_suite_options_are_one_line_errors(capsys):
    assert bench_run.main(["nonesuch"]) == 2
    assert "unknown suite 'nonesuch'" in capsys.readouterr().err
    assert bench_run.main(["layouts", "--dry-run", "--gpus", "2", "--layouts", "tp2_fsdp2"]) == 2
    assert "layout tp2_fsdp2 needs 4 GPUs, --gpus is 2" in capsys.readouterr().err
    assert bench_run.main(["time-to-loss", "--dry-run", "--runs", "speedrun-nosuch"]) == 2
    assert "run 'speedrun-nosuch'" in capsys.readouterr().err


def test_prepare_suite_says_in_one_line_when_its_module_is_absent(tmp_path, capsys, monkeypatch):
    from suites import prepare
    monkeypatch.setattr(prepare, "available", lambda: False)
    assert bench_run.main(["prepare", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "benchmarks/tools/prepare_speed.py is not in this checkout" in out[0]
    assert not (tmp_path / "results.jsonl").exists()


def test_sources_fingerprint_is_the_shell_pipelines():
    shell = subprocess.run("find distlm -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12", shell=True,
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert bench_run.sources_fingerprint() == shell


def test_a_cpu_run_records_the_result_with_its_provenance(tmp_path):
    """One real step (a tiny one-process bench on the CPU) through the runner, as on a GPU machine."""
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "benchmarks/run.py", "throughput", "--cpu", "--out", str(out),
                           "--variants", "tiny=train.micro_batch_size=4 train.global_batch_size=8", "--warmup", "1",
                           "--steps", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert record["suite"] == "throughput" and record["step"] == "tiny" and record["rc"] == 0
    assert record["card"].startswith("CPU") or "x" in record["card"]
    import torch
    assert record["torch"] == torch.__version__ and record["sources"] == bench_run.sources_fingerprint()
    assert record["date"].startswith("20") and "distlm bench --config gpt2-124m-1024" in record["command"]
    assert "train.device=cpu" in record["command"] and record["result"]["tokens_per_s"] > 0
    folder = Path(record["folder"])
    assert (folder / "command.txt").read_text().strip() == record["command"]
    assert (folder / "log.txt").is_file()


def test_the_memory_suite_runs_every_registered_optimizer_and_compares_planned_with_measured(tmp_path, capsys):
    """One tiny bench per optimizer on the CPU through the runner: each result holds the
    planner's estimate for its own optimizer (no peak is measured on a CPU), and the last step
    tabulates them. Then the comparison itself, on results as a GPU writes them."""
    from distlm.optim import REGISTRY
    planned = dry_run(capsys, "memory", [])
    assert [w for words in planned for w in words if w.startswith("optim.name=")] == \
        [f"optim.name={n}" for _micro in (2, 8) for n in REGISTRY]
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "benchmarks/run.py", "memory", "--cpu", "--out", str(out), "--micro", "4",
                           "--warmup", "1", "--steps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [f"{n}-m4" for n in REGISTRY] + ["compare"]
    state = {r["result"]["optimizer"]: r["result"]["planned_mem_terms_gb"]["optimizer_state"] for r in records[:-1]}
    assert state["muon"] < state["adamw"]  # one momentum for the blocks' matrices against two moments
    assert all(r["rc"] == 0 for r in records) and all(r["result"]["peak_mem_gb"] is None for r in records[:-1])
    assert "nothing measured" in (Path(records[-1]["folder"]) / "log.txt").read_text()

    sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))
    import memory_report
    for name, measured, rc in (("close", 1.05, 0), ("far", 1.25, 1)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "result.json").write_text(json.dumps({"optimizer": "muon", "micro_batch_size": 8,
                                                        "planned_mem_gb": 1.0, "peak_mem_gb": measured}))
        assert memory_report.main([str(folder)]) == rc, name
    assert "-20.0%" in memory_report.table(memory_report.rows([folder]))  # (planned - measured) / measured


def test_the_context_suite_runs_a_split_row_and_its_loss_curves_on_the_cpu(tmp_path):
    """The context suite's plumbing: one row split over 2 processes (gloo) through `distlm bench`,
    then the loss curves: the bundled books prepared, one process against cp=2 on the same
    batches, step by step equal in fp32."""
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "benchmarks/run.py", "context", "--cpu", "--out", str(out), "--sizes", "2",
                           "--contexts", "8192", "--large", "none", "--warmup", "1", "--steps", "2",
                           "--loss-curves", "3"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = {r["step"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert list(records) == ["cp2-8k", "corpus", "curve-one", "curve-cp2", "curve-compare"]
    assert all(r["rc"] == 0 for r in records.values()), records
    record = records["cp2-8k"]
    assert record["suite"] == "context"
    assert "parallel.cp=2" in record["command"] and "--nproc_per_node=2" in record["command"]
    assert record["result"]["tokens_per_s"] > 0 and record["result"]["layout"]["cp"] == 2
    curves = records["curve-compare"]["result"]
    assert curves["steps"] == 3 and curves["max_abs_diff"] < 1e-4, curves
    assert curves["val_a"] == pytest.approx(curves["val_b"], abs=1e-4)


def test_time_to_loss_report_reads_the_suites_run_folders(tmp_path):
    """Runs are timed from the launch time the runner wrote; the folder's time stamp is not the name."""
    for name, losses in (("baseline", (3.0, 2.5)), ("speedrun", (2.6, 2.2))):
        run = tmp_path / f"20261127T120000Z-{name}-run"
        run.mkdir()
        (run / "metrics.csv").write_text("step,wall_time,tokens,loss,val_loss,tokens_per_s,mfu\n"
                                         f"10,1010,100,4,,1000,0.3\n20,1020,200,3,{losses[0]},1000,0.3\n"
                                         f"30,1030,300,2,{losses[1]},1000,0.3\n")
        (tmp_path / f"{name}.txt").write_text("1000.0\n")
    specs = [f"{tmp_path}/20261127T120000Z-{n}-run=@{tmp_path}/{n}.txt" for n in ("baseline", "speedrun")]
    subprocess.run([sys.executable, "benchmarks/tools/speedrun_report.py", str(tmp_path / "r"), *specs], cwd=ROOT,
                   check=True, capture_output=True)
    table = {r["run"]: r for r in json.loads((tmp_path / "r" / "speedrun-table.json").read_text())}
    assert table["baseline"]["target"] == 2.5 and table["baseline"]["s_to_target"] == 30.0
    assert table["speedrun"]["s_to_target"] == 30.0 and table["speedrun"]["tokens_to_target"] == 300


def test_clock_sampling_without_nvidia_smi_says_so_and_runs_the_suite(tmp_path, capsys, monkeypatch):
    """--sample-clocks starts nvidia-smi beside the steps; where there is none, one line says so."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi, and no git either: provenance copes
    from suites import throughput
    monkeypatch.setattr(throughput, "plan", lambda args, ctx: [bench_run.Step("echo", [sys.executable, "-c", "print(1)"])])
    assert bench_run.main(["throughput", "--sample-clocks", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "--sample-clocks: nvidia-smi not found" in out
    (record,) = [json.loads(line) for line in (tmp_path / "o" / "results.jsonl").read_text().splitlines()]
    assert record["rc"] == 0 and record["commit"] is None and record["sources"] == bench_run.sources_fingerprint()


def test_float8_suite_plans_bf16_beside_each_recipe_and_reports_them(tmp_path, capsys):
    """Every float8 step has its bf16 twin with the same settings but train.fp8, FSDP2 over the
    GPUs; the CPU form runs the speed item end to end (float8 steps as bf16: the CPU refuses
    float8) and prints the table."""
    lines = dry_run(capsys, "float8", ["--gpus", "4", "--items", "speed,loss", "--models", "gpt2-1.5b",
                                       "--loss-steps", "50"])
    cmds = {}
    for words in lines:
        cmd = distlm_commands(words)
        if cmd:
            fp8 = [o for o in cmd[3] if o.startswith("train.fp8=")]
            # all else the same, but where each run writes
            same = sorted(o for o in cmd[3] if o not in fp8 and not o.startswith(("log.root=", "log.name=")))
            cmds.setdefault((cmd[0], cmd[2]), {})[fp8[0]] = same
            assert cmd[1] == 4 and "parallel.dp_shard=4" in cmd[3]
    speed, loss = cmds[("bench", "gpt2-1.5b")], cmds[("train", "gpt2-1.5b")]
    assert set(speed) == {"train.fp8=off", "train.fp8=tensorwise", "train.fp8=rowwise"}
    assert set(loss) == {"train.fp8=off", "train.fp8=tensorwise"} and "train.max_steps=50" in loss["train.fp8=off"]
    for runs in (speed, loss):
        assert all(v == runs["train.fp8=off"] for v in runs.values())
    assert bench_run.main(["float8", "--dry-run", "--items", "nonesuch"]) == 2
    assert "--items 'nonesuch'" in capsys.readouterr().err
    out = tmp_path / "o"
    proc = subprocess.run([sys.executable, "benchmarks/run.py", "float8", "--cpu", "--out", str(out), "--items",
                           "layer,speed", "--models", "gpt2-1.5b", "--recipes", "tensorwise", "--warmup", "1",
                           "--steps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == ["layer-gpt2-1.5b", "speed-gpt2-1.5b-off", "speed-gpt2-1.5b-tensorwise",
                                            "report"]
    layer = records[0]["result"]["rows"][0]
    assert all(layer[k] > 0 for k in ("bf16", "tensorwise", "rowwise", "fp8_mm_only"))
    table = {(r["model"], r["recipe"]): r for r in records[-1]["result"]}
    assert table[("gpt2-1.5b", "off")]["ok"] and table[("gpt2-1.5b", "tensorwise")]["tokens_per_s"] > 0
    assert "| gpt2-1.5b | tensorwise |" in proc.stdout


def test_throughput_before_and_after_are_profiled_alike_and_tabled(capsys, tmp_path):
    """--before DIR with --profile: the older code's run is profiled too (the profiler slows a
    step; a pair must differ only in the code), and a last step tables each pair."""
    lines = dry_run(capsys, "throughput", ["--config", "speedrun-124m", "--variants", "a=;b=train.micro_batch_size=16",
                                           "--profile", "--before", "carry/old"])
    runs = [w for w in lines if distlm_commands(w)]
    assert len(runs) == 4 and all("--profile" in w for w in runs)
    assert [w[0] == "PYTHONPATH=carry/old" for w in runs] == [True, False, True, False]
    compare = lines[-1]
    assert compare[1] == "benchmarks/tools/compare_bench.py"
    folders = [Path(w).name for w in compare[2:-2]]
    assert [f.split("-", 1)[1] for f in folders] == ["before-a", "a", "before-b", "b"]

    # the table: each figure before and after, and the difference
    def result(tok_s, eager_ms):
        return {"tokens_per_s": tok_s, "step_s": 32768 / tok_s, "mfu": tok_s / 1e6, "phases_s": {"optimizer": 0.009},
                "profile": {"categories_s": {"element-wise/norm (eager)": eager_ms / 1e3}, "idle_s": 0.003}}
    for name, r in (("before-a", result(400_000, 6.6)), ("a", result(440_000, 2.0))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "result.json").write_text(json.dumps(r))
    out = subprocess.run([sys.executable, "benchmarks/tools/compare_bench.py", str(tmp_path / "before-a"),
                          str(tmp_path / "a"), "--json", str(tmp_path / "cmp.json")], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert "| tokens/s | 400,000.0 | 440,000.0 | 40,000.0 |" in out.stdout
    assert "| profile: element-wise/norm (eager) ms | 6.60 | 2.00 | -4.60 |" in out.stdout
    table = json.loads((tmp_path / "cmp.json").read_text())["a"]
    assert {"figure": "MFU %", "before": 40.0, "after": 44.0} in table
    missing = subprocess.run([sys.executable, "benchmarks/tools/compare_bench.py", str(tmp_path / "a"),
                              str(tmp_path / "nowhere")], cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "nowhere/result.json" in missing.stderr


def test_optimizer_parts_folded_newton_schulz_is_the_same_polynomial():
    """benchmarks/tools/optimizer_parts.py times Newton-Schulz with each step's sums folded into
    baddbmm; in fp32 it must give distlm's result (same polynomial, fewer roundings), for wide,
    square and tall stacks."""
    import importlib.util

    import torch

    from distlm.optim.muon import newton_schulz
    spec = importlib.util.spec_from_file_location("optimizer_parts", ROOT / "benchmarks/tools/optimizer_parts.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    g = torch.Generator().manual_seed(0)
    for shape in ((3, 8, 24), (2, 16, 16), (4, 24, 8)):
        m = torch.randn(shape, generator=g)
        torch.testing.assert_close(tool.ns_folded(m, dtype=torch.float32), newton_schulz(m, dtype=torch.float32),
                                   rtol=0, atol=2e-5)


def test_a_failed_step_prints_why_a_rank_failed_not_only_the_launchers_summary(tmp_path, capsys):
    """Under torchrun a failed run's last lines are the launcher's summary ("rank 1 exited 1"); the
    runner also prints the first lines that say why, from earlier in the log."""
    log = ("step 1/5 | loss 9.1\n"
           "[rank1]: Traceback (most recent call last):\n"
           "[rank1]:   File \"x.py\", line 1, in <module>\n"
           "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
           "error (rank 3): the checkpoint folder is read-only\n"
           + "  rank : 1 (local_rank: 1)\n  exitcode : 1\n" * 3)
    script = f"import sys; sys.stdout.write({log!r}); sys.exit(1)"
    ctx = bench_run.Context(gpus=1, cpu=True, python=sys.executable, out=tmp_path)
    rc = bench_run.run_step(bench_run.Step("fails", [sys.executable, "-c", script]), ctx, "T", {},
                            tmp_path / "results.jsonl")
    out = capsys.readouterr().out
    assert rc == 1
    assert ("cause: [rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
            "    cause: error (rank 3): the checkpoint folder is read-only\n      exitcode : 1") in out
    # a step that succeeds prints its last lines only
    rc = bench_run.run_step(bench_run.Step("works", [sys.executable, "-c", "print('error: not an error here')"]),
                            ctx, "T", {}, tmp_path / "results.jsonl")
    assert rc == 0 and "cause:" not in capsys.readouterr().out
