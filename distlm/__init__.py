"""distlm: train GPT-style language models from scratch on torch.distributed."""
__version__ = "0.1.0"
