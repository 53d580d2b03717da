"""How many bytes a model holds, and how many this host can still give: arithmetic on a
ModelConfig, below the planner (which adds gradients, optimizer state and activations per
layout) so that loading a checkpoint can refuse one that cannot fit before allocating it."""
from __future__ import annotations

from distlm.config import ConfigError, ModelConfig

GIB = 2 ** 30   # memory, as torch.cuda.max_memory_allocated / 2**30 reports it (bench)


def block_params(m: ModelConfig) -> tuple[int, int]:
    """(parameters split by TP, parameters replicated under TP) of one block."""
    d, ff, b = m.d_model, m.d_ff, int(m.bias)
    n_in = 3 if m.mlp == "swiglu" else 2
    split = 4 * d * d + 3 * d * b + n_in * d * ff + (n_in - 1) * ff * b  # q/k/v/MLP-in biases split too
    replicated = 2 * d * b + 2 * d * (1 + (b if m.norm == "layernorm" else 0))  # row-parallel biases, norms
    return split, replicated


def end_params(m: ModelConfig) -> tuple[int, int, int]:
    """(embedding matrix, head matrix if untied, position table + final norm)."""
    V, d = m.padded_vocab_size, m.d_model
    pos = m.block_size * d if m.position == "learned" else 0
    return V * d, 0 if m.tie_embeddings else V * d, pos + d * (2 if m.norm == "layernorm" and m.bias else 1)


def model_parameters(m: ModelConfig) -> int:
    """Every parameter of the whole model (a tied head counted once), as GPT(m) holds them,
    up to the few learned scalars of U-net skips and value embeddings."""
    split, replicated = block_params(m)
    emb, head, rest = end_params(m)
    return m.n_layer * (split + replicated) + emb + head + rest + m.value_embeds * m.padded_vocab_size * m.d_model


def position_table_bytes(m: ModelConfig) -> int:
    """The fixed position tables every copy of the model holds besides its parameters (fp32
    buffers, not in ``estimate``'s count): sinusoidal (T x d), or RoPE's cos and sin."""
    if m.position == "sinusoidal":
        return 4 * m.block_size * m.d_model
    if m.position == "rope":
        return 2 * 4 * m.block_size * (m.d_model // m.n_head)
    return 0


def inference_bytes(m: ModelConfig, batch: int = 0, kept_tokens: int = 0) -> int:
    """What a model loaded for eval, generate or export holds (fp32 weights and position
    tables), plus, for ``batch`` sequences sampled with a KV cache: the cache (keys and values
    of every block for block_size positions), the prefill's logits (every position of the
    context, the whole vocabulary) and the ``kept_tokens`` ids per sequence."""
    weights = 4 * model_parameters(m) + position_table_bytes(m)
    if not batch:
        return weights
    cache = 2 * m.n_layer * m.block_size * m.d_model * 4
    logits = m.block_size * m.padded_vocab_size * 4
    return weights + batch * (cache + logits + 8 * kept_tokens)


def check_fits(need_bytes: float, have_bytes: float, what: str, where: str, advice: str,
               error: type[ConfigError] = ConfigError) -> None:
    """A one-line ConfigError when ``what`` needs more than ``where`` has: said before
    anything is allocated, so a model that cannot fit never starts to. The estimate is the
    planner's (within 25% of measured peaks, tests/test_planner.py), so only a model past
    everything the device has is refused, not one at the edge."""
    if need_bytes > have_bytes:
        raise error(f"{what} needs about {need_bytes / GIB:,.1f} GiB but {where} has "
                    f"{have_bytes / GIB:,.1f} GiB free; {advice}")
