"""`distlm VERB`: every verb is a plain typed function, listed once in VERBS below; its
signature is its command line (signature.py builds the argparse parser from it).

    distlm prepare INPUT... --out DIR [--tokenizer gpt2|bpe:N] [--task lm|classify]
    distlm train [--config FILE_OR_PRESET] [section.key=value ...] [--print-config]
    torchrun --nproc_per_node 4 -m distlm train parallel.dp_shard=4 ...
    distlm train --nproc-per-node 4 parallel.dp_shard=4 ...   (the same ranks, torchrun's entry point run here)
    distlm eval --checkpoint RUN_OR_CKPT [--split val|train] [--json]   (a language model or a classifier)
    distlm predict --checkpoint RUN_OR_CKPT --input FILE [--out F.csv|F.jsonl]
    distlm generate --checkpoint RUN_OR_CKPT --prompt TEXT | --prompts-file F --out F.jsonl | --interactive
    distlm plot RUN... [--out PNG]          (default: RUN/loss.png, or FIRST_RUN/compare.png)
    distlm bench [--config ...] [section.key=value ...] | --ceilings | --scaling 1,2,4 | --pp-sweep 1,2,4
    distlm plan --gpus N [--config ...] [section.key=value ...]
    distlm export RUN_OR_CKPT OUT [--dtype fp32|bf16|fp16]
    distlm demo [--max-steps N]
    distlm env [--json]                      (torchrun ... -m distlm env: every rank, one all-reduce)
    distlm --version

Conventions: config settings are `section.key=value` overrides, anywhere on the line, never
flags (`--max-steps 5` is refused with the override to write instead); a flag given twice is
an error; a user error is one line on stderr, `error: ...`; with several ranks only rank 0
prints it (a rank whose own error is another prints that too, `error (rank N): ...`), and under
`distlm train --nproc-per-node N` and the SLURM script nothing else follows (a bare torchrun
adds its own summary after it). Exit status, the same for `distlm train`,
`distlm train --nproc-per-node N` and the SLURM script's srun step: 0 finished; 2 the user's
error (config, data, memory, layout, a missing or damaged checkpoint); 3 training had to stop
(a checkpoint that cannot be written, non-finite values); 128 + the signal when a signal
stopped the run after saving (130 Ctrl-C, 143 SIGTERM); 1 a crash (a traceback).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from typing import Callable, Optional

# Only light modules here: building the parser must not import torch (about 5 s on a loaded
# 2-core box), so `distlm --help`, a usage error or `--print-config` answer at once. The verbs
# import what they need in their bodies; tests/cli/test_light_commands.py checks that torch stays out.
from distlm import __version__, bytecode
from distlm.cli.bench import bench
from distlm.cli.demo import demo
from distlm.cli.generate import generate
from distlm.cli.signature import add_verb, call, takes
from distlm.cli.verbs import env, evaluate, export, plan, plot, predict, prepare, train
from distlm.config import SECTIONS, ConfigError, list_presets
from distlm.data import DataError
from distlm.errors import AgreedError

VERBS: dict[str, Callable[..., int]] = {
    "prepare": prepare,
    "train": train,
    "eval": evaluate,
    "predict": predict,
    "generate": generate,
    "plot": plot,
    "bench": bench,
    "plan": plan,
    "export": export,
    "demo": demo,
    "env": env,
}


def shared_params() -> dict[str, dict]:
    """Parameters that mean the same in every verb that has them: metavar and help, once."""
    return {
        "checkpoint": {"metavar": "RUN_OR_CKPT",
                       "help": "a run folder (its newest complete checkpoint) or one checkpoint folder"},
        "config": {"metavar": "FILE_OR_PRESET", "help": f"a YAML file or a preset: {', '.join(list_presets())}"},
        "overrides": {"metavar": "section.key=value", "help": "config overrides, before or after the flags"},
        "device": {"help": "where the model runs (auto: CUDA when there is one)"},
    }


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """A usage error is one line, like every other user error, and exit status 2."""
        print_error(f"{self.prog}: {message} (see {self.prog} --help)")
        sys.exit(2)


def build_parser() -> Parser:
    p = Parser(prog="distlm", description="Train GPT-style language models from scratch, from one CPU to many "
               "GPUs (torch.distributed).", allow_abbrev=False)
    p.add_argument("--version", action="version", version=f"distlm {__version__}")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    shared = shared_params()
    p.verb_parsers = {name: add_verb(sub, name, fn, shared) for name, fn in VERBS.items()}
    return p


def run() -> int:
    """The program's entry (`distlm`, `python -m distlm`, each rank under torchrun): first where
    Python keeps the bytecode of the imports to come (torch's is seconds: distlm/bytecode.py),
    with a background compile of it on a cold start, then the command line. Tests call ``main``
    and leave the interpreter as it is."""
    bytecode.precompile_in_background(bytecode.use())
    status = main()
    if sys.argv[1:2] == ["train"] and "torch" in sys.modules:
        end_train_process(status)
    return status


def end_train_process(status: int) -> None:
    """A finished `distlm train` process ends here, without the interpreter's teardown.

    By now the run is complete on disk: its final checkpoint fsynced and renamed into place,
    metrics.csv, TensorBoard and W&B closed, the lock released, the process group destroyed.
    What the teardown would still do is only undo the process: destroy the CUDA context and
    the compiler's state, join inductor's compile-worker pool (whose workers exit when their
    parent does), run the finalizers of every module torch imported. That took seconds after
    the last line of a GPU run, counted in every run's time and in every job's.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed pipe: nothing more can reach it anyway
    os._exit(status)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            _take_overrides(parser.verb_parsers[args.verb], args, extra, argv)
        return call(args._fn, args)
    except (ConfigError, DataError) as e:
        print_error(str(e), agreed=isinstance(e, AgreedError))
        return 2
    except Exception as e:
        status = _status_of(e)
        if status is None:
            raise
        print_error(str(e))
        return status
    except KeyboardInterrupt:
        _quiet_interrupts()
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        try:
            _shutdown()
        except KeyboardInterrupt:  # Ctrl-C again while the process group closes
            _quiet_interrupts()


def _quiet_interrupts() -> None:
    """After an interrupt, a further Ctrl-C (while the process group closes, a background save
    thread is joined or the interpreter exits) ends the process at once, as the default
    SIGINT action does, instead of a KeyboardInterrupt traceback from wherever it lands."""
    import signal
    import threading
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)


# Errors of the heavy modules, with their exit status: a CheckpointError is the user's (a
# missing or damaged checkpoint), a TrainingStopped is a run that had to stop.
_HEAVY_ERRORS = (("distlm.checkpoint.errors", "CheckpointError", 2), ("distlm.train.faults", "TrainingStopped", 3))


def _status_of(e: Exception) -> Optional[int]:
    """The exit status of one of _HEAVY_ERRORS, None for anything else (a bug: traceback).
    Each class is looked up only if its module is loaded: an exception of a module never
    imported cannot have been raised, and importing it here would load torch."""
    for module, name, status in _HEAVY_ERRORS:
        mod = sys.modules.get(module)
        if mod is not None and isinstance(e, getattr(mod, name)):
            return status
    return None


# The store key under which rank 0 leaves its error for the other ranks, and how long another
# rank with an error waits for it: the ranks run the same checks in the same order, so rank 0
# reaches the same error within moments, unless it is busy elsewhere (then the rank says its own).
ERROR_KEY = "distlm/error/rank0"
RANK_0_WAIT_S = 10.0


def print_error(message: str, agreed: bool = False) -> None:
    """Under torchrun every rank runs the same command line, so most errors are every rank's
    alike, and rank 0's copy is enough; an ``agreed`` error (decided on values the ranks
    agreed on: the memory check's least free memory) always is. Rank 0 says it and leaves it in
    the store the launch's agent holds; a rank with an error waits for rank 0's words, and says
    nothing where rank 0 said the same (or said anything, for an agreed error). A rank exiting
    first in silence would be worse than a repeat: its launcher then stops rank 0 before rank 0
    has said a word. Where rank 0 said other words, or none in RANK_0_WAIT_S, the error is the
    rank's own (its GPU's memory, its node's files) and the rank says it, with its rank. Without
    a store (several ranks started by hand) a rank says an error only once the process group is
    up and not for an agreed one."""
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)
        _store_call(lambda store: store.set(ERROR_KEY, message))
        return
    said = _store_call(_rank_0_words)
    if said is None:  # no store
        if _process_group_up() and not agreed:
            print(f"error (rank {rank}): {message}", file=sys.stderr)
        return
    if not said or not agreed and said.decode(errors="replace") != message:
        print(f"error (rank {rank}): {message}", file=sys.stderr)


def _rank_0_words(store) -> bytes:
    """What rank 0 said; b"" where it said nothing in RANK_0_WAIT_S (or its store is gone)."""
    import datetime
    try:
        store.wait([ERROR_KEY], datetime.timedelta(seconds=RANK_0_WAIT_S))
        return store.get(ERROR_KEY)
    except Exception:
        return b""


def _error_store():
    """The key-value store the ranks of this launch share, or None: torchrun's agent's (from a
    rank's start, before any process group), else the process group's."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import datetime
    world = int(os.environ["WORLD_SIZE"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in os.environ:
        from distlm.parallel.dims import _attempt_store  # the store prefix the process group uses
        return _attempt_store(world, datetime.timedelta(seconds=RANK_0_WAIT_S))
    if _process_group_up():
        return sys.modules["torch.distributed"].distributed_c10d._get_default_store()
    return None


def _store_call(fn):
    """``fn(store)`` on _error_store(); None where there is none or the call fails (rank 0 gone
    with the store it hosted, a timeout)."""
    try:
        store = _error_store()
        return None if store is None else fn(store)
    except Exception:
        return None


def _shutdown() -> None:
    if _process_group_up():
        sys.modules["torch.distributed"].destroy_process_group()


def _process_group_up() -> bool:
    # Not loaded means no group was ever started; importing it to ask would cost torch's import.
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _is_override(token: str) -> bool:
    return "=" in token and not token.startswith("-")


def _take_overrides(verb_parser: Parser, args: argparse.Namespace, extra: list[str], argv: list[str]) -> None:
    """``section.key=value`` may come on both sides of a flag (``--config X a=1 --steps 5 b=2``):
    argparse binds only the first run of positionals, so the rest arrive here. Anything else
    is an error; a flag that names a config field gets the override to write instead."""
    if takes(args._fn, "overrides"):
        if all(_is_override(e) for e in extra):
            args.overrides = [*args.overrides, *extra]
            return
        flag = next((e for e in extra if e.startswith("--")), None)
        hint = flag and _config_flag_hint(flag, argv)
        if hint:
            verb_parser.error(hint)
    verb_parser.error(f"unrecognized arguments: {' '.join(extra)}")


def _config_flag_hint(flag: str, argv: list[str]) -> Optional[str]:
    """'--max-steps 5' -> 'use train.max_steps=5'. Settings have one spelling, the config
    field's, so that a command line, a YAML file and config.yaml of a run all read alike."""
    name, eq, value = flag[2:].partition("=")
    if not eq:
        i = argv.index(flag) + 1
        value = argv[i] if i < len(argv) and not argv[i].startswith("-") else "VALUE"
    key = name.replace("-", "_")
    fields = [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    if key in fields:
        return f"{flag.split('=')[0]}: config fields are not flags; write {key}={value}"
    names = {f: f.split(".")[1] for f in fields}
    exact = [f for f, n in names.items() if n == key]
    # --batch-size: global_batch_size and micro_batch_size both contain it; say both
    close = (exact or [f for f, n in names.items() if key in n] or [
        f for f, n in names.items() if n in difflib.get_close_matches(key, list(names.values()), n=3, cutoff=0.8)])[:3]
    if not close:
        return None
    written = " or ".join(f"{f}={value}" for f in close)
    return (f"{flag.split('=')[0]} is not a flag; config settings are overrides: "
            + (f"use {written}" if exact else f"did you mean {written}?"))
