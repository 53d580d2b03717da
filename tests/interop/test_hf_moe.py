"""A mixture of experts exported as Glm4MoeForCausalLM: logits equal through transformers,
routing biases included; what it cannot express is refused in one line."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from distlm.checkpoint import save_checkpoint  # noqa: E402
from distlm.config import Config, ModelConfig, MoEConfig  # noqa: E402
from distlm.interop import ExportError, export_hf  # noqa: E402
from distlm.interop.hf import hf_architecture  # noqa: E402
from distlm.model.gpt import GPT  # noqa: E402
from distlm.model.moe import MoE  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
LLAMA_LIKE = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False)


@pytest.fixture(scope="module")
def bpe():
    from conftest import SAMPLE_TEXT
    from distlm.data.tokenizer import train_bpe
    return train_bpe(SAMPLE_TEXT, 300)


def make_run(root, tok, moe: MoEConfig, **model_kw):
    cfg = Config(model=ModelConfig(n_layer=3, n_head=4, d_model=32, d_ff=64, block_size=32,
                                   vocab_size=tok.vocab_size, moe=moe, **{**LLAMA_LIKE, **model_kw}))
    model = GPT(cfg.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.05 * noise)
        for m in model.modules():
            if isinstance(m, MoE):  # biases as a balanced run leaves them: they change the choice
                m.expert_bias.copy_(0.05 * torch.randn(m.expert_bias.shape, generator=g))
    (root / "tokenizer").mkdir(parents=True)
    tok.save(root / "tokenizer")
    (root / "tokenizer" / "tokenizer.meta.json").write_text(json.dumps({"name": tok.name}))
    save_checkpoint(root / "checkpoints", 1, model, torch.optim.AdamW(model.parameters()),
                    {"trainer": {}, "config": cfg.to_dict()})
    return model.eval(), cfg


@pytest.mark.parametrize("moe,extra", [
    (MoEConfig(experts=4, top_k=2, shared=1, d_ff=24, first_dense=1), {}),
    (MoEConfig(experts=6, top_k=3, route_scale=2.5), dict(tie_embeddings=False, qk_norm=True)),
], ids=["shared-first-dense", "no-shared-qk-norm"])
def test_export_logits_match_through_transformers(tmp_path, bpe, moe, extra):
    model, cfg = make_run(tmp_path / "run", bpe, moe, **extra)
    summary = export_hf(tmp_path / "run", tmp_path / "hf")
    assert summary["architecture"] == "Glm4MoeForCausalLM"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "Glm4MoeForCausalLM"
    bias = hf.model.layers[2].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, model.blocks["2"].mlp.expert_bias)
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids)[..., :cfg.model.vocab_size], hf(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    # The biases matter: without them transformers routes (and predicts) otherwise.
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.zero_()
        assert (ours - hf(ids).logits).abs().max().item() > 1e-3


@pytest.mark.parametrize("kw,field", [
    (dict(moe=MoEConfig(experts=4, every=2)), "model.moe.every=2"),
    (dict(moe=MoEConfig(experts=4), mlp="gelu"), "model.mlp=gelu"),
    (dict(moe=MoEConfig(experts=4), bias=True), "model.bias=True"),
])
def test_what_glm4moe_cannot_express_is_refused(kw, field):
    with pytest.raises(ExportError, match=field) as e:
        hf_architecture(ModelConfig(vocab_size=10, **{**LLAMA_LIKE, **kw}))
    assert "\n" not in str(e.value)
