"""distlm: train GPT-style language models from scratch on torch.distributed.

The public API (see docs/API.md):

    from distlm import load_config, Trainer, GPT, load_model, generate_text, SamplingConfig
"""
__version__ = "0.1.0"

from distlm.config import Config, ConfigError, load_config  # noqa: E402
from distlm.model.generate import SamplingConfig, generate_text  # noqa: E402
from distlm.model.gpt import GPT  # noqa: E402


def __getattr__(name):
    # The Trainer and checkpoint loading pull in torch.distributed, tensorboard and the data
    # stack; import them on first use so `import distlm` for a model alone stays light.
    if name == "Trainer":
        from distlm.train.trainer import Trainer
        return Trainer
    if name == "load_model":
        from distlm.model.load import load_model
        return load_model
    if name == "prepare":
        from distlm.data.prepare import prepare
        return prepare
    raise AttributeError(name)


__all__ = ["Config", "ConfigError", "GPT", "SamplingConfig", "Trainer", "generate_text", "load_config",
           "load_model", "prepare"]
