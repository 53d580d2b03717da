"""Text samples while a language model trains (log.samples, log.sample_prompt).

At each evaluation and at the end, the main rank continues log.sample_prompt log.samples
times, sample i with seed i, so the samples of two evaluations differ only by what the
model learned in between. The same sample comes back from a checkpoint of that step with

    distlm generate --checkpoint RUN --prompt PROMPT --seed i --max-new-tokens 48 --temperature 0.8 --top-k 50

Whether a run can sample at all (it needs the whole model in one process) is the parallel
plan's answer (why_no_samples, distlm/parallel/applied.py); this module draws the samples and
lays them out.
"""
from __future__ import annotations

from pathlib import Path

import torch

from distlm.io import atomic_append
from distlm.model.generate import SamplingConfig, generate_text

MAX_NEW_TOKENS = 48
TEMPERATURE = 0.8
TOP_K = 50


def describe(n: int) -> str:
    """How the samples are drawn, for their header."""
    seeds = "seed 0" if n == 1 else f"seeds 0-{n - 1}"
    return f"{MAX_NEW_TOKENS} new tokens, temperature {TEMPERATURE}, top-k {TOP_K}, {seeds}"


@torch.no_grad()
def sample_texts(gpt: torch.nn.Module, tokenizer, prompt: str, n: int) -> list[str]:
    """``n`` continuations of ``prompt``, sample i drawn with seed i (its own generator: the
    training RNG is not touched, so a run with samples trains exactly as one without).
    Compiled blocks run eagerly here: the KV cache's varying shapes and positions would
    each compile a new graph. The caller puts the model back in training mode."""
    out = []
    with torch.compiler.set_stance("force_eager"):
        for i in range(n):
            sc = SamplingConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE, top_k=TOP_K, seed=i)
            out.append(generate_text(gpt, tokenizer, prompt, sc)[0])
    return out


def append_samples(path: Path, step: int, header: str, prompts: list[str], texts: list[str]) -> None:
    """Append one block to a run's samples.txt, in the layout the training logger writes
    (RunLogger.samples): a ``=== step N === header`` line, then each sample under its own
    ``--- sample i (seed i) ---`` line, prompt and continuation as generated. Sample i has
    prompt i (the demo's three prompts) or, given one prompt, all share it. The file is
    copied with the block into a new one that replaces it: nothing is written through a link."""
    if len(prompts) == 1:
        prompts = prompts * len(texts)
    block = [f"=== step {step} === {header}\n"]
    block += [f"--- sample {i} (seed {i}) ---\n{p}{t}\n" for i, (p, t) in enumerate(zip(prompts, texts))]
    atomic_append(path, "".join(block) + "\n")


def console_block(step: int, prompt: str, texts: list[str]) -> str:
    """The samples for the console: a header, then one line per sample (line breaks shown
    as spaces; samples.txt and TensorBoard keep them)."""
    lines = [f"samples at step {step} ({describe(len(texts))}):"]
    lines += [f"  >> {' '.join((prompt + t).split())}" for t in texts]
    return "\n".join(lines)
