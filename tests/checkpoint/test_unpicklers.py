"""What a checkpoint's unpicklers may construct is distlm's own list, whatever else the
process has imported, and their work is bounded before it is done: a small crafted file is
refused fast, a large one before it is read."""
from __future__ import annotations

import io
import os
import pickle
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.metadata as dcp_md

from distlm.checkpoint import safe_dcp
from distlm.checkpoint.errors import CheckpointError


def placement():
    """An object of a class torch.distributed.tensor marks as safe for weights-only loads
    when it is imported (its DTensor and DeviceMesh come with it)."""
    from torch.distributed.tensor.placement_types import Shard
    return Shard(0)


def test_importing_torch_distributed_widens_torchs_own_list():
    """The premise: torch's list depends on what was imported, so distlm pins its own."""
    placement()
    names = {getattr(g, "__name__", str(g)) for g in torch.serialization.get_safe_globals()}
    assert {"DTensor", "DeviceMesh"} & names, names


@pytest.mark.parametrize("where", ["stream", "file"])
def test_a_class_torch_distributed_marks_safe_is_refused(where, tmp_path):
    buf = io.BytesIO()
    torch.save({"cpu": torch.zeros(4, dtype=torch.uint8), "extra": placement()}, buf)
    before = set(torch.serialization.get_safe_globals())
    source = io.BytesIO(buf.getvalue())
    if where == "file":
        source = tmp_path / "rank_00000.pt"
        source.write_bytes(buf.getvalue())
    with pytest.raises(CheckpointError) as e:
        safe_dcp.load_weights_only(source, "rng/rank_00000.pt")
    msg = str(e.value)
    assert "\n" not in msg and "Shard" in msg and "refused" in msg, msg
    assert set(torch.serialization.get_safe_globals()) == before  # the process's own list is put back


def test_plain_entries_still_load_with_the_list_pinned():
    buf = io.BytesIO()
    groups = [{"params": ["a.weight"], "lr": 0.1, "betas": (0.9, 0.95), "foreach": None}]
    torch.save({"groups": groups, "t": torch.arange(3)}, buf)
    out = safe_dcp.load_weights_only(io.BytesIO(buf.getvalue()), "entry")
    assert out["groups"] == groups and out["t"].tolist() == [0, 1, 2]


def test_an_oversized_entry_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "rank_00000.pt"
    with open(path, "wb") as f:
        f.truncate(safe_dcp.ENTRY_LIMIT + 1)
    t = time.perf_counter()
    with pytest.raises(CheckpointError, match="refused before reading"):
        safe_dcp.load_weights_only(path, str(path))
    assert time.perf_counter() - t < 1


def shared_metadata(entries: int, chunks: int) -> bytes:
    """DCP metadata in which every entry is the same TensorStorageMetadata of ``chunks``
    chunks: pickle's memo stores it once, a rebuild that follows each reference makes it
    ``entries`` times."""
    size = torch.Size([chunks])
    props = dcp_md.TensorProperties(dtype=torch.float32)
    shared = dcp_md.TensorStorageMetadata(properties=props, size=size, chunks=[
        dcp_md.ChunkStorageMetadata(offsets=torch.Size([i]), sizes=torch.Size([1])) for i in range(chunks)])
    md = dcp_md.Metadata(state_dict_metadata={f"w{i}": shared for i in range(entries)})
    return pickle.dumps(md, protocol=2)


@pytest.mark.parametrize("entries, chunks", [(10_000, 30_000), (100_000, 20)])
def test_a_small_file_naming_one_object_many_times_is_refused_fast(entries, chunks, tmp_path):
    data = shared_metadata(entries, chunks)
    assert len(data) < 3 << 20
    path = tmp_path / ".metadata"
    path.write_bytes(data)
    t = time.perf_counter()
    with pytest.raises(CheckpointError) as e:
        safe_dcp.read_dcp_metadata(path)
    took = time.perf_counter() - t
    assert "\n" not in str(e.value) and str(path) in str(e.value), str(e.value)
    assert took < 10, f"{took:.1f} s"  # about 1 s alone; hours when every reference is rebuilt


def test_an_oversized_metadata_file_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / ".metadata"
    with open(path, "wb") as f:
        f.truncate(safe_dcp.METADATA_LIMIT + 1)
    with pytest.raises(CheckpointError, match="refused before reading"):
        safe_dcp.read_dcp_metadata(path)


def test_a_real_sharded_layout_stays_within_the_budget(tmp_path):
    """Many tensors of many chunks each, none shared: what FSDP on many ranks writes."""
    md = dcp_md.Metadata(state_dict_metadata={
        f"layer{i}.w": dcp_md.TensorStorageMetadata(
            properties=dcp_md.TensorProperties(dtype=torch.bfloat16), size=torch.Size([64 * 256, 8]),
            chunks=[dcp_md.ChunkStorageMetadata(offsets=torch.Size([256 * r, 0]), sizes=torch.Size([256, 8]))
                    for r in range(64)]) for i in range(200)})
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(md))
    assert len(safe_dcp.read_dcp_metadata(path).state_dict_metadata) == 200
    assert os.path.getsize(path) > 100_000


@pytest.mark.parametrize("proto", [0, 5])
def test_a_raw_pickle_is_refused_in_one_line_without_torchs_warning(proto, recwarn):
    with pytest.raises(CheckpointError) as e:
        safe_dcp.load_weights_only(io.BytesIO(pickle.dumps({"a": 1}, protocol=proto)), "rng/rank_00000.pt")
    assert "\n" not in str(e.value)
    assert not [w for w in recwarn if "pickle protocol" in str(w.message)]
