"""Optimizers as components (distlm/optim/): the optim section, each
optimizer's declared state against the state a real step leaves, the planner's use of it, and
the whole-matrix distribution in distlm/parallel/whole_matrix.py."""
import dataclasses

import pytest
import torch

from distlm.config import ConfigError, load_config
from distlm.optim import KINDS, MATRIX, OTHER, REGISTRY, spec_for
from distlm.optim.groups import matrix_params
from distlm.train.optim import build_optimizer

TINY = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
        "model.vocab_size=128", "model.position=sinusoidal"]


# ---- the optim section ------------------------------------------------------------------
def test_a_bad_optimizer_name_is_refused():
    with pytest.raises(ConfigError, match=r"optim\.name: 'sgd' is not one of"):
        load_config(None, ["optim.name=sgd"])
    with pytest.raises(ConfigError, match=r"optim\.muon\.momentum must be in \[0, 1\), got 1\.0"):
        load_config(None, ["optim.name=muon", "optim.muon.momentum=1.0"])


def test_a_key_of_the_flat_train_spelling_is_an_unknown_key():
    """The optimizer's settings live in the optim section only: train.optimizer is refused as any
    unknown key is, with the nearest real key suggested where there is one."""
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.optimizer'"):
        load_config(None, ["train.optimizer=muon"])
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.muon_lr'"):
        load_config(None, ["train.muon_lr=0.02"])


@pytest.mark.parametrize("old,new", [
    ("train.lr", "optim.adamw.lr"), ("train.beta1", "optim.adamw.beta1"), ("train.beta2", "optim.adamw.beta2"),
    ("train.eps", "optim.adamw.eps"), ("train.weight_decay", "optim.adamw.weight_decay"),
    ("train.min_lr", "min_lr_ratio"), ("optim.muon_lr", "optim.muon.lr"), ("optim.embed_lr", "optim.muon.embed_lr"),
    ("optim.muon_momentum", "optim.muon.momentum"), ("optim.muon_ns_steps", "optim.muon.ns_steps"),
    ("optim.muon_ns_dtype", "optim.muon.ns_dtype"), ("optim.muon_weight_decay", "optim.muon.weight_decay"),
    ("optim.lion_beta1", "optim.lion.beta1"), ("optim.lion_weight_decay", "optim.lion.weight_decay"),
])
def test_an_old_key_is_unknown_and_the_suggestion_names_the_new_one(old, new):
    """Each optimizer's settings are its own part, optim.NAME.*: a key of the old spelling is
    refused as any unknown key is, and the did-you-mean (a field of that name elsewhere in the
    tree, else the nearest spelling in its section) names where it went."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{old}=0.5"])
    assert str(e.value) == f"unknown config key '{old}' (did you mean '{new}'?)"
    with pytest.raises(ConfigError, match=f"unknown config key '{old}'"):  # in a file the same
        from distlm.config import config_from_dict
        section, key = old.split(".", 1)
        config_from_dict({section: {key: 0.5}})


def test_each_optimizer_reads_its_own_part_and_the_schedule_scales_every_peak():
    from distlm.model.gpt import GPT
    from distlm.train.schedule import lr_at
    cfg = load_config(None, TINY + ["optim.name=lion", "optim.lion.lr=2e-4", "optim.adamw.lr=9.0"])
    assert spec_for(cfg).peak_lr(cfg) == 2e-4  # Lion's own rate; AdamW's is not read
    assert [g["lr"] for g in build_optimizer(GPT(cfg.model), cfg, "cpu").param_groups] == [2e-4, 2e-4]
    muon = load_config(None, TINY + ["optim.name=muon", "optim.adamw.lr=1e-3", "optim.muon.lr=0.02"])
    assert spec_for(muon).peak_lr(muon) == 1e-3  # group 0, AdamW's part; Muon's groups scale it by 20
    t = load_config(None, ["train.max_steps=10", "train.warmup_steps=0", "train.min_lr_ratio=0.25"]).train
    assert lr_at(0, t, 2.0) == 2.0 and lr_at(10, t, 2.0) == pytest.approx(0.5) and lr_at(10, t, 8.0) == pytest.approx(2.0)


def test_every_registered_optimizer_is_a_choice_of_optim_name():
    field = next(f for f in dataclasses.fields(type(load_config(None).optim)) if f.name == "name")
    assert tuple(REGISTRY) == field.metadata["choices"]
    assert all(spec_for(load_config(None, [f"optim.name={n}"])) is REGISTRY[n] for n in REGISTRY)


# ---- each optimizer's declared state ------------------------------------------------------
def _stepped(name: str):
    from distlm.model.gpt import GPT
    from distlm.model.loss import lm_loss
    # a value-embedding table too: another table the optimizer keeps state for
    cfg = load_config(None, TINY + [f"optim.name={name}", "optim.muon.ns_dtype=fp32", "model.value_embeds=1"])
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
