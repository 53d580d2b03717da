"""What the train path imports before the first step: nothing a run does not need by then.

Plotting (matplotlib), exporting (transformers, safetensors), tokenizing (tiktoken, tokenizers),
reading parquet (pyarrow, pandas) and logging to TensorBoard or W&B are imported where they are
used. The compiler (torch._dynamo, torch._inductor, triton) is imported by the set-up itself, on a
thread of its own on a GPU: the train entry importing it would put its seconds back before the
set-up, where nothing overlaps them. A fresh interpreter each, so what other tests imported
does not count.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LATER = ["matplotlib", "transformers", "safetensors", "tiktoken", "tokenizers", "pyarrow", "pandas", "scipy",
         "huggingface_hub", "datasets", "wandb", "tensorboard", "torch.utils.tensorboard"]
COMPILER = ["torch._dynamo", "torch._inductor", "triton"]


def _python(code: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_train_entry_imports_neither_the_later_modules_nor_the_compiler():
    loaded = _python("import json, sys\nimport distlm.cli, distlm.cli.verbs, distlm.train.trainer\n"
                     f"print(json.dumps([m for m in {LATER + COMPILER!r} if m in sys.modules]))")
    assert loaded == [], f"imported by the train entry: {loaded}"


def test_an_eager_run_reaches_its_first_step_without_them(tmp_path):
    """Everything up to the first step of an eager CPU run (set-up, data, optimizer, logger
    without TensorBoard): none of the later modules. (torch._dynamo is imported by torch
    itself there: torch.optim.Optimizer's constructor is wrapped to disable dynamo, and that
    wrapper imports it on first use.)"""
    code = f"""
import json, sys
from distlm.train.trainer import Trainer
from distlm.cli import main
seen = []
step = Trainer.train_step
def first(self, *a, **k):
    if not seen:
        seen.append([m for m in {LATER!r} if m in sys.modules])
    return step(self, *a, **k)
Trainer.train_step = first
main(["train", "--config", "tiny", "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_ff=64",
      "model.block_size=16", "model.vocab_size=64", "data.source=synthetic", "train.device=cpu",
      "train.compile=false", "train.global_batch_size=2", "train.micro_batch_size=2", "train.max_steps=1",
      "train.eval_every=0", "log.progress=false", "log.tensorboard=false", "log.root={tmp_path}", "log.name=a"])
print(json.dumps(seen[0]))
"""
    loaded = _python(code)
    assert loaded == [], f"imported before the first step: {loaded}"


def test_a_model_built_on_meta_does_not_import_the_compiler():
    """``on_meta()`` (distlm/model/meta.py) builds the same meta parameters as ``torch.device("meta")``
    without running the constructors' random fills, whose meta forms import torch._dynamo on first
    use: the seconds `distlm eval`, `generate` and `plan` would pay for a compiler they never use."""
    code = """
import json, sys, torch
from distlm.config import load_config
from distlm.model.gpt import GPT, count_params
from distlm.model.meta import on_meta
cfg = load_config("speedrun-124m", ["model.vocab_size=50257"]).model
with on_meta():
    quiet = GPT(cfg)
counted = count_params(cfg, non_embedding=False)
after_on_meta = "torch._dynamo" in sys.modules
with torch.device("meta"):
    plain = GPT(cfg)
after_plain = "torch._dynamo" in sys.modules
same = {k: (tuple(v.shape), str(v.dtype)) for k, v in quiet.state_dict().items()} == \\
       {k: (tuple(v.shape), str(v.dtype)) for k, v in plain.state_dict().items()}
print(json.dumps([after_on_meta, after_plain, same, all(p.is_meta for p in quiet.parameters()),
                  counted == plain.num_params(non_embedding=False)]))
"""
    assert _python(code) == [False, True, True, True, True]
