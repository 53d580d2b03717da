"""Loading DCP checkpoints without running code from them.

torch.distributed.checkpoint reads a checkpoint's ``.metadata`` with plain ``pickle`` and
its non-tensor entries (optimizer param_groups) with ``torch.load(weights_only=False)``: a
crafted checkpoint could execute anything on load. Here:

- ``.metadata`` goes through an unpickler that resolves a global only when its exact
  (module, name) pair is in ``ALLOWED_GLOBALS``: DCP's metadata classes and the few torch
  and pathlib types they hold. The lookup is a dictionary lookup, so a dotted name
  ("os.system" under an allowed module) is refused instead of walked attribute by attribute;
  and the pickle's BUILD step may not set attributes on those classes or functions
  themselves, so a file cannot re-wire them for later loads.
- byte entries and the per-rank RNG files go through ``torch.load(weights_only=True)``.

Every refusal and every unreadable file is a one-line ``CheckpointError`` naming the file
and, for a refused global, the global.
"""
from __future__ import annotations

import io
import pickle
import re
import types
from pathlib import Path, PosixPath

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_md
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.serialization import _get_layout

from distlm.checkpoint.errors import CheckpointError, CorruptCheckpoint


def _dtype_names() -> dict[str, torch.dtype]:
    # A dtype pickles as the global torch.<canonical name> (torch.float32, never torch.float).
    return {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype) and str(v) == f"torch.{name}"}


# What the .metadata of a model + AdamW checkpoint names (single process, DDP, FSDP2 and TP
# layouts alike): read off real checkpoints with pickletools, nothing added on speculation.
ALLOWED_GLOBALS: dict[tuple[str, str], object] = {
    **{("torch.distributed.checkpoint.metadata", cls.__name__): cls for cls in (
        dcp_md.Metadata, dcp_md.MetadataIndex, dcp_md.StorageMeta, dcp_md.TensorProperties,
        dcp_md.TensorStorageMetadata, dcp_md.BytesStorageMetadata, dcp_md.ChunkStorageMetadata,
        dcp_md._MEM_FORMAT_ENCODING)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch.serialization", "_get_layout"): _get_layout,  # a str -> torch.layout lookup, nothing else
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): PosixPath,  # StorageMeta.checkpoint_id
    **{("torch", name): dtype for name, dtype in _dtype_names().items()},
}
_ALLOWED_IDS = {id(v) for v in ALLOWED_GLOBALS.values()}


def one_line(text: object, limit: int = 200) -> str:
    """Text from a file (a global's name, an error message) made safe for a one-line error:
    control characters escaped, length capped."""
    s = str(text).encode("unicode_escape").decode("ascii")
    return s if len(s) <= limit else s[:limit] + "..."


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler: its BUILD step can be guarded (the C one cannot be), at
    about 0.13 s per MB of metadata (a 7B model with AdamW on 64 ranks is a few MB)."""

    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module, name):
        obj = ALLOWED_GLOBALS.get((module, name))
        if obj is None:
            raise CorruptCheckpoint(f"{self.source}: refused to load: it names the global {one_line(module, 80)}."
                                  f"{one_line(name, 80)}, which DCP checkpoint metadata never holds")
        return obj

    def _guarded_build(self):
        target = self.stack[-2] if len(self.stack) >= 2 else None
        if id(target) in _ALLOWED_IDS or isinstance(target, (type, types.FunctionType, types.BuiltinFunctionType,
                                                             types.ModuleType)):
            raise CorruptCheckpoint(f"{self.source}: refused to load: it tries to set attributes of "
                                  f"{one_line(getattr(target, '__qualname__', type(target).__name__), 80)} itself")
        pickle._Unpickler.dispatch[pickle.BUILD[0]](self)

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = _guarded_build


def read_dcp_metadata(path: Path, source: str | None = None) -> dcp_md.Metadata:
    """Unpickle a DCP ``.metadata`` file safely; any failure is a one-line CheckpointError."""
    source = source or str(path)
    try:
        with open(path, "rb") as fh:
            md = _MetadataUnpickler(fh, source).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{source}: missing (the checkpoint is incomplete)") from None
    except (RecursionError, MemoryError) as e:
        raise CorruptCheckpoint(f"{source}: unreadable checkpoint metadata ({e.__class__.__name__})") from None
    except Exception as e:  # truncated, bit-flipped or foreign bytes: any parse error
        raise CorruptCheckpoint(f"{source}: unreadable checkpoint metadata "
                              f"({e.__class__.__name__}: {one_line(str(e).splitlines()[0] if str(e) else '')})") from None
    if not isinstance(md, dcp_md.Metadata) or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CorruptCheckpoint(f"{source}: not DCP checkpoint metadata (holds a {type(md).__name__})")
    return md


def _weights_only_reason(e: BaseException) -> str:
    """torch.load(weights_only=True)'s refusal is a paragraph; keep the line that names the global."""
    text = str(e)
    m = re.search(r"GLOBAL (\S+)", text)
    if m:
        return f"it names the global {one_line(m.group(1), 100)}, which a checkpoint never holds"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("Check the documentation")]
    return one_line(lines[-1] if lines else e.__class__.__name__)


def load_weights_only(source, what: str):
    """torch.load(weights_only=True) of a file or stream; a refused or unreadable one is a
    one-line CheckpointError naming ``what`` (the file, or the entry)."""
    try:
        return torch.load(source, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{what}: missing (the checkpoint is incomplete)") from None
    except pickle.UnpicklingError as e:
        raise CorruptCheckpoint(f"{what}: refused to load: {_weights_only_reason(e)}") from None
    except Exception as e:
        raise CorruptCheckpoint(f"{what}: unreadable ({e.__class__.__name__}: {_weights_only_reason(e)})") from None


class SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        if hasattr(self, "_get_metadata_path"):
            path = Path(self._get_metadata_path(kwargs.get("rank")))
        metadata = read_dcp_metadata(path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = load_weights_only(value, f"checkpoint entry '{one_line(read_item.dest_index.fqn, 100)}'")
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def underlying_errors(e: BaseException) -> list[BaseException]:
    """The exceptions inside DCP's CheckpointException (one per failed rank), else [e]."""
    if isinstance(e, CheckpointException):
        found = []
        for failure in e.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                found.extend(underlying_errors(inner))
        return found or [e]
    return [e]


def safe_load(state: dict, path) -> None:
    """dcp.load with the safe reader and planner; every failure is a one-line CheckpointError."""
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP wraps rank failures in CheckpointException, a BaseException
        inner = underlying_errors(e)
        refused = [x for x in inner if isinstance(x, CheckpointError)]
        if refused:
            msg = str(refused[0])
            raise type(refused[0])(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
        first = inner[0]
        lines = str(first).strip().splitlines()
        why = f"{first.__class__.__name__}: {one_line(lines[-1] if lines else '')}"
        raise CorruptCheckpoint(f"{path}: cannot load this checkpoint ({why})") from None
