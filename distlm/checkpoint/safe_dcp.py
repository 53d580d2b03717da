"""Loading DCP checkpoints without running code from them.

torch.distributed.checkpoint reads a checkpoint's ``.metadata`` with plain ``pickle`` and
its non-tensor entries (optimizer param_groups) with ``torch.load(weights_only=False)``: a
crafted checkpoint could execute anything on load. Here:

- ``.metadata`` goes through an unpickler that never hands out a real object: a global
  resolves only when its exact (module, name) pair is in ``ALLOWED_GLOBALS``, and then only
  to its name; REDUCE and NEWOBJ record what they would make instead of calling anything;
  BUILD, SETITEM(S), APPEND(S) and ADDITEMS reach only records and containers that load made.
  The plain tree is then rebuilt, field by field and checked, into fresh DCP objects. So a
  file can neither run code nor change an object that outlives the load (an enum member
  every later save pickles, a dtype, a class): a BUILD on the contiguous memory-format
  member would make every later checkpoint of the process unreadable.
- every data file the metadata names is a ``.distcp`` file in the checkpoint folder itself,
  a regular file (not a link out of the folder, not a FIFO that would hang the read).
- byte entries and the per-rank RNG files go through ``torch.load(weights_only=True)``.

Every refusal and every unreadable file is a one-line ``CheckpointError`` naming the file
and, for a refused global, the global.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import threading
import warnings
from pathlib import Path, PosixPath

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_md
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.serialization import _get_layout

from distlm.checkpoint.errors import CheckpointError, CorruptCheckpoint, one_line
from distlm.checkpoint.files import open_regular, regular_file


def _dtype_names() -> dict[str, torch.dtype]:
    # A dtype pickles as the global torch.<canonical name> (torch.float32, never torch.float).
    return {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype) and str(v) == f"torch.{name}"}


_DTYPES = _dtype_names()


# What the .metadata of a model + AdamW checkpoint names (single process, DDP, FSDP2 and TP
# layouts alike): read off real checkpoints with pickletools, nothing added on speculation.
# The unpickler hands out only the names (_Global); _Rebuild makes each object itself.
ALLOWED_GLOBALS: dict[tuple[str, str], object] = {
    **{("torch.distributed.checkpoint.metadata", cls.__name__): cls for cls in (
        dcp_md.Metadata, dcp_md.MetadataIndex, dcp_md.StorageMeta, dcp_md.TensorProperties,
        dcp_md.TensorStorageMetadata, dcp_md.BytesStorageMetadata, dcp_md.ChunkStorageMetadata,
        dcp_md._MEM_FORMAT_ENCODING)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch.serialization", "_get_layout"): _get_layout,  # a str -> torch.layout lookup, nothing else
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): PosixPath,  # StorageMeta.checkpoint_id
    **{("torch", name): dtype for name, dtype in _DTYPES.items()},
}


class _Global:
    """A global the pickle names, kept as its name. The unpickler never hands out the real
    class, function, enum or dtype: no later opcode (BUILD, SETITEM, APPENDS) can reach an
    object that outlives the load. A fresh one per lookup."""
    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


_UNSET = object()


class _Made:
    """What the pickle made of an allowed global, as plain data: the global, its arguments,
    ``by`` ("call" for REDUCE, "new" for NEWOBJ) and the state a BUILD gave it. Nothing is
    called; _Rebuild turns the tree into fresh DCP objects."""
    __slots__ = ("cls", "args", "by", "state")

    def __init__(self, cls: _Global, args: tuple, by: str):
        self.cls, self.args, self.by, self.state = cls, args, by, _UNSET


def _describe(obj) -> str:
    if isinstance(obj, _Global):
        return one_line(obj.qualname, 100)
    if isinstance(obj, _Made):
        return f"a {one_line(obj.cls.name, 80)} it made"
    return f"a {type(obj).__name__}"


# The dataclasses DCP pickles as NEWOBJ + BUILD; only these may be given state.
_STATEFUL = {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
             "BytesStorageMetadata", "ChunkStorageMetadata", "_StorageInfo"}


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (its opcodes can be replaced; the C one's cannot), at about
    0.13 s per MB of metadata (a 7B model with AdamW on 64 ranks is a few MB). Globals are
    looked up by exact (module, name) pair and come back as _Global names; REDUCE and NEWOBJ
    make _Made records instead of calling anything; BUILD may only give state to a record
    NEWOBJ made in this load, and SETITEM(S), APPEND(S) and ADDITEMS only fill containers this
    load built. So every object the pickle can touch is one it created itself."""

    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def refuse(self, why: str):
        raise CorruptCheckpoint(f"{self.source}: refused to load: {why}")

    def find_class(self, module, name):
        if (module, name) not in ALLOWED_GLOBALS:
            self.refuse(f"it names the global {one_line(module, 80)}.{one_line(name, 80)}, which DCP checkpoint "
                        f"metadata never holds")
        return _Global(module, name)

    def _callee(self, obj, op: str) -> _Global:
        if not isinstance(obj, _Global):
            self.refuse(f"its {op} applies {_describe(obj)}, which is not a class or function")
        return obj

    def _args(self, args, op: str) -> tuple:
        if type(args) is not tuple:
            self.refuse(f"its {op} passes {_describe(args)} as arguments")
        return args

    def _load_reduce(self):
        args = self._args(self.stack.pop(), "REDUCE")
        self.stack[-1] = _Made(self._callee(self.stack[-1], "REDUCE"), args, "call")

    def _load_newobj(self):
        args = self._args(self.stack.pop(), "NEWOBJ")
        cls = self._callee(self.stack[-1], "NEWOBJ")
        if cls.name not in _STATEFUL:  # the enum's __new__ returns its shared member
            self.refuse(f"its NEWOBJ makes a {cls.qualname}, which DCP checkpoint metadata only makes by a call")
        self.stack[-1] = _Made(cls, args, "new")

    def _load_build(self):
        state = self.stack.pop()
        target = self.stack[-1]
        if isinstance(target, _Global):
            self.refuse(f"it tries to set attributes of {target.qualname} itself")
        if not isinstance(target, _Made) or target.by != "new":
            # A call's result may be a shared object: _MEM_FORMAT_ENCODING(0) is the enum
            # member every later save pickles, torch.float32 the dtype itself.
            self.refuse(f"it tries to set attributes of {_describe(target)}, which may outlive the load "
                        f"(an enum member, a dtype)")
        if target.state is not _UNSET:
            self.refuse(f"it sets the state of {_describe(target)} twice")
        target.state = state

    def _container(self, target, kind: type, op: str):
        if type(target) is not kind:
            self.refuse(f"its {op} writes into {_describe(target)}, not a {kind.__name__} it built")
        return target

    def _load_setitem(self):
        value = self.stack.pop()
        key = self.stack.pop()
        self._container(self.stack[-1], dict, "SETITEM")[key] = value

    def _load_setitems(self):
        items = self.pop_mark()
        target = self._container(self.stack[-1], dict, "SETITEMS")
        for i in range(0, len(items) - 1, 2):
            target[items[i]] = items[i + 1]

    def _load_append(self):
        value = self.stack.pop()
        self._container(self.stack[-1], list, "APPEND").append(value)

    def _load_appends(self):
        items = self.pop_mark()
        self._container(self.stack[-1], list, "APPENDS").extend(items)

    def _load_additems(self):
        items = self.pop_mark()
        self._container(self.stack[-1], set, "ADDITEMS").update(items)

    def _never(op: str):
        def refuse(self):
            self.refuse(f"it uses the pickle opcode {op}, which DCP checkpoint metadata never holds")
        return refuse

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.REDUCE[0]] = _load_reduce
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.BUILD[0]] = _load_build
    dispatch[pickle.SETITEM[0]] = _load_setitem
    dispatch[pickle.SETITEMS[0]] = _load_setitems
    dispatch[pickle.APPEND[0]] = _load_append
    dispatch[pickle.APPENDS[0]] = _load_appends
    dispatch[pickle.ADDITEMS[0]] = _load_additems
    for _op in ("NEWOBJ_EX", "INST", "OBJ", "PERSID", "BINPERSID"):
        dispatch[getattr(pickle, _op)[0]] = _never(_op)
    del _op, _never


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
# TensorProperties pickles its memory format as this enum's value (torch.memory_format
# cannot be pickled); the same table as its __setstate__, read once here.
_MEMORY_FORMATS = {dcp_md._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT.value: torch.contiguous_format,
                   dcp_md._MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST.value: torch.channels_last,
                   dcp_md._MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT.value: torch.preserve_format}
_MD = "torch.distributed.checkpoint.metadata"
_MAX_DIM = 1 << 62
_MAX_NDIM = 64
# The largest .metadata read: a 7B model with AdamW on 64 ranks writes a few MB.
METADATA_LIMIT = 256 << 20
# Visits of the rebuilt tree per byte of the file, beyond a floor: a legitimate file's
# objects are each pickled once or shared as small leaves (a name, a torch.Size); model +
# AdamW checkpoints measure 0.10 visits per byte, five times below this bound.
_BYTES_PER_VISIT, _VISITS_FLOOR = 2, 100_000
# Byte entries (optimizer param_groups) and RNG files: kilobytes in any checkpoint.
ENTRY_LIMIT = 64 << 20


class _Rebuild:
    """The plain tree the unpickler made -> a fresh dcp Metadata, every value checked for
    its type and range. Each object DCP gets is built here, by its constructor."""

    def __init__(self, source: str, budget: int = 1 << 62):
        self.source, self.budget = source, budget
        self.records: set[int] = set()  # the "new" records rebuilt so far (they stay alive in the tree)

    def tick(self) -> None:
        """One value visited. The unpickler's memo lets a small file name one object many
        times (a chunk list shared by every entry, nested): a legitimate file's tree is
        about as large as its bytes, so past the budget the file is refused, fast."""
        self.budget -= 1
        if self.budget < 0:
            raise CorruptCheckpoint(f"{self.source}: not DCP checkpoint metadata: its objects, each counted as "
                                    f"often as it is referenced, are far more than its bytes describe (refused "
                                    f"before rebuilding them)")

    def fail(self, where: str, what: str):
        raise CorruptCheckpoint(f"{self.source}: not DCP checkpoint metadata: {one_line(where, 120)} {what}")

    def made(self, x, where: str, module: str, name: str, by: str) -> _Made:
        self.tick()
        if not (isinstance(x, _Made) and (x.cls.module, x.cls.name) == (module, name) and x.by == by):
            self.fail(where, f"is {_describe(x)}, not a {name}")
        if by == "new":
            # DCP pickles each of its records once; pickle's memo lets a crafted file name one
            # (a tensor entry of 30,000 chunks) 10,000 times in a few bytes each.
            if id(x) in self.records:
                self.fail(where, f"is a {name} the file already named elsewhere (DCP writes each once)")
            self.records.add(id(x))
        return x

    def fields(self, x, where: str, module: str, name: str, allowed: tuple, required: tuple = ()) -> dict:
        """The attributes a NEWOBJ + BUILD gave a dataclass (state: a dict, or (dict, slots))."""
        x = self.made(x, where, module, name, "new")
        if x.args != ():
            self.fail(where, f"passes arguments to {name}")
        state = {} if x.state is _UNSET else x.state
        if type(state) is tuple and len(state) == 2:
            parts = [s for s in state if s is not None]
            if not all(type(s) is dict for s in parts):
                self.fail(where, f"gives {name} a state that is not a dict")
            state = {k: v for s in parts for k, v in s.items()}
        if type(state) is not dict:
            self.fail(where, f"gives {name} a state that is not a dict")
        unknown = [k for k in state if k not in allowed]
        if unknown:
            self.fail(where, f"gives {name} the field {one_line(unknown[0], 60)}")
        missing = [k for k in required if k not in state]
        if missing:
            self.fail(where, f"has no {missing[0]}")
        return state

    def text(self, x, where: str, optional: bool = False):
        self.tick()
        if optional and x is None:
            return None
        if type(x) is not str:
            self.fail(where, f"is {_describe(x)}, not a string")
        return str(x)

    def count(self, x, where: str, optional: bool = False):
        self.tick()
        if optional and x is None:
            return None
        if type(x) is not int or not 0 <= x < _MAX_DIM:
            self.fail(where, f"is {one_line(repr(x), 40) if type(x) is int else _describe(x)}, not a count")
        return int(x)

    def flag(self, x, where: str) -> bool:
        if type(x) is not bool:
            self.fail(where, f"is {_describe(x)}, not true/false")
        return bool(x)

    def size(self, x, where: str, optional: bool = False):
        if optional and x is None:
            return None
        x = self.made(x, where, "torch", "Size", "call")
        if len(x.args) != 1 or type(x.args[0]) not in (tuple, list):
            self.fail(where, "is not a torch.Size of a tuple")
        if len(x.args[0]) > _MAX_NDIM:
            self.fail(where, f"has {len(x.args[0])} dimensions (a tensor has at most {_MAX_NDIM})")
        return torch.Size([self.count(v, f"{where}[{i}]") for i, v in enumerate(x.args[0])])

    def metadata(self, x) -> dcp_md.Metadata:
        s = self.fields(x, "the top", _MD, "Metadata", ("state_dict_metadata", "planner_data", "storage_data",
                                                      "storage_meta", "version"), ("state_dict_metadata",))
        entries = s["state_dict_metadata"]
        if type(entries) is not dict:
            self.fail("state_dict_metadata", "is not a dict")
        return dcp_md.Metadata(
            state_dict_metadata={self.text(k, "a state_dict_metadata key"): self.entry(v, f"entry '{k}'")
                                 for k, v in entries.items()},
            planner_data=self.planner_data(s.get("planner_data")),
            storage_data=self.storage_data(s.get("storage_data")),
            storage_meta=self.storage_meta(s.get("storage_meta")),
            version=self.text(s.get("version"), "version", optional=True))

    def entry(self, x, where: str):
        if isinstance(x, _Made) and x.cls.name == "BytesStorageMetadata":
            self.fields(x, where, _MD, "BytesStorageMetadata", ())
            return dcp_md.BytesStorageMetadata()
        s = self.fields(x, where, _MD, "TensorStorageMetadata", ("properties", "size", "chunks"),
                        ("properties", "size", "chunks"))
        size = self.size(s["size"], f"{where} size")
        if type(s["chunks"]) is not list:
            self.fail(f"{where} chunks", "is not a list")
        chunks = [self.chunk(c, f"{where} chunk {i}", size) for i, c in enumerate(s["chunks"])]
        return dcp_md.TensorStorageMetadata(properties=self.properties(s["properties"], where), size=size,
                                            chunks=chunks)

    def chunk(self, x, where: str, size: torch.Size) -> dcp_md.ChunkStorageMetadata:
        s = self.fields(x, where, _MD, "ChunkStorageMetadata", ("offsets", "sizes"), ("offsets", "sizes"))
        offsets, sizes = self.size(s["offsets"], f"{where} offsets"), self.size(s["sizes"], f"{where} sizes")
        if not (len(offsets) == len(sizes) == len(size)
                and all(o + n <= d for o, n, d in zip(offsets, sizes, size))):
            self.fail(where, f"(offsets {list(offsets)}, sizes {list(sizes)}) lies outside the tensor's "
                             f"{list(size)}")
        return dcp_md.ChunkStorageMetadata(offsets=offsets, sizes=sizes)

    def properties(self, x, where: str) -> dcp_md.TensorProperties:
        # TensorProperties.__getstate__: (dtype, layout, requires_grad, memory format, pin_memory)
        x = self.made(x, f"{where} properties", _MD, "TensorProperties", "new")
        if x.args != () or type(x.state) is not tuple or len(x.state) != 5:
            self.fail(f"{where} properties", "are not (dtype, layout, requires_grad, memory format, pin_memory)")
        dtype, layout, requires_grad, fmt, pin = x.state
        if not (isinstance(dtype, _Global) and dtype.module == "torch" and dtype.name in _DTYPES):
            self.fail(f"{where} dtype", f"is {_describe(dtype)}, not a torch dtype")
        layout = self.made(layout, f"{where} layout", "torch.serialization", "_get_layout", "call")
        if len(layout.args) != 1 or layout.args[0] not in _LAYOUTS:
            self.fail(f"{where} layout", "is not a torch layout")
        fmt = self.made(fmt, f"{where} memory format", _MD, "_MEM_FORMAT_ENCODING", "call")
        if len(fmt.args) != 1 or type(fmt.args[0]) is not int or fmt.args[0] not in _MEMORY_FORMATS:
            self.fail(f"{where} memory format", f"is {one_line(repr(fmt.args), 40)}, not a memory format")
        return dcp_md.TensorProperties(dtype=_DTYPES[dtype.name], layout=_LAYOUTS[layout.args[0]],
                                       requires_grad=self.flag(requires_grad, f"{where} requires_grad"),
                                       memory_format=_MEMORY_FORMATS[fmt.args[0]],
                                       pin_memory=self.flag(pin, f"{where} pin_memory"))

    def planner_data(self, x):
        """DefaultSavePlanner's: each flattened key -> its path in the state dict (str and int parts)."""
        if x is None:
            return None
        if type(x) is not dict:
            self.fail("planner_data", "is not a dict")
        out = {}
        for k, path in x.items():
            if type(path) not in (tuple, list) or not all(type(p) in (str, int) for p in path):
                self.fail(f"planner_data '{self.text(k, 'a planner_data key')}'", "is not a path of names")
            out[k] = tuple(path)
        return out

    def storage_data(self, x):
        if x is None:
            return None
        if type(x) is not dict:
            self.fail("storage_data", "is not a dict")
        out = {}
        for k, v in x.items():
            index = self.index(k)
            out[index] = self.storage_info(v, f"storage of {index.fqn}")
        return out

    def index(self, x) -> dcp_md.MetadataIndex:
        s = self.fields(x, "a storage_data key", _MD, "MetadataIndex", ("fqn", "offset", "index"), ("fqn",))
        return dcp_md.MetadataIndex(fqn=self.text(s["fqn"], "a storage_data key"),
                                    offset=self.size(s.get("offset"), "a storage_data offset", optional=True),
                                    index=self.count(s.get("index"), "a storage_data index", optional=True))

    def storage_info(self, x, where: str) -> _StorageInfo:
        s = self.fields(x, where, "torch.distributed.checkpoint.filesystem", "_StorageInfo",
                        ("relative_path", "offset", "length", "transform_descriptors"),
                        ("relative_path", "offset", "length"))
        rel = self.text(s["relative_path"], where)
        # DCP writes its data files in the checkpoint folder itself (__RANK_N.distcp), and
        # those are the files the marker's checksums cover: a path anywhere else is refused.
        if not _DATA_FILE.fullmatch(rel):
            self.fail(where, f"names {one_line(rel, 100)}, not a .distcp file in the checkpoint folder")
        if s.get("transform_descriptors"):
            self.fail(where, "asks for stream transforms, which distlm never writes")
        return _StorageInfo(relative_path=rel, offset=self.count(s["offset"], f"{where} offset"),
                            length=self.count(s["length"], f"{where} length"))

    def storage_meta(self, x):
        if x is None:
            return None
        s = self.fields(x, "storage_meta", _MD, "StorageMeta", ("checkpoint_id", "save_id", "load_id", "modules"))
        cid = s.get("checkpoint_id")
        if isinstance(cid, _Made):  # where it was saved, a PosixPath of str parts: informative only
            cid = self.made(cid, "storage_meta checkpoint_id", "pathlib", "PosixPath", "call")
            cid = "/".join(self.text(p, "storage_meta checkpoint_id") for p in cid.args).replace("//", "/")
        modules = s.get("modules", [])
        if type(modules) is not list:
            self.fail("storage_meta modules", "is not a list")
        return dcp_md.StorageMeta(checkpoint_id=self.text(cid, "storage_meta checkpoint_id", optional=True),
                                  save_id=self.text(s.get("save_id"), "storage_meta save_id", optional=True),
                                  load_id=self.text(s.get("load_id"), "storage_meta load_id", optional=True),
                                  modules=[self.text(m, "storage_meta modules") for m in modules])


_DATA_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.distcp")


def storage_files(md: dcp_md.Metadata) -> list[str]:
    """The data files a (rebuilt) Metadata reads, as names inside its checkpoint folder."""
    return sorted({info.relative_path for info in (md.storage_data or {}).values()})


def read_dcp_metadata(path: Path, source: str | None = None) -> dcp_md.Metadata:
    """A DCP ``.metadata`` file read as plain data and rebuilt into fresh DCP objects; every
    data file it names must be a regular file in its folder. Any failure is a one-line
    CheckpointError."""
    source = source or str(path)
    try:
        with open_regular(path, source) as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > METADATA_LIMIT:
                raise CorruptCheckpoint(f"{source}: {size:,} bytes, over the {METADATA_LIMIT >> 20} MB limit of "
                                        f"checkpoint metadata (refused before reading)")
            tree = _MetadataUnpickler(io.BytesIO(fh.read(METADATA_LIMIT + 1)), source).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{source}: missing (the checkpoint is incomplete)") from None
    except (RecursionError, MemoryError) as e:
        raise CorruptCheckpoint(f"{source}: unreadable checkpoint metadata ({e.__class__.__name__})") from None
    except Exception as e:  # truncated, bit-flipped or foreign bytes: any parse error
        raise CorruptCheckpoint(f"{source}: unreadable checkpoint metadata "
                              f"({e.__class__.__name__}: {one_line(str(e).splitlines()[0] if str(e) else '')})") from None
    if not (isinstance(tree, _Made) and tree.cls.name == "Metadata"):
        raise CorruptCheckpoint(f"{source}: not DCP checkpoint metadata (holds {_describe(tree)})")
    try:
        md = _Rebuild(source, _VISITS_FLOOR + size // _BYTES_PER_VISIT).metadata(tree)
    except RecursionError:
        raise CorruptCheckpoint(f"{source}: unreadable checkpoint metadata (RecursionError)") from None
    for rel in storage_files(md):
        regular_file(Path(path).parent / rel)
    return md


def weights_only_reason(e: BaseException) -> str:
    """torch.load(weights_only=True)'s refusal is a paragraph; keep the line that names the global."""
    text = str(e)
    m = re.search(r"GLOBAL (\S+)", text)
    if m:
        return f"it names the global {one_line(m.group(1), 100)}, which a checkpoint never holds"
    if "torch.distributed.tensor" in text:  # torch's words for a DTensor, DeviceMesh or placement refused
        return ("it holds a torch.distributed.tensor object (a DTensor, DeviceMesh or placement such as Shard), "
                "which a checkpoint entry never holds")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("Check the documentation")
             and "In PyTorch 2.6" not in ln]
    return one_line(lines[-1] if lines else e.__class__.__name__)


# What torch.load(weights_only=True) may construct beyond torch's own fixed set (tensors,
# storages, dtypes, plain containers and numbers): nothing. torch's list of user-marked
# globals grows as modules are imported (torch.distributed.tensor adds DTensor and
# DeviceMesh, whose constructors reach process groups), so it is swapped for this one,
# distlm's own, for the length of each load.
WEIGHTS_ONLY_GLOBALS: tuple = ()
_PIN = threading.RLock()


@contextlib.contextmanager
def pinned_weights_only():
    """torch.load(weights_only=True) within accepts exactly torch's fixed set and
    WEIGHTS_ONLY_GLOBALS, whatever has been imported; the process's list is put back after."""
    from torch import serialization
    with _PIN, warnings.catch_warnings():
        # A crafted file's pickle protocol draws torch's multi-line warning before the refusal,
        # which is one line of its own.
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        saved = serialization.get_safe_globals()
        serialization.clear_safe_globals()
        serialization.add_safe_globals(list(WEIGHTS_ONLY_GLOBALS))
        try:
            yield
        finally:
            serialization.clear_safe_globals()
            serialization.add_safe_globals(saved)


def load_weights_only(source, what: str, limit: int = ENTRY_LIMIT):
    """torch.load(weights_only=True) of a file or stream of at most ``limit`` bytes (checked
    before any work), with the allow-list pinned (pinned_weights_only); a refused or
    unreadable one is a one-line CheckpointError naming ``what`` (the file, or the entry)."""
    try:
        if isinstance(source, io.BytesIO):
            size = source.getbuffer().nbytes
        elif isinstance(source, (str, os.PathLike)):
            size = os.stat(source).st_size
        else:  # another stream: torch reads it as it comes
            size = 0
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{what}: missing (the checkpoint is incomplete)") from None
    if size > limit:
        raise CorruptCheckpoint(f"{what}: {size:,} bytes, over the {limit >> 20} MB distlm reads for it "
                                f"(refused before reading)")
    try:
        with pinned_weights_only():
            return torch.load(source, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{what}: missing (the checkpoint is incomplete)") from None
    except pickle.UnpicklingError as e:
        raise CorruptCheckpoint(f"{what}: refused to load: {weights_only_reason(e)}") from None
    except Exception as e:
        raise CorruptCheckpoint(f"{what}: unreadable ({e.__class__.__name__}: {weights_only_reason(e)})") from None


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
