"""Optimizers as components (distlm/optim/): the optim section and its old spellings, each
optimizer's declared state against the state a real step leaves, the planner's use of it, and
the whole-matrix distribution in distlm/parallel/whole_matrix.py."""
import dataclasses

import pytest
import torch
import yaml

from distlm.config import ConfigError, config_from_dict, load_config, to_yaml
from distlm.optim import KINDS, MATRIX, OTHER, REGISTRY, spec_for
from distlm.optim.groups import matrix_params
from distlm.train.optim import build_optimizer

TINY = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
        "model.vocab_size=128", "model.position=sinusoidal"]
OLD = ["train.optimizer=muon", "train.muon_lr=0.03", "train.embed_lr=0.2", "train.muon_momentum=0.9",
       "train.muon_ns_steps=4", "train.muon_ns_dtype=fp32", "train.muon_weight_decay=0.01"]
NEW = ["optim.name=muon", "optim.muon_lr=0.03", "optim.embed_lr=0.2", "optim.muon_momentum=0.9",
       "optim.muon_ns_steps=4", "optim.muon_ns_dtype=fp32", "optim.muon_weight_decay=0.01"]


# ---- the optim section and the spelling before it --------------------------------------
def test_old_flat_train_keys_load_as_the_optim_section(tmp_path):
    untied = ["model.tie_embeddings=false"]
    new = load_config(None, TINY + untied + NEW)
    assert load_config(None, TINY + untied + OLD) == new
    # a YAML file in the old spelling (a preset or config written before 2026-11-27)
    old_file = tmp_path / "old.yaml"
    old_file.write_text(yaml.safe_dump({"train": {o.split("=")[0].split(".")[1]: yaml.safe_load(o.split("=")[1])
                                                  for o in OLD}}))
    assert load_config(str(old_file), TINY + untied) == new
    # a saved run config (config.yaml, run-config.json, the checkpoint marker) of that day
    saved = yaml.safe_load(to_yaml(new))
    saved["train"].update({k.split(".")[1]: v for k, v in (o.split("=") for o in OLD)})
    del saved["optim"]
    assert config_from_dict(saved) == new
    # written back only in the new spelling
    written = yaml.safe_load(to_yaml(new))
    assert written["optim"]["name"] == "muon" and not {"optimizer", "muon_lr", "embed_lr"} & set(written["train"])


def test_a_bad_value_under_an_old_key_names_both_spellings():
    with pytest.raises(ConfigError, match=r"train\.optimizer \(now optim\.name\): 'sgd' is not one of"):
        load_config(None, ["train.optimizer=sgd"])
    with pytest.raises(ConfigError, match=r"optim\.name: 'sgd' is not one of"):
        load_config(None, ["optim.name=sgd"])
    with pytest.raises(ConfigError, match=r"optim\.muon_momentum must be in \[0, 1\), got 1\.0"):
        load_config(None, ["optim.name=muon", "optim.muon_momentum=1.0"])


def test_every_registered_optimizer_is_a_choice_of_optim_name():
    field = next(f for f in dataclasses.fields(type(load_config(None).optim)) if f.name == "name")
    assert tuple(REGISTRY) == field.metadata["choices"]
    assert all(spec_for(load_config(None, [f"optim.name={n}"])) is REGISTRY[n] for n in REGISTRY)


def test_a_checkpoint_in_the_old_spelling_is_the_same_optimizer_on_resume():
    from distlm.train.resume_check import differences
    cfg = load_config(None, TINY + ["model.tie_embeddings=false"] + NEW)
    saved = yaml.safe_load(to_yaml(cfg))
    del saved["optim"]
    saved["train"].update({"optimizer": "muon", "embed_lr": 0.1})
    assert differences(saved, cfg) == []  # another embedding rate may follow
    saved["train"]["optimizer"] = "adamw"
    assert differences(saved, cfg) == [("optim.name", "adamw", "muon")]


# ---- each optimizer's declared state ------------------------------------------------------
def _stepped(name: str):
    from distlm.model.gpt import GPT
    from distlm.model.loss import lm_loss
    # a value-embedding table too: another table the optimizer keeps state for
    cfg = load_config(None, TINY + [f"optim.name={name}", "optim.muon_ns_dtype=fp32", "model.value_embeds=1"])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt = build_optimizer(model, cfg, "cpu")
    ids = torch.randint(0, 128, (2, 17))
    lm_loss(model(ids[:, :-1]), ids[:, 1:]).backward()
    opt.step()
    return cfg, model, opt


@pytest.mark.parametrize("name", list(REGISTRY))
def test_the_declared_state_is_the_state_a_step_leaves(name):
    cfg, model, opt = _stepped(name)
    spec = REGISTRY[name]
    plain, fused = matrix_params(model)
    matrices = {id(p) for p in plain + fused}
    held = {MATRIX: 0, OTHER: 0}
    for p in model.parameters():
        kind = MATRIX if id(p) in matrices else OTHER
        state = opt.state[p]
        assert sorted(state) == sorted(t.key for t in spec.state[kind]), (name, kind)
        for t in spec.state[kind]:
            assert state[t.key].dtype == t.dtype
            assert state[t.key].shape == (p.shape if t.like_param else ())
            held[kind] += state[t.key].numel() * state[t.key].element_size() if t.like_param else 0
    # the planner counts the same bytes from the declaration (one process: nothing split)
    from distlm.planner import Candidate, estimate
    est = estimate(cfg.model, Candidate(1, 1, 1, 1), 2, 2, 80.0, compute_bytes=4, optimizer=spec)
    # (up to the value embeddings' learned scalar gates, which the planner leaves out)
    assert est.optim_gb * 2**30 == pytest.approx(held[MATRIX] + held[OTHER], rel=1e-3)
    assert est.params_gb * 2**30 == pytest.approx(sum(4 * p.numel() for p in model.parameters()), rel=1e-3)
    assert est.optimizer == name


def test_muon_plans_one_momentum_for_the_matrices_and_adamw_state_for_the_rest():
    from distlm.planner import Candidate, block_matrix_params, estimate
    m = load_config("gpt2-124m").model
    m = dataclasses.replace(m, vocab_size=50257)
    adamw, muon = (estimate(m, Candidate(1, 4, 1, 1), 32, 8, 80.0, optimizer=REGISTRY[n]) for n in ("adamw", "muon"))
    matrices = m.n_layer * block_matrix_params(m) / 4  # FSDP4: a quarter on each GPU
    assert (adamw.optim_gb - muon.optim_gb) * 2**30 == pytest.approx(4 * matrices, rel=1e-9)
    assert adamw.optim_gb == estimate(m, Candidate(1, 4, 1, 1), 32, 8, 80.0).optim_gb  # AdamW stays the default
    # the Nesterov momenta of every matrix and, at once, 3 fp32 copies of the largest stack (a third)
    assert muon.step_temporaries_gb * 2**30 == pytest.approx(4 * matrices * 2, rel=1e-9)
    assert all(k in KINDS for spec in REGISTRY.values() for k in spec.state)


def test_the_auto_micro_batch_counts_the_chosen_optimizers_state():
    from distlm.parallel.dims import ParallelDims
    from distlm.train.fast_defaults import Device, memory_estimate
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    est = {n: memory_estimate(load_config("gpt2-124m", [f"optim.name={n}", "model.loss_chunk=0"]),
                              Device("cuda", 80.0), dims, 8) for n in REGISTRY}
    assert est["muon"].optim_gb < est["adamw"].optim_gb and est["muon"].optimizer == "muon"


# ---- the whole-matrix distribution ------------------------------------------------------
def test_whole_matrices_transform_each_matrix_once_with_its_tag():
    from distlm.parallel.whole_matrix import WholeMatrices
    ps = [torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(6, 3)]
    pieces = [torch.full((4, 3), 1.0), torch.full((4, 3), 2.0), torch.full((6, 3), 3.0)]
    tags = ["a", "b", "a"]
    calls, got = [], {}

    def transform(stack, tag):
        calls.append((tuple(stack.shape), tag))
        return stack * (10 if tag == "a" else 100)

    done = WholeMatrices().map(list(zip(ps, pieces, tags)), transform, lambda idx, out: got.update(zip(idx, out)))
    assert done == 3 and sorted(calls) == [((1, 4, 3), "a"), ((1, 4, 3), "b"), ((1, 6, 3), "a")]
    assert [float(got[i][0, 0]) for i in range(3)] == [10.0, 200.0, 30.0]
