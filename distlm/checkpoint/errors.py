"""Checkpoint errors, in a module of their own so that checkpoint.py and safe_dcp.py can
both raise them without importing each other."""
from __future__ import annotations

from typing import Optional


def one_line(text: object, limit: int = 200) -> str:
    """Text from a file (a global's name, an error message) made safe for a one-line error:
    control characters escaped, length capped."""
    s = str(text).encode("unicode_escape").decode("ascii")
    return s if len(s) <= limit else s[:limit] + "..."


class CheckpointError(ValueError):
    """A checkpoint cannot be used (or written). The message is one line: the CLI prints
    it as ``error: ...`` and exits 2."""


class CheckpointSaveError(CheckpointError, OSError):
    """Any failure while writing a checkpoint: I/O, DCP's wrapped per-rank errors, a failed
    rank elsewhere, weights that must not be saved. ``cause`` is the short reason ("No space
    left on device", "disk full", ...), also in ``strerror``.

    It is an OSError as well, so code that treats a failed save as an I/O error (the
    Trainer's ``train.on_save_error`` handling) keeps handling every kind of failed save."""

    def __init__(self, message: str, cause: str = "", errno: Optional[int] = None):
        super().__init__(message)
        self.cause = cause or message
        self.strerror = self.cause
        self.errno = errno

    def __str__(self) -> str:  # OSError's own would print "[Errno N] cause" and drop the message
        return str(self.args[0])


class NonFiniteCheckpoint(CheckpointSaveError):
    """The model's parameters hold NaN or Inf: such a state is never marked complete."""


class CorruptCheckpoint(CheckpointError):
    """The checkpoint's content cannot be trusted or read: a checksum mismatch, a marker
    without its keys, unreadable or refused metadata, non-finite weights. resume=auto
    falls back past such a checkpoint; other errors (a different architecture) stop it."""
