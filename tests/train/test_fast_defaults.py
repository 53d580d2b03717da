"""Fast by default: train.compile, train.compile_scope, model.loss_chunk and
train.micro_batch_size default to auto, made values for the device and the layout once, before
the model is built (distlm/train/fast_defaults.py).

The rule is checked as a pure function of a config, a device description (CUDA with N GiB
free, or CPU) and a layout; then a real CPU `distlm train` through pipes: the printed line,
config.yaml holding the values that ran, and a resume that resolves alike. The GPU test
runs the README's bench command and reads the line back."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from distlm.config import ConfigError, config_from_dict, load_config, to_yaml
from distlm.parallel.dims import ParallelDims
from distlm.model.memory import GIB
from distlm.train.fast_defaults import (CPU_MICRO_CAP, GPU_MICRO_CAP, HEADROOM, LOSS_CHUNK, Device, choose,
                                        fast_defaults, memory_estimate)
from distlm.train.resume_check import differences

ROOT = Path(__file__).resolve().parents[2]
GPU80 = Device("cuda", 79.0)
CPU = Device("cpu")
ONE = ParallelDims()
LAYOUTS = {"1 GPU": {}, "ddp2": {"dp_replicate": 2}, "fsdp2": {"dp_shard": 2}, "tp2": {"tp": 2}, "pp2": {"pp": 2},
           "ddp2xtp2": {"dp_replicate": 2, "tp": 2}}
AUTOS = ("train.compile", "train.compile_scope", "model.loss_chunk", "train.micro_batch_size")


def cfg_for(layout: dict, *overrides: str, preset: str | None = None):
    """A config whose parallel section is ``layout``, and the ParallelDims a launch of it has."""
    cfg = load_config(preset, ["model.vocab_size=256", *[f"parallel.{k}={v}" for k, v in layout.items()],
                               *overrides])
    p = cfg.parallel
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, p.pp, world_size=p.dp_replicate * p.dp_shard * p.tp * p.pp)
    return cfg, dims


def gpt2_1024(*overrides: str, layout: dict | None = None):
    return cfg_for(layout or {}, "model.vocab_size=50257", *overrides, preset="gpt2-124m-1024")


# ---- the spelling ------------------------------------------------------------------------
def test_auto_is_the_default_and_is_spelled_auto():
    cfg = load_config(None, [])
    assert (cfg.train.compile, cfg.train.compile_scope, cfg.model.loss_chunk, cfg.train.micro_batch_size) == \
        (None, None, None, None)
    text = to_yaml(cfg)
    for key in AUTOS:
        section, name = key.split(".")
        assert yaml.safe_load(text)[section][name] == "auto"
    assert config_from_dict(yaml.safe_load(text)) == cfg  # a printed config reads back
    spelled = load_config(None, [f"{k}=auto" for k in AUTOS[1:]] + ["train.compile=AUTO"])
    assert spelled == cfg
    assert load_config(None, ["train.compile=null"]).train.compile is None


def test_explicit_values_and_old_configs_still_load():
    cfg = load_config(None, ["train.compile=false", "train.compile_scope=block", "model.loss_chunk=0",
                             "train.micro_batch_size=4"])
    assert (cfg.train.compile, cfg.train.compile_scope, cfg.model.loss_chunk, cfg.train.micro_batch_size) == \
        (False, "block", 0, 4)
    old = config_from_dict({"train": {"compile": False, "compile_scope": "block", "micro_batch_size": 8},
                            "model": {"loss_chunk": 0}})  # what config.yaml held before auto
    assert (old.train.compile, old.model.loss_chunk, old.train.micro_batch_size) == (False, 0, 8)


@pytest.mark.parametrize("override,needle", [
    ("train.compile=maybe", "train.compile: expected true/false or auto, got 'maybe'"),
    ("train.micro_batch_size=some", "train.micro_batch_size: expected an integer or auto, got 'some'"),
    ("train.compile_scope=blok", "is not one of block, model, auto (did you mean 'block'?)"),
    ("model.loss_chunk=-1", "model.loss_chunk must be >= 0, got -1"),
    ("train.micro_batch_size=0", "train.micro_batch_size must be positive, got 0"),
])
def test_bad_values_name_auto_among_the_choices(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)


def test_validation_with_an_auto_micro_batch():
    with pytest.raises(ConfigError, match="must be a multiple of the data-parallel degree 2"):
        load_config(None, ["train.global_batch_size=33", "parallel.dp_replicate=2"])
    # a pipeline's microbatch count is checked once the micro-batch is known; the local batch must be whole
    assert load_config(None, ["parallel.pp=2", "train.global_batch_size=12"]).train.micro_batch_size is None
    with pytest.raises(ConfigError, match="train.compile_scope=model"):  # compile=auto is on with a GPU
        load_config(None, ["train.compile_scope=model", "parallel.dp_shard=2"])


# ---- the rule ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compile_on_for_cuda_off_for_cpu_and_scope_by_layout(name):
    cfg, dims = cfg_for(LAYOUTS[name], "train.global_batch_size=16")
    gpu, cpu = choose(cfg, GPU80, dims).cfg, choose(cfg, CPU, dims).cfg
    assert gpu.train.compile is True and cpu.train.compile is False
    whole = name in ("1 GPU", "ddp2")  # FSDP2, TP and PP split the forward into pieces
    assert gpu.train.compile_scope == cpu.train.compile_scope == ("model" if whole else "block")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loss_chunk_where_the_model_computes_its_own_loss(name):
    cfg, dims = cfg_for(LAYOUTS[name], "train.global_batch_size=16")
    own_loss = "tp" not in name and "pp" not in name
    assert choose(cfg, GPU80, dims).cfg.model.loss_chunk == (LOSS_CHUNK if own_loss else 0)
    assert choose(cfg, CPU, dims).cfg.model.loss_chunk == 0  # CPU results stay what they were
    if own_loss:  # a classifier's head is not the LM head the chunked loss computes
        classifier, dims = cfg_for(LAYOUTS[name], "train.global_batch_size=16", "task=classify")
        assert choose(classifier, GPU80, dims).cfg.model.loss_chunk == 0


def test_the_gpt2_124m_1024_bench_gets_what_was_measured_fastest():
    cfg, dims = gpt2_1024()
    c = choose(cfg, GPU80, dims)
    assert c.chosen == {"train.compile": True, "train.compile_scope": "model", "model.loss_chunk": 8192,
                        "train.micro_batch_size": 64}
    assert c.fits and c.estimate.total_gb <= HEADROOM * 79
    assert re.fullmatch(r"fast defaults \(cuda, 1 GPU\): train\.compile=true, train\.compile_scope=model, "
                        r"model\.loss_chunk=8192, train\.micro_batch_size=64 \(est\. [\d.]+ GiB of 79 GiB free\)",
                        c.line), c.line


@pytest.mark.parametrize("free_gib", [79.0, 24.0, 12.0, 6.0])
@pytest.mark.parametrize("global_batch,layout", [(64, {}), (96, {}), (48, {"dp_replicate": 2}),
                                                 (40, {"dp_shard": 2}), (28, {}), (64, {"tp": 2})])
def test_micro_batch_is_the_largest_divisor_that_fits(free_gib, global_batch, layout):
    cfg, dims = gpt2_1024(f"train.global_batch_size={global_batch}", layout=layout)
    dev = Device("cuda", free_gib)
    c = choose(cfg, dev, dims)
    local = global_batch // dims.dp_size
    micro = c.cfg.train.micro_batch_size
    assert local % micro == 0 and micro <= GPU_MICRO_CAP
    assert c.estimate == memory_estimate(c.cfg, dev, dims, micro)
    if c.fits:
        assert c.estimate.total_gb <= HEADROOM * free_gib
    else:
        assert micro == 1 and "distlm plan" in c.line
    for larger in (d for d in range(micro + 1, min(local, GPU_MICRO_CAP) + 1) if local % d == 0):
        assert memory_estimate(c.cfg, dev, dims, larger).total_gb > HEADROOM * free_gib


def test_micro_batch_shrinks_with_the_memory():
    cfg, dims = gpt2_1024()
    micros = [choose(cfg, Device("cuda", gib), dims).cfg.train.micro_batch_size for gib in (79, 24, 12, 6, 3)]
    assert micros == sorted(micros, reverse=True) and micros[0] == 64 and micros[-1] < micros[1] < 64, micros
    tiny = choose(cfg, Device("cuda", 0.5), dims)
    assert tiny.cfg.train.micro_batch_size == 1 and not tiny.fits and "distlm plan" in tiny.line


@pytest.mark.parametrize("global_batch,dp,want", [(32, 1, 8), (12, 1, 6), (16, 2, 8), (4, 1, 4), (36, 2, 6),
                                                  (14, 1, 7)])
def test_cpu_micro_batch_is_at_most_eight(global_batch, dp, want):
    cfg, dims = cfg_for({"dp_replicate": dp}, f"train.global_batch_size={global_batch}")
    c = choose(cfg, CPU, dims)
    assert c.cfg.train.micro_batch_size == want and want <= CPU_MICRO_CAP
    assert c.estimate is None and "GiB" not in c.line


def test_a_pipeline_gets_a_whole_number_of_microbatches_per_stage():
    cfg, dims = gpt2_1024("train.global_batch_size=64", layout={"pp": 4})
    c = choose(cfg, GPU80, dims)
    assert (64 // c.cfg.train.micro_batch_size) % 4 == 0
    assert c.cfg.train.compile_scope == "block" and c.cfg.model.loss_chunk == 0
    fixed, dims = gpt2_1024("train.global_batch_size=64", "parallel.pp_microbatches=8", layout={"pp": 2})
    assert choose(fixed, GPU80, dims).cfg.train.micro_batch_size == 8  # what the schedule runs


def test_explicit_values_win():
    cfg, dims = gpt2_1024("train.compile=false", "train.compile_scope=block", "model.loss_chunk=0",
                          "train.micro_batch_size=16")
    c = choose(cfg, GPU80, dims)
    assert c.cfg == cfg and c.chosen == {} and c.line is None
    some, dims = gpt2_1024("train.micro_batch_size=16", "train.compile=false")
    c = choose(some, GPU80, dims)
    assert c.cfg.train.micro_batch_size == 16 and c.cfg.train.compile is False
    assert c.line == "fast defaults (cuda, 1 GPU): train.compile_scope=model, model.loss_chunk=8192"


def test_the_line_names_the_layout():
    cfg, dims = gpt2_1024(layout={"dp_shard": 4})
    assert choose(cfg, GPU80, dims).line.startswith("fast defaults (cuda, 4 GPUs, fsdp4): train.compile=true, "
                                                    "train.compile_scope=block, model.loss_chunk=8192, "
                                                    "train.micro_batch_size=16 (est. ")
    cfg, dims = cfg_for({"dp_replicate": 2}, "train.global_batch_size=16")
    assert choose(cfg, CPU, dims).line == ("fast defaults (cpu, 2 processes, ddp2): train.compile=false, "
                                           "train.compile_scope=model, model.loss_chunk=0, train.micro_batch_size=8")


def test_resolution_is_repeatable_and_a_resume_across_devices_is_accepted():
    cfg, dims = gpt2_1024()
    assert choose(cfg, GPU80, dims) == choose(cfg, GPU80, dims)  # the same machine resolves alike
    on_gpu = choose(cfg, GPU80, dims).cfg
    fsdp_cfg, fsdp = gpt2_1024(layout={"dp_shard": 2})
    for later in (choose(cfg, CPU, dims).cfg, choose(fsdp_cfg, GPU80, fsdp).cfg, choose(cfg, Device("cuda", 8), dims).cfg):
        assert later != on_gpu
        # what auto may change (compilation, the loss chunk, the micro-batch) is not the model
        assert differences(on_gpu.to_dict(), later) == []


def test_fast_defaults_on_this_cpu():
    cfg, dims = cfg_for({}, "train.global_batch_size=16")
    c = fast_defaults(cfg, torch.device("cpu"), dims)
    assert c.cfg.train.micro_batch_size == 8 and c.cfg.train.compile is False


# ---- a real run --------------------------------------------------------------------------
def distlm(*args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, "-m", "distlm", *map(str, args)], cwd=cwd, env=env, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=300)
    assert p.returncode == 0, (args, p.stdout[-3000:], p.stderr[-3000:])
    return p


def test_a_cpu_run_prints_the_choice_and_records_it(tmp_path):
    tiny = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
            "model.vocab_size=256", "data.source=synthetic", "train.global_batch_size=12", "train.eval_every=0",
            "train.device=cpu", "log.progress=false", "log.tensorboard=false", f"log.root={tmp_path}", "log.name=r"]
    first = distlm("train", *tiny, "train.max_steps=3", cwd=tmp_path)
    line = "fast defaults (cpu, 1 process): train.compile=false, train.compile_scope=model, model.loss_chunk=0, " \
           "train.micro_batch_size=6"
    assert first.stdout.splitlines()[0] == line, first.stdout
    assert "2 micro-steps/step" in first.stdout  # 12 sequences in micro-batches of 6
    saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert (saved["train"]["compile"], saved["train"]["compile_scope"], saved["model"]["loss_chunk"],
            saved["train"]["micro_batch_size"]) == (False, "model", 0, 6)
    again = distlm("train", *tiny, "train.max_steps=5", "train.resume=auto", cwd=tmp_path)
    assert again.stdout.splitlines()[0] == line and "resumed from" in again.stdout, again.stdout
    assert yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["train"]["micro_batch_size"] == 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_readme_bench_gets_the_fast_settings(tmp_path):
    p = distlm("bench", "--config", "gpt2-124m-1024", "data.source=synthetic", "--steps", "3", "--warmup", "1",
               "--json", "r.json", cwd=tmp_path)
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("fast defaults (cuda, 1 GPU): "))
    assert "train.compile=true, train.compile_scope=model, model.loss_chunk=8192, train.micro_batch_size=" in line
    free = torch.cuda.mem_get_info()[0] / GIB
    if free > 40:  # an 80 GB card, as measured
        assert "train.micro_batch_size=64 " in line, line
    import json
    r = json.loads((tmp_path / "r.json").read_text())
    assert (r["compile"], r["compile_scope"], r["loss_chunk"]) == (True, "model", 8192)
    assert r["peak_mem_gb"] < free, r


# ---- speedrun-124m's data_parallel table: the recipe for the GPU count --------------------
@pytest.mark.parametrize("dp, expect", [
    (1, None), (2, None),  # 32 and 16 a rank: the preset as written
    (4, dict(global_batch_size=64, max_steps=300, warmup_steps=10, eval_every=100)),
    (8, dict(global_batch_size=128, max_steps=150, warmup_steps=5, eval_every=50)),
])
def test_speedrun_keeps_16_sequences_a_gpu_and_its_tokens(dp, expect):
    cfg, dims = cfg_for({"dp_replicate": dp}, preset="speedrun-124m")
    got = choose(cfg, GPU80, dims)
    t = got.cfg.train
    if expect is None:
        assert (t.global_batch_size, t.max_steps, t.warmup_steps, t.eval_every) == (32, 600, 20, 200)
    else:
        assert {k: getattr(t, k) for k in expect} == expect
        assert t.global_batch_size * t.max_steps == 32 * 600  # the same tokens
    assert "train.global_batch_size" not in got.chosen  # the preset's table, not a fast default
    assert t.micro_batch_size == 16 if dp > 1 else 32  # auto: the whole local batch in one forward


def test_the_table_is_the_preset_s_and_another_preset_has_none():
    # FSDP over 4 reads the same table (4 data-parallel ranks); TP2 x DDP2 has 2: the preset as written
    assert cfg_for({"dp_shard": 4}, preset="speedrun-124m")[0].train.global_batch_size == 64
    assert cfg_for({"dp_replicate": 2, "tp": 2}, preset="speedrun-124m")[0].train.global_batch_size == 32
    cfg, dims = cfg_for({"dp_shard": 4}, "train.global_batch_size=24", "train.max_steps=90", "train.micro_batch_size=auto",
                        preset="gpt2-124m")
    t = choose(cfg, GPU80, dims).cfg.train
    assert (t.global_batch_size, t.max_steps) == (24, 90)  # nothing rescales a run behind its back


def test_a_resume_on_more_gpus_that_grows_the_batch_is_refused_and_the_way_on_is_accepted():
    four, dims4 = cfg_for({"dp_replicate": 4}, preset="speedrun-124m")
    saved = choose(four, GPU80, dims4).cfg.to_dict()  # what the first run's checkpoint records
    eight, dims8 = cfg_for({"dp_replicate": 8}, preset="speedrun-124m")
    refused = differences(saved, choose(eight, GPU80, dims8).cfg)
    assert refused == [("train.global_batch_size", 64, 128)]
    # the documented way on: the first run's batch and length on the command line, which wins
    going_on, dims8 = cfg_for({"dp_replicate": 8}, "train.global_batch_size=64", "train.max_steps=300",
                              preset="speedrun-124m")
    assert differences(saved, choose(going_on, GPU80, dims8).cfg) == []
