"""Build a model from a preset, count its parameters and FLOPs, run a forward pass.

    python examples/01_model_from_preset.py
"""
import torch

from distlm import GPT, load_config
from distlm.model import flops_per_token, lm_loss

cfg = load_config("gpt2-124m-1024", ["model.vocab_size=50257"])
with torch.device("meta"):  # no memory: shapes only
    big = GPT(cfg.model)
print(f"gpt2-124m-1024: {big.num_params(non_embedding=False):,} parameters "
      f"(GPT-2 has 124,439,808), {flops_per_token(cfg.model, big.num_params()) / 1e9:.3f} GFLOP/token")

small = load_config("tiny", ["model.vocab_size=1000", "model.position=rope", "model.norm=rmsnorm",
                             "model.mlp=swiglu"]).model
model = GPT(small)
x = torch.randint(0, 1000, (2, small.block_size))
y = torch.randint(0, 1000, (2, small.block_size))
logits = model(x)
print(f"tiny llama-style: logits {tuple(logits.shape)} (vocab padded to {small.padded_vocab_size}), "
      f"loss at init {lm_loss(logits, y).item():.3f} (about ln {small.padded_vocab_size} = 6.93)")
