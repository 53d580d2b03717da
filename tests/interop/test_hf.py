"""Hugging Face interop: export to GPT2LMHeadModel / LlamaForCausalLM, import back, exact logits."""
import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from distlm.config import ModelConfig  # noqa: E402
from distlm.interop import (ExportError, InteropError, apply_hf_model_config, export_hf,  # noqa: E402
                            load_hf_into, model_config_from_hf)
from distlm.interop.hf import hf_architecture  # noqa: E402
from distlm.model.generate import SamplingConfig, generate_tokens  # noqa: E402
from distlm.model.gpt import GPT  # noqa: E402
from helpers.checkpoints import make_run, randomize  # noqa: E402,F401

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TOL = 1e-4
GPT2_LIKE = dict(position="learned", norm="layernorm", mlp="gelu")
LLAMA_LIKE = dict(position="rope", norm="rmsnorm", mlp="swiglu")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from conftest import SAMPLE_TEXT
    from distlm.data.tokenizer import train_bpe
    return train_bpe(SAMPLE_TEXT, 300)


def load_hf(out):
    m = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert next(m.parameters()).dtype == torch.float32
    return m


def max_diff(ours, hf, vocab, ids):
    with torch.no_grad():
        return (ours(ids)[..., :vocab] - hf(ids).logits).abs().max().item()


def distlm_from_hf(path, meta=False):
    cfg = apply_hf_model_config(ModelConfig(), path)
    if meta:  # the Trainer's path: build on meta, materialise, init, then load
        with torch.device("meta"):
            model = GPT(cfg)
        model.to_empty(device="cpu")
        model.init_weights()
    else:
        model = GPT(cfg)
    load_hf_into(model, path)
    return model.eval()


EXPORTS = [
    ("gpt2-tied-bias", GPT2_LIKE, True, True, "GPT2LMHeadModel"),
    ("gpt2-untied-bias", GPT2_LIKE, False, True, "GPT2LMHeadModel"),
    ("gpt2-tied-nobias", GPT2_LIKE, True, False, "GPT2LMHeadModel"),
    ("gpt2-untied-nobias", GPT2_LIKE, False, False, "GPT2LMHeadModel"),
    ("sinusoidal", dict(GPT2_LIKE, position="sinusoidal"), True, True, "GPT2LMHeadModel"),
    ("llama-tied", LLAMA_LIKE, True, False, "LlamaForCausalLM"),
    ("llama-untied", LLAMA_LIKE, False, False, "LlamaForCausalLM"),
    ("llama-untied-bias", LLAMA_LIKE, False, True, "LlamaForCausalLM"),
]


@pytest.mark.parametrize("name,arch,tie,bias,cls", EXPORTS, ids=[e[0] for e in EXPORTS])
def test_export_logits_match(tmp_path, bpe, name, arch, tie, bias, cls):
    model, cfg = make_run(tmp_path / "run", bpe, tie_embeddings=tie, bias=bias, **arch)
    assert cfg.model.padded_vocab_size > cfg.model.vocab_size  # the padding rows must be cut
    summary = export_hf(tmp_path / "run", tmp_path / "hf")
    assert summary["architecture"] == cls
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    hf = load_hf(tmp_path / "hf")
    assert type(hf).__name__ == cls
    assert hf.get_output_embeddings().weight.shape[0] == cfg.model.vocab_size
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size), generator=torch.Generator().manual_seed(1))
    assert max_diff(model, hf, cfg.model.vocab_size, ids) <= TOL

    # ... and back: distlm -> HF -> distlm generates the same greedy tokens.
    back = distlm_from_hf(tmp_path / "hf", meta=True)
    sc = SamplingConfig(max_new_tokens=40, temperature=0)  # runs past block_size: the window restart too
    prompt = ids[0, :5].tolist()
    a = torch.stack(list(generate_tokens(model, prompt, sc))).tolist()
    b = torch.stack(list(generate_tokens(back, prompt, sc))).tolist()
    assert a == b


def test_gpt2_tokenizer_and_vocab(tmp_path):
    from distlm.data.tokenizer import gpt2
    model, cfg = make_run(tmp_path / "run", gpt2(), **GPT2_LIKE)
    export_hf(tmp_path / "run", tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("Hello world").input_ids == [15496, 995]
    assert tok.eos_token_id == 50256 and tok.decode([15496, 995]) == "Hello world"
    assert transformers.GPT2TokenizerFast.from_pretrained(tmp_path / "hf")("Hello world").input_ids == [15496, 995]
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["vocab_size"] == 50257 and conf["eos_token_id"] == 50256
    hf = load_hf(tmp_path / "hf")
    ids = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(2))
    assert max_diff(model, hf, 50257, ids) <= TOL


def test_bpe_tokenizer_loads(tmp_path, bpe):
    make_run(tmp_path / "run", bpe, **LLAMA_LIKE)
    export_hf(tmp_path / "run", tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Call me Ishmael. Some years ago, never mind how long"
    assert tok(text).input_ids == bpe.encode(text)
    assert tok.decode(bpe.encode(text)) == text
    assert tok.eos_token_id == bpe.eos_id == json.loads((tmp_path / "hf" / "generation_config.json").read_text())[
        "eos_token_id"]


@pytest.mark.parametrize("arch,field", [
    (dict(position="rope", norm="layernorm", mlp="swiglu"), "model.norm=layernorm"),
    (dict(position="learned", norm="layernorm", mlp="swiglu"), "model.mlp=swiglu"),
    (dict(position="sinusoidal", norm="rmsnorm", mlp="gelu"), "model.norm=rmsnorm"),
    (dict(position="rope", norm="rmsnorm", mlp="gelu"), "model.mlp=gelu"),
])
def test_unmappable_config_is_refused(tmp_path, bpe, arch, field):
    with pytest.raises(ExportError, match=field):
        hf_architecture(ModelConfig(vocab_size=10, **arch))
    make_run(tmp_path / "run", bpe, **arch)
    with pytest.raises(ExportError, match=field) as e:
        export_hf(tmp_path / "run", tmp_path / "hf")
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written


def test_failed_export_leaves_nothing_and_existing_out_is_kept(tmp_path, bpe, monkeypatch):
    import distlm.interop.hf as hfmod
    make_run(tmp_path / "run", bpe, **GPT2_LIKE)

    def boom(*a):
        raise OSError("disk full")
    monkeypatch.setattr(hfmod, "_write_tokenizer", boom)
    with pytest.raises(OSError, match="disk full"):
        export_hf(tmp_path / "run", tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    monkeypatch.undo()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match="already exists"):
        export_hf(tmp_path / "run", tmp_path / "hf")
    export_hf(tmp_path / "run", tmp_path / "hf", overwrite=True)
    assert not (tmp_path / "hf" / "keep.txt").exists() and (tmp_path / "hf" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]


@torch.no_grad()
def hf_randomize(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        p.copy_(1 + 0.1 * noise if ("norm" in name or "ln_" in name) and name.endswith("weight") else 0.05 * noise)
    return model.eval()


@pytest.mark.parametrize("tie", [True, False])
def test_import_gpt2(tmp_path, tie):
    conf = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                   tie_word_embeddings=tie, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    hf = hf_randomize(transformers.GPT2LMHeadModel(conf))
    hf.save_pretrained(tmp_path)
    fields = model_config_from_hf(tmp_path)
    assert fields["d_ff"] == 128 and fields["tie_embeddings"] is tie and fields["position"] == "learned"
    model = distlm_from_hf(tmp_path)
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(3))
    assert max_diff(model, hf, 100, ids) <= TOL


def test_import_gpt2_bin_without_prefix_and_shorter_context(tmp_path):
    # The layout of the original hub checkpoint: pytorch_model.bin of a bare GPT2Model.
    conf = transformers.GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    hf = hf_randomize(transformers.GPT2LMHeadModel(conf))
    conf.save_pretrained(tmp_path)
    torch.save({k: v.clone() for k, v in hf.transformer.state_dict().items()}, tmp_path / "pytorch_model.bin")
    cfg = apply_hf_model_config(ModelConfig(), tmp_path, block_size=16)
    model = GPT(cfg)
    load_hf_into(model, tmp_path)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(4))
    assert max_diff(model.eval(), hf, 100, ids) <= TOL


@pytest.mark.parametrize("tie,bias", [(True, False), (False, False), (False, True)])
def test_import_llama(tmp_path, tie, bias):
    conf = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                                    rms_norm_eps=1e-5, tie_word_embeddings=tie, attention_bias=bias, mlp_bias=bias,
                                    rope_theta=500.0)
    hf = hf_randomize(transformers.LlamaForCausalLM(conf))
    hf.save_pretrained(tmp_path)
    fields = model_config_from_hf(tmp_path)
    assert fields["rope_theta"] == 500.0 and fields["bias"] is bias and fields["norm_eps"] == 1e-5
    model = distlm_from_hf(tmp_path, meta=True)
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(5))
    assert max_diff(model, hf, 100, ids) <= TOL


def test_import_refuses_what_distlm_cannot_represent(tmp_path):
    conf = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(conf).save_pretrained(tmp_path / "gqa")
    with pytest.raises(InteropError, match="num_key_value_heads=2"):
        apply_hf_model_config(ModelConfig(), tmp_path / "gqa")
    conf = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                   activation_function="relu")
    transformers.GPT2LMHeadModel(conf).save_pretrained(tmp_path / "relu")
    with pytest.raises(InteropError, match="activation_function='relu'"):
        model_config_from_hf(tmp_path / "relu")
    with pytest.raises(InteropError, match="config.json: missing"):
        model_config_from_hf(tmp_path)
    # A model built with other fields than the folder's is refused, not half-loaded.
    conf = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    transformers.GPT2LMHeadModel(conf).save_pretrained(tmp_path / "ok")
    cfg = dataclasses.replace(apply_hf_model_config(ModelConfig(), tmp_path / "ok"), n_layer=3)
    with pytest.raises(InteropError, match="model.n_layer=3"):
        load_hf_into(GPT(cfg), tmp_path / "ok")


def test_cli_export(tmp_path, bpe, capsys):
    from distlm.cli import main
    make_run(tmp_path / "run", bpe, **LLAMA_LIKE)
    assert main(["export", "--format", "hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    make_run(tmp_path / "bad", bpe, position="rope", norm="layernorm", mlp="swiglu")
    assert main(["export", str(tmp_path / "bad"), str(tmp_path / "hf2")]) == 2
    assert "model.norm=layernorm" in capsys.readouterr().err


def gpt2_config(folder, **kw):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 3, "n_head": 4, "n_embd": 64,
                                                    "n_positions": 256, "vocab_size": 300, **kw}))
    return folder


def test_from_hf_says_what_it_takes_from_the_folder(tmp_path):
    from distlm.cli.verbs import _model_fields_given
    from distlm.config import load_config
    from distlm.interop.hf_load import from_hf_settings
    hf = gpt2_config(tmp_path / "hf")
    cfg = load_config(None, [f"init.from_hf={hf}"])
    line = from_hf_settings(cfg.model, hf, _model_fields_given(None, [f"init.from_hf={hf}"]))
    assert line.startswith(f"init.from_hf={hf}: a Hugging Face gpt2 model; its weights start the run; "
                           f"from its config.json: model.n_layer=3, model.n_head=4, model.d_model=64, "
                           f"model.d_ff=256, model.position=learned,"), line
    assert line.endswith("model.block_size=128, its first 128 of 256 positions (model.block_size=256 for all)"), line
    # a setting the user gave that agrees with the folder is fine
    agreed = ["model.n_layer=3", "model.position=learned"]
    from_hf_settings(load_config(None, agreed).model, hf, _model_fields_given(None, agreed))


@pytest.mark.parametrize("given, said", [
    (["model.position=sinusoidal"], "model.position=sinusoidal (the folder's is learned)"),
    (["--config", "tiny"], "model.n_layer=4 (the folder's is 3), model.d_model=128 (the folder's is 64), "
                           "model.d_ff=512 (the folder's is 256), model.position=sinusoidal (the folder's is learned)"),
], ids=["override", "preset"])
def test_from_hf_refuses_a_setting_the_folder_contradicts(tmp_path, capsys, given, said):
    from distlm.cli import main
    hf = gpt2_config(tmp_path / "hf")
    assert main(["train", *given, f"init.from_hf={hf}", "data.source=synthetic", "train.device=cpu",
                 f"log.root={tmp_path}", "log.name=r"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: init.from_hf={hf}: {said}; the architecture comes from the folder" in err, err
    assert not (tmp_path / "r").exists()
