"""Checkpoints as torch.distributed.checkpoint folders that any layout can load.

    store.py      saving (atomic, checksummed, never non-finite), finding, loading, resuming and
                  pruning checkpoints
    verify.py     the marker's keys and every file's checksum; VerifiedFiles, the memo that
                  spares a process from hashing an unchanged checkpoint twice
    files.py      which files a checkpoint holds, and their checksums
    staging.py    the pinned host memory a save on a GPU copies the state into first
    group.py      the process-group helpers saving and verifying share
    safe_dcp.py   reading DCP's metadata and byte entries without running code from them
    errors.py     the one-line errors every loader raises
"""
from distlm.checkpoint.errors import CheckpointError, CheckpointSaveError, CorruptCheckpoint, NonFiniteCheckpoint
from distlm.checkpoint.staging import HostStaging
from distlm.checkpoint.store import (MARKER, PendingSave, list_checkpoints, load_checkpoint, load_model_state,
                                     prune_checkpoints, resolve_checkpoint, resume_and_load, resume_target,
                                     save_checkpoint, update_meta)
from distlm.checkpoint.verify import VerifiedFiles, read_meta, verify_checkpoint

__all__ = ["MARKER", "CheckpointError", "CheckpointSaveError", "CorruptCheckpoint", "NonFiniteCheckpoint",
           "HostStaging", "PendingSave", "list_checkpoints", "load_checkpoint", "load_model_state", "prune_checkpoints", "read_meta",
           "resolve_checkpoint", "resume_and_load", "resume_target", "save_checkpoint", "update_meta",
           "VerifiedFiles", "verify_checkpoint"]
