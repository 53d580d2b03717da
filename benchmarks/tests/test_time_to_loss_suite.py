"""The time-to-loss suite against nanoGPT's own recipe: both corpora, one-GPU runs at once on
several GPUs, nanoGPT run from its checkout and scored over the whole val split, a report per
GPU count; and the scaling suite's interleaved repetitions."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import run as bench_run  # noqa: E402  (benchmarks/run.py)
from suites import scaling as scaling_suite, time_to_loss  # noqa: E402

NANOGPT = ROOT.parent.parent / "shared" / "anchors" / "nanogpt"  # the shared checkout, when this box has it
if not NANOGPT.is_dir():
    NANOGPT = Path("/work/shared/anchors/nanogpt")


def plan(options: list[str], gpus: int = 4, cpu: bool = False):
    p = bench_run.parser_for("time-to-loss", time_to_loss)
    args = p.parse_args(["--gpus", str(gpus), *options])
    ctx = bench_run.Context(gpus=gpus, cpu=cpu, python="py", out=Path("/o"))
    return time_to_loss.plan(args, ctx)


def test_four_one_gpu_runs_go_at_once_and_the_four_gpu_runs_after():
    steps = plan(["--runs", "nanogpt speedrun nanogpt@ddp4 speedrun-b64s300@ddp4", "--corpora", "prose,docs",
                  "--nanogpt", "carry/nanogpt", "--docs-corpus", "carried/docs.jsonl", "--concurrent"])
    names = [s.name for s in steps]
    assert names == ["corpus", "corpus-docs", "concurrent0", "nanogpt-at-ddp4", "speedrun-b64s300-at-ddp4",
                     "docs-nanogpt-at-ddp4", "docs-speedrun-b64s300-at-ddp4", "report", "report-docs",
                     "nanogpt-bench"]
    script = steps[2].argv[2]
    for gpu, name in enumerate(["nanogpt", "speedrun", "docs-nanogpt", "docs-speedrun"]):
        # compiled graphs and the imports' bytecode in one folder, emptied for a cold start
        assert (f"CUDA_VISIBLE_DEVICES={gpu} TORCHINDUCTOR_CACHE_DIR='{{out}}/inductor-{name}' "
                f"DISTLM_CACHE_DIR='{{out}}/inductor-{name}' exec") in script
        assert f"{{out}}/{{stamp}}-{name}/launch_time.txt" in script
    assert script.count(" &\npids+=($!)") == 4 and "wait" in script
    # a cold start each, and each in its own folder that the report reads
    assert script.count("rm -rf") == 4
    report = steps[names.index("report-docs")]
    assert report.env["CONCURRENT"] == "nanogpt,speedrun,docs-nanogpt,docs-speedrun"
    assert [a.split("=")[0].rsplit("-", 1)[0] for a in report.argv[3:]] == [
        "{out}/{stamp}-docs-nanogpt", "{out}/{stamp}-docs-speedrun", "{out}/{stamp}-docs-nanogpt-at-ddp4",
        "{out}/{stamp}-docs-speedrun-b64s300-at-ddp4"]
    # the docs corpus: the carried file, prepared as a file (not the folder with its licence list)
    docs = steps[1].argv
    assert docs[4] == "carried/docs.jsonl" and 'prepare "$2/text/docs.jsonl"' in docs[2]
    assert "nanogpt_recipe.py export" in docs[2]
    nano4 = steps[names.index("nanogpt-at-ddp4")].argv
    assert nano4[nano4.index("--gpus") + 1] == "4" and "benchmarks/tools/nanogpt_recipe.py" in nano4


def test_batches_hold_at_most_gpus_runs_and_a_warm_run_follows_its_cold_one():
    steps = plan(["--runs", "speedrun speedrun+warm baseline nanogpt speedrun-adamw", "--concurrent",
                  "--nanogpt", "n"], gpus=2)
    assert [s.name for s in steps[:4]] == ["corpus", "concurrent0", "concurrent1", "speedrun-adamw"]
    first, second = steps[1].argv[2], steps[2].argv[2]
    assert "-speedrun/launch" in first and "-baseline/launch" in first and "speedrun-warm" not in first
    assert "-speedrun-warm/launch" in second and "-nanogpt/launch" in second
    # the warm run keeps the cache its cold run left; the others start cold
    warm_part = second.split("mkdir")[1]
    assert "rm -rf" not in warm_part
    assert "TORCHINDUCTOR_CACHE_DIR='{out}/inductor-speedrun' DISTLM_CACHE_DIR='{out}/inductor-speedrun' exec" in warm_part
    assert steps[3].argv[:3] == ["bash", "-c", 'rm -rf "{out}/inductor-speedrun-adamw" && exec "$@"']
    assert steps[3].env == {"TORCHINDUCTOR_CACHE_DIR": "{out}/inductor-speedrun-adamw",
                            "DISTLM_CACHE_DIR": "{out}/inductor-speedrun-adamw"}


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="need --nanogpt DIR"):
        plan(["--runs", "nanogpt"])
    with pytest.raises(ValueError, match="--corpora 'prose,code'"):
        plan(["--corpora", "prose,code"])
    with pytest.raises(ValueError, match="run 'nanogpt@fsdp4'"):
        plan(["--runs", "nanogpt@fsdp4", "--nanogpt", "x"])


def _run(folder: Path, rows: list[tuple], launch: float = 1000.0, log: str = "", ended: float | None = None) -> str:
    run = folder / f"20261127T120000Z-{folder.name}-run"
    run.mkdir(parents=True)
    lines = ["step,wall_time,tokens,loss,val_loss,tokens_per_s,mfu"]
    lines += [f"{s},{launch + t},{tok},3,{v},{tps},0.3" for s, t, tok, v, tps in rows]
    (run / "metrics.csv").write_text("\n".join(lines) + "\n")
    (folder / "launch_time.txt").write_text(f"{launch}\n")
    (folder / "log.txt").write_text(log)
    if ended is not None:
        (folder / "end_time.txt").write_text(f"{launch + ended}\n")
    return f"{run}=@{folder / 'launch_time.txt'}"


def test_report_times_each_gpu_count_to_its_own_nanogpt_loss(tmp_path):
    setup = ("set-up 3.0 s (device and process group 0.0); 6.5 s since the process started\n"
             "first step 12.0 s after set-up, compilation included; compile cache {}: 2 graphs loaded, 0 compiled (x)\n")
    specs = [
        _run(tmp_path / "nanogpt", [(10, 20, 100, "", 1000), (1500, 300, 9000, 3.0, "")], ended=330),
        _run(tmp_path / "baseline", [(10, 20, 100, "", 1000), (1500, 200, 9000, 2.0, "")]),  # not the target
        _run(tmp_path / "speedrun", [(10, 15, 50, "", 1000), (300, 90, 2000, 2.9, ""), (600, 100, 4000, 2.5, "")],
             log=setup.format("warm"), ended=110),
        _run(tmp_path / "nanogpt-at-ddp4", [(10, 15, 100, "", 4000), (1500, 150, 9000, 2.8, "")]),
        _run(tmp_path / "speedrun-at-ddp4", [(10, 10, 50, "", 4000), (300, 60, 2000, 2.7, "")],
             log=setup.format("cold")),
    ]
    out = tmp_path / "report"
    p = subprocess.run([sys.executable, "benchmarks/tools/speedrun_report.py", str(out), *specs], cwd=ROOT,
                       capture_output=True, text=True, env={"CONCURRENT": "nanogpt,speedrun", "PATH": "/usr/bin:/bin",
                                                            "MPLBACKEND": "Agg"})
    assert p.returncode == 0, p.stderr
    table = {r["run"]: r for r in json.loads((out / "speedrun-table.json").read_text())}
    assert table["speedrun"]["target"] == 3.0 and table["speedrun"]["baseline"] == "nanogpt"
    assert table["speedrun"]["s_to_target"] == 90 and table["speedrun"]["tokens_to_target"] == 2000
    assert table["speedrun-at-ddp4"]["target"] == 2.8 and table["speedrun-at-ddp4"]["s_to_target"] == 60
    assert table["speedrun-at-ddp4"]["layout"] == "ddp4" and table["speedrun"]["layout"] == "1 GPU"
    assert table["speedrun"]["compile_cache"] == "warm" and table["speedrun-at-ddp4"]["compile_cache"] == "cold"
    assert table["speedrun"]["setup_done_s"] == 6.5 and table["speedrun"]["first_step_s"] == 12.0
    assert table["speedrun"]["concurrent"] and not table["speedrun-at-ddp4"]["concurrent"]
    md = (out / "speedrun-table.md").read_text()
    assert md.startswith("Ran at the same time, one per GPU (CUDA_VISIBLE_DEVICES): nanogpt, speedrun;")
    assert "1 GPU: target 3.0000, the final validation loss of nanogpt" in md
    assert "ddp4: target 2.8000, the final validation loss of nanogpt-at-ddp4" in md
    # from process start to process end (benchmarks/run.py's end_time.txt): 330 s against 110 s
    assert table["speedrun"]["process_s"] == 110 and table["speedrun"]["after_last_val_s"] == 10
    assert "| 110.0 | 10.0 | 3.00x |" in md and table["speedrun-at-ddp4"]["process_s"] is None


@pytest.mark.skipif(not (NANOGPT / "train.py").is_file(), reason="nanoGPT's checkout is not on this machine")
def test_nanogpt_runs_from_its_checkout_and_is_scored_over_the_whole_val_split(tmp_path):
    """A prepared folder exported to nanoGPT's format, nanoGPT's train.py on the CPU (a tiny model,
    4 iterations), its final checkpoint scored over every val block, and the run written as
    distlm writes runs."""
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 50257, 40_000, dtype=np.uint16), rng.integers(0, 50257, 3_201, dtype=np.uint16)
    train.tofile(data / "train_000000.bin")
    val[:1600].tofile(data / "val_000000.bin")
    val[1600:].tofile(data / "val_000001.bin")
    (data / "manifest.json").write_text(json.dumps({"dtype": "uint16", "splits": {
        "train": {"shards": [{"file": "train_000000.bin", "tokens": 40_000}]},
        "val": {"shards": [{"file": "val_000000.bin", "tokens": 1600}, {"file": "val_000001.bin", "tokens": 1601}]}}}))
    tool = [sys.executable, "benchmarks/tools/nanogpt_recipe.py"]
    subprocess.run([*tool, "export", str(data), str(tmp_path / "nano")], cwd=ROOT, check=True, capture_output=True)
    assert np.array_equal(np.fromfile(tmp_path / "nano" / "val.bin", dtype=np.uint16), val)
    checkout = tmp_path / "nanogpt"
    shutil.copytree(NANOGPT, checkout)
    (tmp_path / "launch.txt").write_text("0\n")
    p = subprocess.run([*tool, "run", "--nanogpt", str(checkout), "--data", str(tmp_path / "nano"), "--run-dir",
                        str(tmp_path / "run"), "--cpu", "--launch-time", str(tmp_path / "launch.txt")], cwd=ROOT,
                       capture_output=True, text=True, timeout=900, env={"PATH": "/usr/bin:/bin",
                                                                        "PYTHONSAFEPATH": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["final_step"] == 4 and result["tokens"] == 4 * 4 * 32
    assert result["val_blocks"] == (3201 - 1) // 32  # every non-overlapping 32-token block, both shards
    # random tokens: about ln(50304) for a barely trained model, whole split or estimate
    assert abs(result["final_val_loss"] - np.log(50304)) < 0.5
    assert result["s_to_final"] > result["startup_s"] > 0  # timed from the launch file's time
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,wall_time,tokens,loss,val_loss,val_loss_estimate,tokens_per_s,mfu"
    scored = [r.split(",") for r in rows[1:] if r.split(",")[4]]
    assert len(scored) == 1 and scored[0][0] == "4" and float(scored[0][4]) == pytest.approx(result["final_val_loss"],
                                                                                              abs=1e-5)
    assert max(int(r.split(",")[0]) for r in rows[1:]) == 4  # the step after the final evaluation is not counted


def test_scaling_repeats_interleave_and_report_the_lowest(tmp_path, capsys):
    p = bench_run.parser_for("scaling", scaling_suite)
    args = p.parse_args(["--gpus", "4", "--sizes", "1,4", "--repeat", "3"])
    steps = scaling_suite.plan(args, bench_run.Context(gpus=4, cpu=False, python="py", out=Path("/o")))
    assert [s.name for s in steps] == ["ddp-weak-r1", "ddp-weak-r2", "ddp-weak-r3", "ddp-weak-repeats"]
    assert steps[-1].argv[-3:] == ["{out}/{stamp}-ddp-weak-r1", "{out}/{stamp}-ddp-weak-r2", "{out}/{stamp}-ddp-weak-r3"]
    folders = []
    for i, eff in enumerate((0.97, 0.76, 0.95)):
        f = tmp_path / f"r{i}"
        f.mkdir()
        rows = [{"gpus": 1, "tokens_per_s": 100.0, "per_gpu": 100.0, "weak_eff": 1.0, "step_ms": 10.0,
                 "exposed_ms": None},
                {"gpus": 4, "tokens_per_s": 400 * eff, "per_gpu": 100 * eff, "weak_eff": eff, "step_ms": 10 / eff,
                 "exposed_ms": 37.1 if eff < 0.9 else 6.0}]
        (f / "scaling-weak.json").write_text(json.dumps({"rows": rows}))
        folders.append(str(f))
    sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))
    import scaling_repeats
    assert scaling_repeats.main([str(tmp_path / "out"), *folders]) == 0
    summary = json.loads((tmp_path / "out" / "repeats.json").read_text())["summary"]
    assert summary == [{"gpus": 4, "repetitions": 3, "lowest": 0.76, "highest": 0.97, "goal": 0.95, "met": False}]
    assert "efficiency 76.0% to 97.0%; the goal of 95% in every repetition is not met" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--repeat 0"):
        scaling_suite.plan(p.parse_args(["--gpus", "4", "--repeat", "0"]),
                           bench_run.Context(gpus=4, cpu=False, python="py", out=Path("/o")))


def test_startup_tool_reads_the_set_up_and_first_step_lines():
    sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))
    import startup
    log = ("set-up 4.5 s (device and process group 0.0, config and data check 0.1, memory check 0.0, run folder 0.0, "
           "compiler import 4.2, model plan 0.0, weights 0.2, data-parallel wrap 0.0, optimizer and data loader 0.0, "
           "resume and run files 0.0); 10.6 s since the process started\n"
           "first step 9.0 s after set-up, compilation included; compile cache warm: 4 graphs loaded, 0 compiled (/c)\n")
    row = startup.parse(log)
    assert row["before_setup_s"] == 6.1 and row["setup_s"] == 4.5 and row["to_first_step_s"] == 19.6
    assert row["phases"]["compiler import"] == 4.2 and len(row["phases"]) == 10
    assert (row["cache"], row["loaded"], row["compiled"]) == ("warm", 4, 0)
    assert startup.parse("no set-up here") is None
    md = startup.table([{"gpus": 1, "run": "warm", **row}])
    assert "| this | 1 | warm | 6.1 | 0.0 | 0.1 |" in md and md.rstrip().endswith(
        "| 4.5 | 9.0 | - | 19.6 | - | - | 4 / 0 | - | - |")
    md = startup.table([{"gpus": 4, "run": "warm", **row, "from_launch_s": 25.4, "launcher_s": 5.8,
                         "end_of_run_s": 0.4, "wall_s": 31.0}])
    assert md.rstrip().endswith("| 19.6 | 25.4 | 5.8 | 4 / 0 | 0.4 | 31.0 |") and "of it before the process (launcher)" in md
    assert "last step to process end" in md


def test_startup_tool_gives_each_run_one_cache_folder_and_drops_the_callers():
    """A cold run must start with no compiled graphs and no kept bytecode: both go in the run's
    cache folder, and cache settings of the shell that started the tool do not leak in."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))
    import startup
    outer = {"HOME": "/h", "PYTHONPYCACHEPREFIX": "/warm", "TORCHINDUCTOR_CACHE_DIR": "/warm2",
             "DISTLM_BYTECODE_CACHE": "/warm3", "PYTHONPATH": "/elsewhere", "DISTLM_CACHE_DIR": "/warm4"}
    env = startup.launch_env(outer, Path("/code/old"), Path("/out/cache-old-1"))
    assert env == {"HOME": "/h", "PYTHONPATH": "/code/old", "TORCHINDUCTOR_CACHE_DIR": "/out/cache-old-1",
                   "DISTLM_CACHE_DIR": "/out/cache-old-1"}


def test_startup_tool_times_a_run_from_its_launch_by_its_step_one_row(tmp_path):
    """Above one GPU torchrun starts before distlm's processes do, and the set-up line cannot
    see it: the tool reads the end of step 1 from the row the Trainer writes for it, on the
    same wall clock as the launch. A real one-step run, launched as the tool launches it."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))
    import startup
    launched = time.time()
    proc = subprocess.run([sys.executable, "-m", "distlm", "train", "--config", "tiny", "data.source=synthetic",
                           "train.max_steps=1", "train.device=cpu", "log.progress=false", "log.tensorboard=false",
                           "log.samples=0", "train.eval_every=0", "train.checkpoint_every=0", f"log.root={tmp_path}",
                           "log.name=r"], env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    wall = time.time() - launched
    assert proc.returncode == 0, proc.stderr
    row = startup.parse(proc.stdout)
    from_launch = startup.launch_to_step1(tmp_path / "r", launched)
    # step 1 ends after the set-up did (seconds since the process started), and before the exit
    assert from_launch is not None and row["since_start_s"] - 0.1 <= from_launch <= wall + 0.1, (row, from_launch, wall)
    assert startup.launch_to_step1(tmp_path / "missing", launched) is None


def test_nanogpt_bench_can_be_left_out():
    runs = ["--runs", "nanogpt speedrun", "--nanogpt", "carry/nanogpt"]
    assert plan(runs)[-1].name == "nanogpt-bench"
    assert "nanogpt-bench" not in [s.name for s in plan([*runs, "--no-nanogpt-bench"])]


def test_nanogpt_bench_imports_its_model_where_pythonsafepath_is_set(tmp_path):
    """nanoGPT's bench.py imports model.py from its own folder. Where PYTHONSAFEPATH is set (as
    on the GPU image), Python leaves the script's folder off sys.path, so the step unsets it.
    The step's own command runs here against a stand-in checkout."""
    (tmp_path / "model.py").write_text("NAME = 'nanoGPT model'\n")
    (tmp_path / "bench.py").write_text("import sys, model\nprint(model.NAME, sys.argv[1:])\n")
    step = plan(["--runs", "nanogpt", "--nanogpt", str(tmp_path)])[-1]
    assert step.name == "nanogpt-bench"
    argv = [sys.executable if a == "py" else a for a in step.argv]
    out = subprocess.run(argv, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "PYTHONSAFEPATH": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("nanoGPT model ['--real_data=False'")


def test_the_launcher_option_starts_distlms_multi_gpu_runs_through_distlm():
    runs = ["--runs", "nanogpt@ddp4 speedrun speedrun@ddp4", "--nanogpt", "n", "--no-nanogpt-bench"]
    by_name = {s.name: s.argv for s in plan([*runs, "--launcher", "distlm"])}
    four = by_name["speedrun-at-ddp4"]
    assert four[-1] == "--nproc-per-node=4" and "torch.distributed.run" not in four
    assert four[four.index("py"):four.index("py") + 4] == ["py", "-m", "distlm", "train"]
    assert "parallel.dp_replicate=4" in four
    # one GPU needs no launcher, and nanoGPT keeps its own
    assert "--nproc-per-node=4" not in by_name["speedrun"] and "--nproc-per-node=1" not in by_name["speedrun"]
    assert "benchmarks/tools/nanogpt_recipe.py" in by_name["nanogpt-at-ddp4"]
    # the default is torchrun
    default = {s.name: s.argv for s in plan(runs)}["speedrun-at-ddp4"]
    assert "torch.distributed.run" in default and "--nproc_per_node=4" in default


def test_startup_tool_refuses_a_variant_without_a_distlm_package(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))
    import startup
    assert startup.main(["--cpu", "--out", str(tmp_path), "--variant", f"x={tmp_path}:DISTLM_X=1"]) == 2
    assert "--variant x=" in capsys.readouterr().out
    assert startup.main(["--cpu", "--out", str(tmp_path), "--variant", "=.:train.seed=1"]) == 2
