"""The tokenizer processes of ``prepare``: a process pool whose workers hold the tokenizer.

Only the pipeline starts them; the readers of a prepared folder never do.
"""
from __future__ import annotations

import contextlib
import os
import sys
from concurrent.futures import Future

from distlm.data.tokenizer import Tokenizer

START_METHOD = "fork" if sys.platform == "linux" else "spawn"  # see open_executor

_WORKER: Tokenizer | None = None


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when its parent dies: a `kill -9` of `distlm prepare`
    must not leave its tokenizer processes running (they would hold memory and the CPUs).
    Elsewhere (macOS) there is no such call and nothing is done."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal
    pr_set_pdeathsig = 1  # from <linux/prctl.h>
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    import multiprocessing
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the call took effect
        os._exit(1)


def pool_init(tok: Tokenizer) -> None:
    """Worker initializer: keep the tokenizer (sent once, or inherited by fork) and build it."""
    global _WORKER
    die_with_parent()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool already uses every core
    _WORKER = tok
    tok.encoding  # noqa: B018 - GPT-2's is built on first use: now, while the parent reads


def pool_call(fn, *args):
    """In a worker process: ``fn(the worker's tokenizer, *args)``."""
    return fn(_WORKER, *args)


class _Inline:
    """The executor interface, run in this process."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def run(self, fn, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(self.tok, *args))
        except Exception as e:  # noqa: BLE001 - handed over as a worker's would be, by result()
            future.set_exception(e)
        return future


class _Pool:
    def __init__(self, pool) -> None:
        self.pool = pool

    def run(self, fn, *args) -> Future:
        return self.pool.submit(pool_call, fn, *args)


@contextlib.contextmanager
def open_executor(workers: int, tok: Tokenizer):
    """Something to ``run(fn, *args)`` on, which calls ``fn(tok, *args)`` and returns a Future:
    in this process for one worker, else in one of ``workers`` processes holding ``tok``.
    ``fn`` must be a module-level function (a spawned worker imports it by name).

    Linux forks: a spawned worker re-imports the caller's main module and all it
    imports (torch: seconds each), longer than tokenizing a small corpus. Workers
    run only tokenizer code, so the parent's threads cannot trip them up; the code
    stays spawn-safe for platforms where fork is missing or unsafe. An executor, not
    multiprocessing.Pool: a dead worker fails the run instead of hanging it.
    """
    if workers == 1:
        yield _Inline(tok)
        return
    import multiprocessing
    import warnings
    from concurrent.futures import ProcessPoolExecutor
    if START_METHOD == "fork":
        # Built once here and inherited by every worker: the encoding, and what encoding to shard
        # bytes imports on first use (numpy: ~0.07 s of CPU that each worker would pay again).
        tok.encode_packed([""])
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(START_METHOD),
                               initializer=pool_init, initargs=(tok,))
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # after train_bpe: tells tokenizers the fork is deliberate
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
            for _ in range(workers):  # start them all now, to boot while the parent reads
                pool.submit(int)
    finally:
        if saved is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    try:
        yield _Pool(pool)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
