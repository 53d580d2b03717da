"""The benchmark suites: each module gives add_arguments(parser) and plan(args, ctx) -> [Step]."""
from __future__ import annotations

import re

# Layout names: axes joined by "_" or "x", each an axis and its degree: ddp4, fsdp2_tp2, tp2xpp2.
AXES = {"ddp": "dp_replicate", "fsdp": "dp_shard", "tp": "tp", "pp": "pp", "cp": "cp"}


def layout(name: str) -> tuple[int, list[str]]:
    """'tp2_fsdp2' -> (4, ['parallel.tp=2', 'parallel.dp_shard=2']); 'one' -> (1, [])."""
    if name in ("one", "1"):
        return 1, []
    gpus, overrides = 1, []
    for part in re.split(r"[_x]", name):
        m = re.fullmatch(r"(ddp|fsdp|tp|pp|cp)(\d+)", part)
        if not m:
            raise ValueError(f"layout {name!r}: {part!r} is not AXISn with AXIS one of {', '.join(AXES)}")
        gpus *= int(m.group(2))
        overrides.append(f"parallel.{AXES[m.group(1)]}={m.group(2)}")
    return gpus, overrides


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of integers") from None


def add_common(p, config: str, warmup: int, steps: int) -> None:
    p.add_argument("--config", default=config, help=f"preset or YAML (default {config})")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra config overrides for every run")
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed steps (default {warmup})")
    p.add_argument("--steps", type=int, default=steps, help=f"timed steps (default {steps})")


# The books distlm ships (distlm/assets/gutenberg), which the loss-curve steps train on: real text
# that every machine has, so a curve needs no corpus carried to the GPU machine.
BUNDLED_BOOKS = "distlm/assets/gutenberg/gutenberg.tar.xz"
# Under --cpu the tiny model has a 256-row token table; its corpus gets a 512-token BPE and the
# model a table to match (GPT-2's 50k vocabulary would make a tiny model all table).
CPU_VOCAB = 512


def bundled_corpus(ctx, name: str = "corpus") -> tuple:
    """The step that prepares the bundled books (GPT-2's tokenizer on GPUs), and the overrides a
    training command on them takes: its data.dir, and under --cpu the vocabulary after the tiny
    model's. Append the overrides after ctx.tiny(...) so they win."""
    from run import Step
    tokenizer = f"bpe:{CPU_VOCAB}" if ctx.cpu else "gpt2"
    step = Step(name, [ctx.python, "-m", "distlm", "prepare", BUNDLED_BOOKS, "--out", "{dir}/data",
                       "--tokenizer", tokenizer, "--quiet"])
    overrides = [f"data.dir={{out}}/{{stamp}}-{name}/data"]
    if ctx.cpu:
        overrides.append(f"model.vocab_size={CPU_VOCAB}")
    return step, overrides
