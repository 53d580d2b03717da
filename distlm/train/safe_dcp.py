"""Loading DCP checkpoints without running code from them.

torch.distributed.checkpoint reads a checkpoint's ``.metadata`` with plain ``pickle``
and its non-tensor entries (optimizer param_groups) with ``torch.load(weights_only=False)``:
a crafted checkpoint could execute anything on load. Here the metadata goes through an
unpickler that builds only DCP's own metadata classes and a few plain types, and byte
entries through ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

_ANY_NAME = {"torch.distributed.checkpoint.metadata"}
_NAMES = {
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "tuple", "list", "dict", "int", "float", "str", "bytes", "bool"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module in _ANY_NAME or name in _NAMES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a DCP checkpoint "
                                     f"never needs; refusing to load it")


class SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        if hasattr(self, "_get_metadata_path"):
            path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_load(state: dict, path) -> None:
    from distlm.train.checkpoint import CheckpointError
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP wraps rank failures in CheckpointException, a BaseException
        text = str(e)
        why = "it holds objects a checkpoint never needs (refused unpickling)" if (
            "Weights only load failed" in text or "refusing to load" in text) else text.strip().splitlines()[-1][:300]
        raise CheckpointError(f"{path}: cannot load this checkpoint: {why}") from None
