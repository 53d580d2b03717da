"""Configs, markers, tokenizer records and sampling arguments from someone else: every one is
checked before anything is built or allocated, and a bad one is a one-line error naming the
file, field or value (an adversarial run on CPU, 2026-11-27, found each case below a
traceback, a hang, a silent misreading or an allocation of hundreds of GB).

In-process calls where the error is a Python exception; one test runs the command lines
through pipes, for the one line on stderr and exit 2 a user sees."""
import json
import os
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from distlm.config import ConfigError, config_from_dict, load_config
from distlm.data import DataError
from helpers.runs import TINY_RUN, tiny_run

ROOT = Path(__file__).resolve().parents[1]
TINY = TINY_RUN + ["log.samples=0"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_data) -> Path:
    """A 2-step run of a 2-layer model, block_size 16, on the GPT-2 tokenizer."""
    return tiny_run(tmp_path_factory.mktemp("runs"), tiny_data, 2, "log.samples=0")


def _saved(run: Path) -> tuple[Path, dict]:
    from distlm.checkpoint import store as ckpt
    folder = ckpt.resolve_checkpoint(run)
    return folder, ckpt.read_meta(folder)


# ---- configs: the marker's, config.yaml's and the command line's alike ---------------------
@pytest.mark.parametrize("section, key, value, needle", [
    ("model", "n_head", 3, "model.n_head=3"),                      # does not divide d_model: was a traceback
    ("model", "norm_eps", float("nan"), "model.norm_eps"),         # was `loss: NaN`, exit 0
    ("model", "block_size", 10 ** 9, "model.block_size=1000000000"),  # tried to allocate 256 GB
    ("model", "n_layer", 100000, "model.n_layer=100000"),          # still allocating after 300 s
    ("model", "n_layer", "many", "model.n_layer"),
    ("model", "dropout", 1.5, "model.dropout"),
    ("model", None, "gpt2-124m", "section 'model' must be a mapping"),  # was read as a preset (or any YAML file)
])
def test_a_marker_config_is_validated_before_anything_is_built(run, section, key, value, needle):
    from distlm.model.load import saved_config
    folder, meta = _saved(run)
    assert saved_config(folder, meta) == config_from_dict(meta["config"])  # the real one passes
    if key is None:
        meta["config"][section] = value
    else:
        meta["config"][section][key] = value
    with pytest.raises(ConfigError) as e:
        saved_config(folder, meta)
    assert str(e.value).startswith(str(folder / "distlm.json")) and needle in str(e.value), str(e.value)


def test_load_trained_refuses_an_edited_marker_config_before_allocating(run, monkeypatch):
    """eval, generate and export all load through load_trained: the marker's config is read
    there and checked before the model exists (the marker stands edited in memory, so the test
    holds whether or not the marker's bytes are also covered by a checksum)."""
    from distlm.checkpoint import store as ckpt
    from distlm.model import load as load_mod
    real = ckpt.read_meta

    def edited(folder, *a, **k):
        meta = real(folder, *a, **k)
        meta["config"]["model"]["n_head"] = 3
        return meta
    monkeypatch.setattr(ckpt, "read_meta", edited)
    built = []
    monkeypatch.setattr(load_mod, "_module", lambda *a: built.append(a))
    with pytest.raises(ConfigError, match=r"distlm\.json: model\.d_model=32 is not divisible by model\.n_head=3"):
        load_mod.load_trained(run, "cpu", task="lm")
    assert not built


@pytest.mark.parametrize("override, needle", [
    ("model.n_layer=100000", "model.n_layer=100000"),              # no error after 240 s
    ("model.d_model=1048576", "model.d_model=1048576"),            # tried 211 GB
    ("model.block_size=100000000", "model.block_size=100000000"),  # tried 25.6 GB
    ("model.n_layer=1e400", "model.n_layer: '1e400'"),             # OverflowError traceback
    ("train.seed=99999999999999999999999", "train.seed=99999999999999999999999"),
    ("train.global_batch_size=1e30", "train.global_batch_size"),
    ("log.samples=100000000", "log.samples=100000000"),
    ("model.norm_eps=2", "model.norm_eps=2.0"),
])
def test_absurd_numbers_on_the_command_line_are_refused_by_name(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [override])
    assert needle in str(e.value), str(e.value)


def test_the_planner_counts_the_parameters_the_model_holds():
    """The memory checks rest on this count; every option that adds tables is compared."""
    from distlm.model.gpt import GPT
    from distlm.model.memory import model_parameters
    for extra in ([], ["model.tie_embeddings=false", "model.mlp=swiglu", "model.bias=false"],
                  ["model.position=learned", "model.norm=rmsnorm", "model.value_embeds=1", "model.n_layer=4"]):
        m = load_config("tiny", ["model.vocab_size=1000", *extra]).model
        with torch.device("meta"):
            real = sum(p.numel() for p in GPT(m).parameters())
        assert model_parameters(m) == pytest.approx(real, rel=1e-4, abs=8), extra


def test_a_run_that_cannot_fit_is_refused_before_its_folder_exists(tiny_data, tmp_path, monkeypatch):
    """The planner's estimate is checked against the host's free RAM before the run folder is
    made (a refused start used to leave a folder holding only .lock); train.memory_check=false
    starts it anyway."""
    import distlm.train.memory_check as memory_check
    from distlm.train.trainer import Trainer
    monkeypatch.setattr(memory_check, "host_available_bytes", lambda: 1 << 20)  # a 1 MiB machine
    root = tmp_path / "runs"
    cfg = load_config("tiny", TINY + [f"data.dir={tiny_data}", "train.max_steps=1", f"log.root={root}"])
    with pytest.raises(ConfigError) as e:
        Trainer(cfg)
    assert "GiB but this machine's RAM has 0.0 GiB free" in str(e.value) and "train.memory_check=false" in str(e.value)
    assert not root.exists() or not any(root.iterdir())
    trainer = Trainer(load_config("tiny", TINY + [f"data.dir={tiny_data}", "train.max_steps=1",
                                                  f"log.root={root}", "train.memory_check=false"]))
    assert trainer.run_dir.is_dir()
    trainer.lock.release()


def test_loading_a_checkpoint_checks_memory_first(run, monkeypatch):
    """The weights and position tables a load allocates (and, for generate, the KV cache and
    logits of its samples) are compared with the free RAM before anything is allocated."""
    import distlm.host as host
    from distlm.model import load as load_mod
    from distlm.model.memory import inference_bytes
    folder, meta = _saved(run)
    cfg = config_from_dict(meta["config"])
    weights = inference_bytes(cfg.model)
    monkeypatch.setattr(host, "host_available_bytes", lambda: weights - 1)
    built = []
    monkeypatch.setattr(load_mod, "_module", lambda *a: built.append(a))
    with pytest.raises(ConfigError, match="needs about .* GiB but this machine's RAM has"):
        load_mod.load_trained(run, "cpu", task="lm")
    assert not built
    monkeypatch.setattr(host, "host_available_bytes", lambda: weights + 1)
    load_mod.check_model_fits(cfg, "cpu", folder)  # the weights alone fit
    with pytest.raises(ConfigError, match="4096 samples at once"):
        load_mod.check_model_fits(cfg, "cpu", folder, batch=4096, kept_tokens=16 + 200)


# ---- the run's tokenizer ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory) -> Path:
    """A run folder's tokenizer/ as training writes it, for a byte-level BPE: tokenizer.json and
    tokenizer.meta.json (name, vocab_size, fingerprint), and a checkpoint folder's path."""
    from conftest import SAMPLE_TEXT
    from distlm.data.tokenizer import train_bpe
    tok = train_bpe(SAMPLE_TEXT, 300)
    run = tmp_path_factory.mktemp("bpe_run")
    tok.save(run / "tokenizer")
    (run / "tokenizer" / "tokenizer.meta.json").write_text(json.dumps(
        {"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "fingerprint": tok.fingerprint()}))
    return run


def _copy(bpe_run: Path, tmp_path: Path) -> Path:
    shutil.copytree(bpe_run, tmp_path / "run")
    return tmp_path / "run"


def test_the_run_tokenizer_is_checked_against_its_fingerprint(bpe_run, tmp_path):
    from distlm.model.load import load_run_tokenizer
    cfg = load_config(None, [])
    run = _copy(bpe_run, tmp_path)
    ckpt = run / "checkpoints" / "step_2"
    tok = load_run_tokenizer(ckpt, cfg)  # unchanged: loads
    assert tok.decode(tok.encode("Alice sat in at")) == "Alice sat in at"
    spec_file = run / "tokenizer" / "tokenizer.json"
    spec = json.loads(spec_file.read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["t"] = vocab["t"], vocab["a"]  # two ids swapped: same size, other text
    spec_file.write_text(json.dumps(spec))
    with pytest.raises(DataError, match=r"tokenizer\.json: fingerprint \w+ is not the \w+ recorded in .*meta\.json"):
        load_run_tokenizer(ckpt, cfg)


@pytest.mark.parametrize("meta_text, needle", [
    (lambda m: json.dumps({k: v for k, v in m.items() if k != "name"}), "has no name"),  # was a KeyError
    (lambda m: "{not json", "not a readable tokenizer record"),
    (lambda m: json.dumps([1, 2]), "not a mapping"),
    (lambda m: json.dumps({**m, "vocab_size": "300"}), "vocab_size must be an integer"),
    (lambda m: json.dumps({**m, "fingerprint": 7}), "fingerprint must be a sha256"),
])
def test_a_broken_tokenizer_record_is_one_error(bpe_run, tmp_path, meta_text, needle):
    """generate and export load the tokenizer through load_run_tokenizer; eval compares the
    record (run_tokenizer_record) with the data's."""
    from distlm.model.load import load_run_tokenizer, run_tokenizer_record
    run = _copy(bpe_run, tmp_path)
    meta_file = run / "tokenizer" / "tokenizer.meta.json"
    meta_file.write_text(meta_text(json.loads(meta_file.read_text())))
    ckpt = run / "checkpoints" / "step_2"
    for read in (lambda: load_run_tokenizer(ckpt, load_config(None, [])), lambda: run_tokenizer_record(ckpt)):
        with pytest.raises(DataError) as e:
            read()
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---- sampling, mixtures, inputs ------------------------------------------------------------
@pytest.mark.parametrize("kwargs, needle", [
    ({"num_samples": 100_000_000}, "--num-samples must be between 1 and 4,096, got 100000000"),
    ({"max_new_tokens": 10 ** 9}, "--max-new-tokens must be between 1 and 1,048,576, got 1000000000"),
    ({"seed": 99999999999999999999999}, "--seed must be between -9223372036854775808 and 9223372036854775807"),
    ({"seed": -(1 << 63) - 1}, "--seed must be between -9223372036854775808 and"),
])
def test_sampling_arguments_have_limits_checked_before_loading(tmp_path, kwargs, needle):
    from distlm.cli.generate import generate
    with pytest.raises(ConfigError) as e:
        generate(checkpoint=str(tmp_path / "no-such-run"), prompt="x", **kwargs)
    assert needle in str(e.value), str(e.value)


def test_the_last_prompt_seed_must_fit_too(tmp_path):
    from distlm.cli.generate import MAX_SEED, generate
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\nc\n")
    with pytest.raises(ConfigError, match=r"the last \(9223372036854775808\)"):
        generate(checkpoint=str(tmp_path / "no-such-run"), prompts_file=str(prompts), out=str(tmp_path / "o.jsonl"),
                 seed=MAX_SEED - 1)


def test_an_absurd_mixture_weight_is_refused_without_computing_it(monkeypatch):
    """1e99999999 as an exact fraction is a hundred-million-digit integer: it hung. The text is
    judged first; Fraction never sees it (the guard fails the test if it would)."""
    import distlm.data.mixture as mixture

    def guarded(text="0", *rest):
        assert "99999999" not in str(text), f"Fraction({text!r}) would not finish"
        return Fraction(text, *rest)
    monkeypatch.setattr(mixture, "Fraction", guarded)
    for weight in ("1e99999999", "1e-99999999", "1/1e99999999"):
        with pytest.raises(DataError, match=f"weight '{weight}' is out of range"):
            mixture.parse_mix(f"a=/data/a:{weight},b=/data/b:1")
    assert [e.weight for e in mixture.parse_mix("a=/data/a:0.7,b=/data/b:1/3,c=/data/c:2e-3")] == \
        [Fraction(7, 10), Fraction(1, 3), Fraction(1, 500)]


def test_a_symbolic_link_loop_among_the_inputs_is_one_error(tmp_path):
    from distlm.corpus.sources import resolve_inputs
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.txt").write_text("some text")
    os.symlink("loop2", folder / "loop1")
    os.symlink("loop1", folder / "loop2")
    with pytest.raises(DataError, match=r"loop1: Too many levels of symbolic links"):
        resolve_inputs([str(folder)])
    with pytest.raises(DataError, match="a symbolic link to nothing readable"):
        resolve_inputs([str(folder / "loop1")])


# ---- what a user sees -------------------------------------------------------------------------
def test_refusals_are_one_line_with_exit_2_and_leave_no_run_folder(tmp_path):
    """Each through `python -m distlm`, all started at once (each pays seconds of imports)."""
    root = tmp_path / "runs"
    loop = tmp_path / "in"
    loop.mkdir()
    (loop / "a.txt").write_text("some text")
    os.symlink("x", loop / "x")
    train = ["train", f"log.root={root}", "data.source=synthetic", "model.vocab_size=256"]
    gen = ["generate", "--checkpoint", tmp_path / "no-run", "--prompt", "x"]
    cases = [
        ([*train, "model.n_layer=100000"], "model.n_layer=100000"),
        ([*train, "model.d_model=1048576"], "model.d_model=1048576"),
        ([*train, "model.block_size=100000000"], "model.block_size=100000000"),
        ([*train, "model.n_layer=1e400"], "'1e400'"),
        ([*train, "model.n_layer=2000", "model.d_model=16384", "model.n_head=128"], "train.memory_check=false"),
        ([*gen, "--num-samples", "100000000"], "--num-samples"),
        ([*gen, "--seed", "99999999999999999999999"], "--seed"),
        (["prepare", loop, "--out", tmp_path / "out", "--workers", "1"], "symbolic link"),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "distlm", *map(str, args)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for args, _ in cases]
    for (args, needle), p in zip(cases, procs):
        _, err = p.communicate(timeout=600)
        lines = err.splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (args, err)
        assert needle in lines[0], (args, lines[0])
    assert not root.exists() or not any(root.iterdir()), list(root.iterdir())
    assert not (tmp_path / "out").exists()


def test_the_data_folders_tokenizer_is_checked_against_its_manifest(text_dir, tmp_path):
    """Training loads the tokenizer beside the data; two ids swapped in its tokenizer.json keep
    the vocabulary size, so only the manifest's fingerprint tells the data was tokenized with
    another mapping than the one samples would be decoded with."""
    from distlm.corpus.prepare import prepare
    from distlm.tasks.lm import LMTask
    data = tmp_path / "data"
    prepare([str(text_dir)], data, tokenizer="bpe:300", val_fraction=0.1, workers=1, progress=False)
    cfg = load_config("tiny", [f"data.dir={data}"])
    LMTask().resolve(cfg, None, True)  # unchanged: resolves
    spec_file = data / "tokenizer.json"
    spec = json.loads(spec_file.read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["t"] = vocab["t"], vocab["a"]
    spec_file.write_text(json.dumps(spec))
    with pytest.raises(DataError, match=r"tokenizer\.json: fingerprint \w+ is not the \w+ recorded in .*manifest\.json"):
        LMTask().resolve(cfg, None, True)
