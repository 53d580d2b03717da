"""The parallel layout (distlm/layout/) and the plan parallelize() returns (distlm/parallel/applied.py):
the named questions each layout answers, the registry's consistency, that an axis is added by
registration alone, and the per-batch hook the step runs every micro-batch through."""
import dataclasses

import pytest
import torch

from distlm.config import ParallelConfig, load_config
from distlm.layout import AXES, MESH_ORDER, Layout
from distlm.parallel import ParallelDims, parallelize
from distlm.parallel.applied import Batch

PARTIAL_SHARDS = "under FSDP2 or tensor parallelism each rank holds shards of the weights, not the whole model"
PARTIAL_STAGES = "under pipeline parallelism each rank holds a stage, not the whole model"
PARTIAL_CONTEXT = "under context parallelism each rank holds FSDP2 shards of the weights, not the whole model"
PARTIAL_EXPERTS = "under expert parallelism each rank holds some of the experts, not the whole model"


# ---- the named questions -----------------------------------------------------------------
@pytest.mark.parametrize("lay, name, dp, forward, shards, own_loss, logits, partial", [
    (Layout(), "single", 1, False, False, True, False, None),
    (Layout(dp_replicate=4), "ddp4", 4, False, False, True, False, None),
    (Layout(dp_shard=4), "fsdp4", 4, True, True, True, False, PARTIAL_SHARDS),
    (Layout(dp_replicate=2, dp_shard=2), "ddp2xfsdp2", 4, True, True, True, False, PARTIAL_SHARDS),
    (Layout(tp=2), "tp2", 1, True, False, False, True, PARTIAL_SHARDS),
    (Layout(pp=2), "pp2", 1, True, False, False, False, PARTIAL_STAGES),
    # the outermost axis answers first: a stage, although its blocks are sharded too
    (Layout(dp_shard=2, tp=2, pp=2), "fsdp2xtp2xpp2", 2, True, True, False, True, PARTIAL_STAGES),
    # the cp ranks read the same rows (dp 1) and shard the parameters (FSDP2 over them)
    (Layout(cp=2), "cp2", 1, True, True, True, False, PARTIAL_CONTEXT),
    (Layout(dp_shard=2, tp=2, cp=2), "fsdp2xtp2xcp2", 2, True, True, False, True, PARTIAL_SHARDS),
    # the ep ranks read different rows and run whole blocks, each with some of the experts
    (Layout(ep=2), "ep2", 2, False, False, True, False, PARTIAL_EXPERTS),
    (Layout(dp_shard=2, ep=2), "fsdp2xep2", 4, True, True, True, False, PARTIAL_SHARDS),
])
def test_each_layout_answers_by_name(lay, name, dp, forward, shards, own_loss, logits, partial):
    assert lay.name == name and lay.dp_size == dp
    assert lay.splits_forward is forward and lay.shards_parameters is shards
    assert lay.model_computes_loss is own_loss and lay.distributes_logits is logits
    assert lay.why_not_whole_model == partial and lay.holds_whole_model is (partial is None)
    assert lay.splits_sequence is (lay.cp > 1)  # the one axis that cuts the rows


def test_the_meshes_each_role_uses():
    lay = Layout(dp_replicate=2, dp_shard=2, tp=2, pp=2)
    # the roles name their mesh dimensions whatever the degrees: cp's (size 1 here) among them
    assert lay.data_axes == ("dp_replicate", "dp_shard", "ep")
    assert lay.loss_axes == ("dp_replicate", "dp_shard", "ep", "cp")
    # ep's role follows the data shards: with FSDP2 it is sharded over with them, with DDP replicated
    assert (lay.replicate_axes, lay.shard_axes) == (("dp_replicate",), ("dp_shard", "ep", "cp"))
    assert Layout(dp_replicate=2, ep=2).replicate_axes == ("dp_replicate", "ep")
    assert lay.size == 16
    assert lay.loss_size == lay.dp_size == 4 and lay.shard_degree == 2
    assert lay.overrides() == "parallel.dp_replicate=2 parallel.dp_shard=2 parallel.tp=2 parallel.pp=2"


def test_sequence_divisor_and_micro_batches():
    sp = load_config(None, ["model.vocab_size=256", "parallel.tp=2"])
    no_sp = load_config(None, ["model.vocab_size=256", "parallel.tp=2", "parallel.sequence_parallel=false"])
    assert Layout(tp=2).sequence_divisor(sp) == 2 and Layout(tp=2).sequence_divisor(no_sp) == 1
    assert Layout().sequence_divisor(sp) == 1
    cfg = load_config(None, ["model.vocab_size=256", "parallel.pp=2", "train.global_batch_size=16"])
    sizes = [16, 8, 4, 2, 1]
    assert Layout(pp=2).micro_batch_sizes(sizes, 16, cfg) == [8, 4, 2, 1]  # a whole number per stage
    assert Layout().micro_batch_sizes(sizes, 16, cfg) == sizes
    fixed = load_config(None, ["model.vocab_size=256", "parallel.pp=2", "train.global_batch_size=16",
                               "parallel.pp_microbatches=4"])
    assert Layout(pp=2).micro_batch_sizes(sizes, 16, fixed) == [4]  # what the schedule cuts


# ---- the registry -----------------------------------------------------------------------------
# A test-local axis, in its own file as a real one is: a ring of ranks that read the same rows,
# average the loss over them and send a byte per token, between cp and tp in the mesh.
RING_AXIS = """
from distlm.layout.axis import Axis


class Ring(Axis):
    name, label = "rg", "ring"
    help = "ring degree: a test-local axis"
    mesh_rank = 55
    collective = "ring pass"
    averages_loss = True
    critical_path = True

    def bytes_sent(self, w, degree):
        return None if degree == 1 else float(w.micro_batch * w.block_size)
"""

# What a copy of distlm with that file and its registry line answers.
RING_CHECKS = """
import dataclasses, json
from distlm.config import ParallelConfig, load_config
from distlm.layout import AXES, MESH_ORDER, Layout
from distlm.planner import COLLECTIVES, Candidate, estimate, layouts
cfg = load_config(None, ["model.vocab_size=256", "parallel.rg=2", "parallel.tp=2"])
lay = Layout.of(cfg.parallel)
est = estimate(cfg.model, Candidate(rg=2), 8, 4, 80)
print(json.dumps(dict(
    registry=[a.name for a in AXES], layout=[f.name for f in dataclasses.fields(Layout)],
    parallel=[f.name for f in dataclasses.fields(ParallelConfig)][:len(AXES)], mesh=list(MESH_ORDER),
    name=lay.name, overrides=lay.overrides(), loss_axes=list(lay.loss_axes), size=lay.size,
    help=next(f.metadata["help"] for f in dataclasses.fields(ParallelConfig) if f.name == "rg"),
    sent=est.sent_gb.get("rg"), ring_ms=est.time_ms.get("rg_comm"), collective=COLLECTIVES.get("rg"),
    candidates=sorted({c.name for c in layouts(4, cfg.model)}))))
"""


def test_an_axis_joins_by_registration_alone(tmp_path):
    """A copy of distlm with one more axis: its own file in distlm/layout/ and its line in the
    registry, nothing else. The degree is then a field of Layout and of the config's parallel
    section (parsed, documented), a dimension of the mesh in its place, part of the layouts'
    names and overrides, a role in the loss's mean, and its costs are the planner's."""
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    pkg = Path(__file__).resolve().parents[2] / "distlm"
    copy = tmp_path / "distlm"
    shutil.copytree(pkg, copy, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    (copy / "layout" / "ring.py").write_text(RING_AXIS)
    registry = copy / "layout" / "__init__.py"
    line = "AXES: tuple[Axis, ...] = (DataReplicate(), DataShard(), Tensor(), Pipeline(), Context(), Expert())"
    text = registry.read_text()
    assert text.count(line) == 1, "the registry line moved: update this test"
    registry.write_text(text.replace(line, "from distlm.layout.ring import Ring\n" + line[:-1] + ", Ring())"))
    run = subprocess.run([sys.executable, "-c", RING_CHECKS], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    names = [a.name for a in AXES] + ["rg"]
    assert got["registry"] == got["layout"] == got["parallel"] == names
    assert got["mesh"] == ["pp", "dp_replicate", "dp_shard", "ep", "cp", "rg", "tp"]
    assert got["name"] == "tp2xring2" and got["overrides"] == "parallel.tp=2 parallel.rg=2" and got["size"] == 4
    assert got["loss_axes"][-1] == "rg" and got["help"] == "ring degree: a test-local axis"
    assert got["sent"] == 4 * 128 / 1e9 and got["ring_ms"] > 0 and got["collective"] == "ring pass (rg)"
    assert {"fsdp2xring2", "tp2xring2", "ring4+ac"} <= set(got["candidates"])  # the planner weighs it too


def test_what_the_registry_derives():
    """The degrees' fields and the mesh come from AXES, in its order and by mesh_rank."""
    names = [a.name for a in AXES]
    assert [f.name for f in dataclasses.fields(Layout)] == names
    assert [f.name for f in dataclasses.fields(ParallelConfig)][:len(names)] == names
    assert MESH_ORDER == tuple(a.name for a in sorted(AXES, key=lambda a: a.mesh_rank))
    assert MESH_ORDER[0] == "pp" and MESH_ORDER[-1] == "tp"  # TP's collectives on consecutive ranks
    assert all(a.label and a.help and a.collective and a.gradients in (None, "replicate", "shard") for a in AXES)
    assert Layout.of(ParallelConfig(tp=2, pp=3)) == Layout(tp=2, pp=3) == Layout(1, 1, 2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ParallelConfig().tp = 2


def test_parallel_dims_is_the_layout_with_a_place_in_it():
    dims = ParallelDims(2, 1, 1, 1, world_size=2, rank=1)
    assert isinstance(dims, Layout) and dims.degrees() == Layout(dp_replicate=2).degrees()
    assert not dims.is_main and dims.dp_rank == 0  # no mesh: one data rank
    with pytest.raises(Exception, match=r"dp_replicate=1 x dp_shard=1 x tp=1 x pp=1 x cp=1 x ep=1 = 1, but the world size is 2; "
                                        r"add parallel.dp_replicate=2 \(DDP\)"):
        ParallelDims(world_size=2)


def test_the_context_axis_answers_by_its_attributes():
    """The context axis (distlm/layout/context.py) says what its ranks do: every named
    question, the roles' meshes, the name and the row divisor follow from that."""
    cfg = load_config(None, ["model.vocab_size=256"])
    lay = Layout(dp_shard=2, cp=2, tp=2)
    assert lay.name == "fsdp2xtp2xcp2" and lay.size == 8
    assert lay.splits_sequence
    assert lay.data_axes == ("dp_replicate", "dp_shard", "ep") and lay.dp_size == 2   # cp ranks read the same rows
    assert lay.loss_axes == ("dp_replicate", "dp_shard", "ep", "cp") and lay.loss_size == 4
    assert lay.shard_axes == ("dp_shard", "ep", "cp") and lay.shard_degree == 4
    assert lay.sequence_divisor(cfg) == 2 * 2 * 2  # 2 cp chunks per rank, then TP's sequence parallelism
    assert Layout(cp=2).shards_parameters and not Layout(cp=2).holds_whole_model


# ---- the plan and its per-batch hook ------------------------------------------------------------
def one_process_plan():
    cfg = load_config(None, ["model.vocab_size=64", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
                             "model.d_ff=64", "model.block_size=8"])
    from distlm.model.gpt import GPT
    with torch.device("meta"):
        gpt = GPT(cfg.model)

    def materialize(m):
        m.to_empty(device=torch.device("cpu"))
        m.init_weights(cfg.train.seed)

    return cfg, parallelize(gpt, ParallelDims(), cfg, materialize)


def test_one_process_plan_answers():
    cfg, plan = one_process_plan()
    assert plan[0] is plan.model and plan.module is plan.model  # nothing wrapped
    assert plan.batch_hooks == () and not plan.loss_parallel
    assert plan.model_computes_loss and plan.evaluates_through_training_graph and plan.why_no_samples is None
    x, y = torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
    b = plan.shard_batch(x, y)
    assert b.inputs is x and b.targets is y and b.forward == {}  # identity: no axis cuts the rows
    with plan.compute():
        assert not torch.is_autocast_enabled("cpu")  # fp32 on CPU


class RecordingTask:
    """The step's view of a task: a loss that records what it was called with."""

    def __init__(self):
        self.calls = []

    def loss_fn(self, cfg, plan):
        def loss(model, x, y, **forward):
            self.calls.append((x.clone(), y.clone(), dict(forward)))
            return model(x, targets=y)
        return loss


def test_the_step_runs_every_micro_batch_through_the_hooks():
    """What a sequence axis will do: keep a part of each row and hand the model its
    positions. The step must pass both to the loss, in training and in evaluation."""
    cfg, plan = one_process_plan()

    def first_half(b: Batch) -> Batch:
        T = b.inputs.shape[1] // 2
        return Batch(b.inputs[:, :T], b.targets[:, :T], {**b.forward, "start_pos": 0})

    def tag(b: Batch) -> Batch:
        return b._replace(forward={**b.forward, "seen": True})

    plan = plan._replace(batch_hooks=(first_half, tag))
    task = RecordingTask()
    plan.step.bind(task, cfg, plan, accum_steps=2)
    x = torch.arange(16).view(2, 8) % 64
    plan.step.forward_backward([(x, x), (x + 1, x + 1)], plan.compute)
    plan.step.eval_losses([(x, x, 1.0)], plan.compute)
    assert len(task.calls) == 3
    for (got_x, got_y, forward), want in zip(task.calls, (x, x + 1, x)):
        assert torch.equal(got_x, want[:, :4]) and torch.equal(got_y, want[:, :4])
        assert forward == {"start_pos": 0, "seen": True}  # in hook order
