"""The output folder of ``prepare`` and ``merge``: whether it is up to date, its manifest, and
swapping a finished temporary folder in for it.

Kept apart so the text, pre-tokenized and merge paths finish a folder the same way: the same
manifest fields in the same order, and the same two renames that leave ``out_dir`` always
either the old complete data or the new.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path

from distlm.data import FORMAT_VERSION, MANIFEST, DataError
from distlm.data import tokenizer as tkz


def check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"{out_dir}: exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MANIFEST).is_file():
        raise DataError(f"{out_dir}: not empty and has no {MANIFEST}; refusing to replace it (choose another --out)")


def inputs_fingerprint(files: list[Path], options: dict) -> str:
    stamp = [(str(f.resolve()), st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()]]
    tok = tkz.gpt2().fingerprint() if options["tokenizer"] == "gpt2" else None
    blob = json.dumps([FORMAT_VERSION, options, tok, stamp], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def tokenizer_info(tok: tkz.Tokenizer) -> dict:
    return {"name": tok.name, "fingerprint": tok.fingerprint(), "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id, "file": None if tok.name == "gpt2" else "tokenizer.json"}


def write_manifest(tmp: Path, body: dict, *, sources: list[dict], fingerprint: str, options: dict, seed: int,
                   val_fraction: float) -> dict:
    """Write the finished folder's ``manifest.json`` into ``tmp``; returns it. The caller swaps
    ``tmp`` in: the text path must drop its journal in between."""
    manifest = {"format_version": FORMAT_VERSION, **body, "sources": sources, "inputs_fingerprint": fingerprint,
                "options": options, "seed": seed, "val_fraction": val_fraction,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def swap_in(tmp: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        os.replace(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)
