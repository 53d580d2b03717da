"""Export of the RoPE + RMSNorm variants beyond Llama (Qwen3, Arcee, Apertus), the `demo`
preset's model among them, read back by transformers with logits compared."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from distlm.config import ModelConfig, load_config  # noqa: E402
from distlm.interop import ExportError, export_hf  # noqa: E402
from distlm.interop.hf import hf_architecture  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TOL = 1e-4
ROPE = dict(position="rope", norm="rmsnorm")

VARIANTS = [
    ("qwen3-tied", dict(ROPE, mlp="swiglu", qk_norm=True), True, False, "Qwen3ForCausalLM"),
    ("qwen3-untied", dict(ROPE, mlp="swiglu", qk_norm=True), False, False, "Qwen3ForCausalLM"),
    ("arcee-tied", dict(ROPE, mlp="relu2"), True, False, "ArceeForCausalLM"),
    ("arcee-untied-bias", dict(ROPE, mlp="relu2"), False, True, "ArceeForCausalLM"),
    ("apertus-tied", dict(ROPE, mlp="relu2", qk_norm=True), True, False, "ApertusForCausalLM"),
    ("apertus-untied", dict(ROPE, mlp="relu2", qk_norm=True), False, False, "ApertusForCausalLM"),
]


@pytest.fixture(scope="module")
def bpe():
    from conftest import SAMPLE_TEXT
    from distlm.data.tokenizer import train_bpe
    return train_bpe(SAMPLE_TEXT, 300)


def read_back(out):
    m = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert next(m.parameters()).dtype == torch.float32
    return m


def logits_diff(ours, hf, vocab, block):
    ids = torch.randint(0, vocab, (2, block), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (ours(ids)[..., :vocab] - hf(ids).logits).abs().max().item()


@pytest.mark.parametrize("name,arch,tie,bias,cls", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_variant_logits_match(tmp_path, bpe, name, arch, tie, bias, cls):
    from helpers.checkpoints import make_run
    model, cfg = make_run(tmp_path / "run", bpe, tie_embeddings=tie, bias=bias, **arch)
    assert export_hf(tmp_path / "run", tmp_path / "hf")["architecture"] == cls
    hf = read_back(tmp_path / "hf")
    assert type(hf).__name__ == cls
    assert logits_diff(model, hf, cfg.model.vocab_size, cfg.model.block_size) <= TOL


def test_demo_model_exports_and_matches(tmp_path, bpe):
    """The model `make run` trains on CPU: its preset's every model field, at the BPE's vocabulary."""
    demo = load_config("demo").model
    assert (demo.qk_norm, demo.mlp, demo.position, demo.norm) == (True, "relu2", "rope", "rmsnorm")
    fields = {k: getattr(demo, k) for k in ("n_layer", "n_head", "d_model", "d_ff", "block_size", "position", "norm",
                                            "qk_norm", "mlp", "zero_init_proj", "bias", "tie_embeddings",
                                            "logit_softcap", "value_embeds", "skip_connections", "attn_mask",
                                            "norm_eps", "rope_theta")}
    from distlm.checkpoint import save_checkpoint
    from distlm.config import Config
    from distlm.model.gpt import GPT
    from helpers.checkpoints import randomize
    root = tmp_path / "run"
    cfg = Config(model=ModelConfig(vocab_size=bpe.vocab_size, **fields))
    model = randomize(GPT(cfg.model)).eval()
    (root / "tokenizer").mkdir(parents=True)
    bpe.save(root / "tokenizer")
    (root / "tokenizer" / "tokenizer.meta.json").write_text(json.dumps({"name": bpe.name}))
    save_checkpoint(root / "checkpoints", 1, model, torch.optim.AdamW(model.parameters()),
                    {"trainer": {}, "config": cfg.to_dict()})

    assert export_hf(root, tmp_path / "hf")["architecture"] == "ApertusForCausalLM"
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["hidden_act"] == "relu2" and conf["rope_parameters"]["rope_type"] == "default"
    hf = read_back(tmp_path / "hf")
    assert logits_diff(model, hf, bpe.vocab_size, demo.block_size) <= TOL


def test_refusals_say_what_the_model_has():
    with pytest.raises(ExportError) as e:
        hf_architecture(ModelConfig(position="learned", norm="layernorm", mlp="gelu", qk_norm=True))
    assert "model.qk_norm=True" in str(e.value) and "no norm" not in str(e.value)
    with pytest.raises(ExportError) as e:
        hf_architecture(ModelConfig(**ROPE, mlp="relu2", qk_norm=True, logit_softcap=30.0))
    msg = str(e.value)
    assert msg.startswith("model.logit_softcap=30.0 (logits soft-capped by tanh)") and "no logit" not in msg
    # Qwen3's and Apertus' MLPs have no bias: said, not dropped
    with pytest.raises(ExportError, match="model.bias=True.*has no bias"):
        hf_architecture(ModelConfig(**ROPE, mlp="relu2", qk_norm=True, bias=True))
