"""Prepare a few texts, train a tiny GPT for a few steps with the Trainer, sample from it.

    python examples/02_train_and_generate.py [OUT_DIR]
"""
import sys
import tempfile
from pathlib import Path

from distlm import SamplingConfig, Trainer, generate_text, load_config, prepare
from distlm.data.tokenizer import load_tokenizer

out = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="distlm-example-"))
texts = out / "texts"
texts.mkdir(parents=True, exist_ok=True)
for i, line in enumerate(["The cat sat on the mat. ", "A dog ran in the park. ", "The sun rose over the hills. "]):
    (texts / f"{i}.txt").write_text(line * 50)
prepare([str(texts)], out / "data", tokenizer="bpe:300", val_fraction=0.34, progress=False)

cfg = load_config("tiny", [f"data.dir={out / 'data'}", f"log.root={out / 'runs'}", "log.name=example",
                           "model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.d_ff=128",
                           "model.block_size=32", "train.max_steps=30", "train.global_batch_size=8",
                           "train.micro_batch_size=8", "train.eval_every=15", "log.every=10", "log.progress=false"])
trainer = Trainer(cfg)
summary = trainer.train()
print(f"trained to step {summary['step']}: val loss {summary['val_loss']:.3f}")

tok = load_tokenizer(trainer.manifest["tokenizer"]["name"], out / "data")
sample = generate_text(trainer.module, tok, "The cat", SamplingConfig(max_new_tokens=20, temperature=0.5, seed=0))[0]
print("The cat" + sample)
