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

ROOT = Path(__file__).resolve().parents[2]
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
