"""`distlm generate`: one prompt (streamed), a file of prompts to JSONL, or a prompt loop."""
from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Annotated, Literal, Optional

from distlm.config import ConfigError

# Limits past any real use, so that a typo is refused before anything is allocated: the
# samples of one prompt are one batch (its KV cache and logits grow with it; 10^8 ran for
# 78 s into a MemoryError), and a seed must fit the int64 a torch.Generator takes, seed + i
# for the i-th prompt of --prompts-file included. What fits under them is checked against
# the device's memory when the checkpoint is loaded (distlm/model/load.py).
MAX_NUM_SAMPLES = 1 << 12
MAX_NEW_TOKENS = 1 << 20
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 63) - 1


def generate(
    *,
    checkpoint: str,
    prompt: Annotated[Optional[str], "text to continue"] = None,
    max_new_tokens: Annotated[int, "tokens sampled per completion"] = 200,
    temperature: Annotated[float, "0 = greedy; higher = more varied"] = 0.8,
    top_k: Annotated[int, "sample among the k most likely tokens; 0 = off"] = 200,
    top_p: Annotated[Optional[float], "sample among the most likely tokens holding this much probability, "
                                      "in (0, 1]"] = None,
    seed: Annotated[Optional[int], "sampling seed; with --prompts-file, prompt i uses seed + i"] = None,
    num_samples: Annotated[int, "completions per prompt"] = 1,
    prompts_file: Annotated[Optional[str], "one prompt per line; needs --out"] = None,
    out: Annotated[Optional[str], "the JSONL file --prompts-file writes (one line per prompt)"] = None,
    interactive: Annotated[bool, "a prompt loop (an empty line or Ctrl-D quits)"] = False,
    no_stream: Annotated[bool, "print each sample when it is complete"] = False,
    device: Literal["auto", "cpu", "cuda"] = "auto",
) -> int:
    """Sample text from a checkpoint (KV cache).

    Give one of --prompt TEXT, --prompts-file FILE --out F.jsonl, or --interactive. A prompt
    longer than the model's context is cut to its last block_size tokens, with a note on
    stderr.
    """
    from distlm.model.generate import SamplingConfig
    # Every argument is checked before the checkpoint is loaded: a typo costs no waiting.
    _check_limits(num_samples, max_new_tokens, seed)
    sc = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k or None, top_p=top_p,
                        seed=seed)
    modes = [flag for flag, on in (("--prompt", prompt is not None), ("--prompts-file", prompts_file is not None),
                                   ("--interactive", interactive)) if on]
    if len(modes) != 1:
        raise ConfigError("give one of --prompt TEXT, --prompts-file FILE --out F.jsonl, or --interactive"
                          + (f" (got {' and '.join(modes)})" if modes else ""))
    if prompt is not None and not _is_utf8(prompt):
        raise ConfigError("--prompt: not valid UTF-8 text (the shell passed bytes that decode to no characters)")
    prompts = _read_prompts(prompts_file, out) if prompts_file is not None else None
    if prompts is not None and seed is not None and seed + len(prompts) - 1 > MAX_SEED:
        raise ConfigError(f"--seed {seed}: prompt i of --prompts-file samples with seed + i, and the last "
                          f"({seed + len(prompts) - 1}) is above {MAX_SEED}")

    from distlm.cli.verbs import check_device_flag
    from distlm.model.load import load_run_tokenizer, load_trained
    from distlm.device import resolve_device
    check_device_flag(device)
    loaded = load_trained(checkpoint, resolve_device(device), task="lm", samples=num_samples,
                          new_tokens=max_new_tokens)
    tok = load_run_tokenizer(loaded.folder, loaded.cfg)
    model = loaded.model
    if prompts is not None:
        return _generate_batch(model, tok, sc, prompts, num_samples, Path(out))
    if interactive:
        print("interactive: type a prompt and press enter; an empty line or Ctrl-D quits")
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            except UnicodeDecodeError:
                print("that line is not valid UTF-8 text; type another prompt", file=sys.stderr)
                continue
            if not line:
                return 0
            if not _is_utf8(line):
                print("that line is not valid UTF-8 text; type another prompt", file=sys.stderr)
                continue
            _print_samples(model, tok, sc, line, num_samples, stream=True)
    _print_samples(model, tok, sc, prompt, num_samples, stream=not no_stream)
    return 0


def _is_utf8(text: str) -> bool:
    """False for a command-line string holding bytes that were not UTF-8 (Python keeps them
    as lone surrogates, which no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_limits(num_samples: int, max_new_tokens: int, seed: Optional[int]) -> None:
    for flag, value, lo, hi in (("--num-samples", num_samples, 1, MAX_NUM_SAMPLES),
                                ("--max-new-tokens", max_new_tokens, 1, MAX_NEW_TOKENS)):
        if not lo <= value <= hi:
            raise ConfigError(f"{flag} must be between {lo} and {hi:,}, got {value}")
    if seed is not None and not MIN_SEED <= seed <= MAX_SEED:
        raise ConfigError(f"--seed must be between {MIN_SEED} and {MAX_SEED} (a 64-bit seed), got {seed}")


PROMPTS_FILE_LIMIT = 64 << 20


def _read_prompts(path: str, out: Optional[str]) -> list[str]:
    from distlm.data import read_regular_text
    src = Path(path)
    if not out:
        raise ConfigError("--prompts-file needs --out F.jsonl")
    dest = Path(out)
    if not dest.parent.is_dir():  # found before any sampling, not after it
        raise ConfigError(f"--out {dest}: no folder {dest.parent} to write it in")
    if dest.is_dir():
        raise ConfigError(f"--out {dest}: is a folder; name the JSONL file to write")
    try:
        text = read_regular_text(src, PROMPTS_FILE_LIMIT, "the prompts file", ConfigError)
    except FileNotFoundError:
        raise ConfigError(f"--prompts-file {src}: no such file") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompts-file {src}: no prompts in it")
    return prompts


def _note_if_cut(model, tok, prompt: str, where: str = "") -> None:
    """generate_tokens keeps the last block_size tokens of a long prompt; say so."""
    n, ctx = len(tok.encode(prompt)), model.cfg.block_size
    if n > ctx:
        print(f"note: {where}the prompt is {n:,} tokens, longer than the model's {ctx}-token context; "
              f"it was cut to its last {ctx} tokens", file=sys.stderr, flush=True)


def _print_samples(model, tok, sc, prompt: str, n: int, stream: bool) -> list[str]:
    from distlm.model.generate import generate_text
    _note_if_cut(model, tok, prompt)
    if stream and n == 1:
        sys.stdout.write(prompt)
        texts = generate_text(model, tok, prompt, sc, 1, on_token=lambda i, piece: (sys.stdout.write(piece),
                                                                                     sys.stdout.flush()))
        sys.stdout.write("\n")
        return texts
    texts = generate_text(model, tok, prompt, sc, n)
    for i, t in enumerate(texts):
        print(f"--- sample {i + 1} ---\n{prompt}{t}")
    return texts


def _generate_batch(model, tok, sc, prompts: list[str], n: int, out: Path) -> int:
    """Prompt i samples from seed + i, recorded in its line: one seed for every prompt would
    draw the same random stream each time, and completions would share phrases."""
    from distlm.io import atomic_write_text
    from distlm.model.generate import generate_text
    base = sc.seed if sc.seed is not None else random.SystemRandom().randrange(2 ** 31)
    lines = []
    for i, prompt in enumerate(prompts):
        _note_if_cut(model, tok, prompt, where=f"prompt {i + 1}: ")
        texts = generate_text(model, tok, prompt, dataclasses.replace(sc, seed=base + i), n)
        lines.append(json.dumps({"index": i, "prompt": prompt, "seed": base + i, "completions": texts}))
    atomic_write_text(out, "\n".join(lines) + "\n")
    print(f"wrote {len(lines)} prompts x {n} samples to {out} (seeds {base}..{base + len(lines) - 1})")
    return 0
