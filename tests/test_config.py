"""The config tree: presets load and build; bad keys and values are named."""
import pytest
import torch

from distlm.config import ConfigError, list_presets, load_config, config_from_dict
from distlm.model.gpt import GPT


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_loads_and_builds(name):
    cfg = load_config(name, ["model.vocab_size=50257"])
    with torch.device("meta"):
        model = GPT(cfg.model)
    assert model.num_params() > 0
    assert config_from_dict(cfg.to_dict()) == cfg  # the saved config rebuilds the same tree


def test_overrides_and_model_preset_swap():
    cfg = load_config("tiny", ["model=gpt2-124m", "train.max_steps=7", "optim.adamw.lr=1e-3", "model.bias=false"])
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.bias) == (12, 768, False)
    assert cfg.train.max_steps == 7 and cfg.optim.adamw.lr == 1e-3
    assert cfg.train.global_batch_size == 16  # from tiny, untouched by the model swap


@pytest.mark.parametrize("overrides,needle", [
    (["train.max_stpes=3"], "did you mean 'max_steps'"),
    (["train.lr=3e-4"], "unknown config key 'train.lr' (did you mean 'optim.adamw.lr'?)"),
    (["optim.adamw.lrr=3e-4"], "unknown config key 'optim.adamw.lrr' (did you mean 'lr'?)"),
    (["optim.adamw=3"], "optim.adamw must be a mapping of its fields"),
    (["trian.max_steps=3"], "did you mean 'train'"),
    (["model=gpt2-124"], "did you mean 'gpt2-124m'"),
    (["model.position=rotary"], "model.position: 'rotary' is not one of"),
    (["train.max_steps=abc"], "train.max_steps: expected an integer, got 'abc'"),
    (["model.n_head=5"], "not divisible by model.n_head=5"),
    (["train.global_batch_size=30", "train.micro_batch_size=16"], "train.global_batch_size=30 must be a multiple"),
    (["max_steps"], "must look like key=value"),
    (["parallel.grad_reduce_dtype=fp16"], "parallel.grad_reduce_dtype: 'fp16' is not one of"),
    (["parallel.grad_reduce_dtype=bf16", "parallel.engine=horovod"], "Horovod compresses with parallel.fp16_compression"),
])
def test_bad_config_is_named(overrides, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config("tiny", overrides)
    assert needle in str(e.value)


@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("name", list_presets())
def test_no_preset_pins_a_micro_batch_that_breaks_on_2_or_4_processes(name, nproc):
    from distlm.launch.local import check_before_launch
    cfg = load_config(name, [f"parallel.dp_replicate={nproc}", "data.source=synthetic", "train.memory_check=false"])
    check_before_launch(cfg, nproc)


@pytest.mark.parametrize("name", ["../escape", "a/b", "/abs", "..", ".", " "])
def test_a_run_name_is_one_folder_under_log_root(name):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [f"log.name={name}"])
    assert str(e.value).startswith(f"log.name={name!r}: a run name is one folder name under log.root")
    assert load_config("tiny", ["log.name=first.try-2"]).log.name == "first.try-2"


def test_unknown_preset_suggests():
    with pytest.raises(ConfigError, match="did you mean 'tiny'"):
        load_config("tinyy")


def test_whole_model_compile_refused_with_sharded_layouts():
    with pytest.raises(ConfigError, match="train.compile_scope=model"):
        load_config(None, ["train.compile=true", "train.compile_scope=model", "parallel.dp_shard=2"])
    assert load_config(None, ["train.compile=true", "train.compile_scope=model"]).train.compile_scope == "model"


# Fields taken out of the tree: each is what a run derives, or a constant, with the reason beside
# it in the code; the old key is unknown.
@pytest.mark.parametrize("key", ["train.stop_check_every=2", "train.eval_compile=false", "train.min_local_batch=16",
                                 "train.schedule_clock=time", "log.peak_tflops=989"])
def test_an_internal_knob_is_not_a_field(key):
    with pytest.raises(ConfigError, match=f"unknown config key '{key.split('=')[0]}'"):
        load_config(None, [key])


def test_a_preset_data_parallel_row_sets_its_values_unless_the_command_line_gives_one():
    notes = []
    cfg = load_config("speedrun-124m", ["parallel.dp_replicate=4"], notes=notes)
    t = cfg.train
    assert (t.global_batch_size, t.max_steps, t.warmup_steps, t.eval_every) == (64, 300, 10, 100)
    row = "train.global_batch_size=64, train.max_steps=300, train.warmup_steps=10, train.eval_every=100"
    assert notes == [f"speedrun-124m on 4 data-parallel ranks: {row} (its data_parallel table)"]
    # a row is one recipe: a command line that gives part of it writes its own, and is told so
    notes = []
    given = load_config("speedrun-124m", ["parallel.dp_shard=4", "train.max_steps=1000"], notes=notes).train
    assert (given.global_batch_size, given.max_steps, given.warmup_steps) == (32, 1000, 20)
    assert notes == [f"speedrun-124m on 4 data-parallel ranks: its data_parallel row ({row}) left out: "
                     f"train.max_steps given on the command line"]
    notes = []
    assert load_config("speedrun-124m", ["parallel.dp_replicate=2"], notes=notes).train.global_batch_size == 32
    assert notes == []  # no row for 2: the preset as written


@pytest.mark.parametrize("table,needle", [
    ("data_parallel: 3", "data_parallel must map a data-parallel degree to sections"),
    ("data_parallel: {0: {train: {max_steps: 1}}}", "0 is not a data-parallel degree"),
    ("data_parallel: {4: {train: {max_stpes: 1}}}", "unknown config key 'train.max_stpes'"),
    ("data_parallel: {4: {train: 1}}", "data_parallel.4 must map sections to their fields"),
])
def test_a_bad_data_parallel_table_is_named(tmp_path, table, needle):
    path = tmp_path / "p.yaml"
    path.write_text(f"train:\n  max_steps: 5\n{table}\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert needle in str(e.value) and str(path) in str(e.value)
