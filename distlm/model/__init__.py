from distlm.model.gpt import GPT, flops_per_token
from distlm.model.loss import lm_loss

__all__ = ["GPT", "flops_per_token", "lm_loss"]
