"""Load a trained run (or one checkpoint folder) and generate, without the CLI.

    python examples/03_load_checkpoint.py runs/demo-YYYYmmdd-HHMMSS "Once upon a time"
"""
import sys

from distlm import SamplingConfig, generate_text, load_model
from distlm.model.load import load_run_tokenizer

run, prompt = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "Once upon a time"
model, cfg, folder = load_model(run, "cpu")
tok = load_run_tokenizer(folder, cfg)
for i, text in enumerate(generate_text(model, tok, prompt, SamplingConfig(max_new_tokens=40, seed=0), 2)):
    print(f"[{i}] {prompt}{text}")
