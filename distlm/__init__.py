"""distlm: train GPT-style language models from scratch on torch.distributed.

The public API (see docs/API.md):

    from distlm import load_config, Trainer, GPT, load_model, generate_text, SamplingConfig
"""
__version__ = "0.1.0"

# Each public name is imported on first use, so that `import distlm` (and so `distlm --help`,
# an argument error or `distlm env`) does not pay for torch, tensorboard and the data stack.
_PUBLIC = {
    "Config": "distlm.config", "ConfigError": "distlm.config", "load_config": "distlm.config",
    "SamplingConfig": "distlm.model.generate", "generate_text": "distlm.model.generate",
    "GPT": "distlm.model.gpt", "Trainer": "distlm.train.trainer", "load_model": "distlm.model.load",
    "prepare": "distlm.corpus.prepare",
}


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'distlm' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__():
    return sorted([*globals(), *_PUBLIC])


__all__ = sorted(_PUBLIC)
