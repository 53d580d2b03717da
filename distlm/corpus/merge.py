"""``merge``'s checks and sums over the part folders of ``prepare(..., shard="I/N")``.

Apart from ``prepare.merge`` itself so that the part checks (one job, every part once, shards
intact) read as one list, not mixed into the streaming.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from distlm.corpus.shards import COPY_BLOCK, Router
from distlm.corpus.sources import SourceStats
from distlm.corpus.split import SPLITS, TRAIN, VAL
from distlm.data import DataError, load_manifest, same_tokenizer, shards_present


def load_parts(paths: list[Path]) -> list[tuple[Path, dict]]:
    """The parts' manifests in part order; DataError unless they are parts 0..N-1 of one run."""
    loaded = []
    for path in paths:
        m = load_manifest(path, part_ok=True)
        if not isinstance(m.get("part"), dict):
            raise DataError(f"{path}: not a part (made by `distlm prepare --shard I/N`); nothing to merge")
        loaded.append((path, m))
    ref_path, ref = loaded[0]
    hint = "merge only the parts of one job (same inputs and options)"
    for path, m in loaded[1:]:
        if not same_tokenizer(m["tokenizer"], ref["tokenizer"]) or m["tokenizer"]["name"] != ref["tokenizer"]["name"]:
            raise DataError(f"{path}: tokenizer {m['tokenizer']['name']} differs from {ref_path}'s "
                            f"{ref['tokenizer']['name']}; {hint}")
        for opt in sorted(set(ref["options"]) | set(m["options"])):
            if m["options"].get(opt) != ref["options"].get(opt):
                raise DataError(f"{path}: prepared with {opt}={m['options'].get(opt)!r}, {ref_path} with "
                                f"{opt}={ref['options'].get(opt)!r}; {hint}")
        if m["part"]["count"] != ref["part"]["count"]:
            raise DataError(f"{path}: part {m['part']['index']}/{m['part']['count']}, but {ref_path} is part "
                            f"{ref['part']['index']}/{ref['part']['count']}; {hint}")
        if m["part"]["corpus_fingerprint"] != ref["part"]["corpus_fingerprint"]:
            raise DataError(f"{path}: prepared from other inputs than {ref_path} (the input files or their "
                            f"sizes or dates differ); {hint}")
    count, seen = ref["part"]["count"], {}
    for path, m in loaded:
        if m["part"]["index"] in seen:
            raise DataError(f"{path}: part {m['part']['index']}/{count} given twice (also {seen[m['part']['index']]})")
        seen[m["part"]["index"]] = path
        if not shards_present(path, m):
            raise DataError(f"{path}: shards missing or of the wrong size; prepare this part again")
    missing = [f"{i}/{count}" for i in range(count) if i not in seen]
    if missing:
        raise DataError(f"missing part(s) {', '.join(missing)}: merge needs all {count} parts")
    return sorted(loaded, key=lambda pm: pm[1]["part"]["index"])


def part_totals(loaded: list[tuple[Path, dict]]) -> dict:
    """Documents, tokens, statistics and sources summed over the parts in order, and the
    fallback candidates of the whole corpus (positions counted from its start)."""
    docs, tokens, stats, chars, n_bytes = [0, 0], [0, 0], SourceStats(), 0, 0
    best: dict = {"min_train": None, "max_val": None}
    sources = [dict(s, files=0, bytes=0) for s in loaded[0][1]["sources"]]
    for path, m in loaded:
        for name, split, better in (("min_train", TRAIN, lambda a, b: a < b), ("max_val", VAL, lambda a, b: a > b)):
            cand = m["part"].get(name)
            if cand is not None and (best[name] is None or better(cand[0], best[name][0])):
                best[name] = [cand[0], tokens[split] + cand[1], cand[2]]
        for split, name in enumerate(SPLITS):
            tokens[split] += m["splits"][name]["tokens"]
            docs[split] += m["splits"][name]["documents"]
        stats.add({k: v for k, v in m["stats"].items() if k not in ("chars", "text_bytes")})
        chars, n_bytes = chars + m["stats"]["chars"], n_bytes + m["stats"]["text_bytes"]
        if [s["path"] for s in m["sources"]] != [s["path"] for s in sources]:
            raise DataError(f"{path}: lists other inputs than {loaded[0][0]}; merge only the parts of one job")
        for total, s in zip(sources, m["sources"]):
            total["files"] += s["files"]
            total["bytes"] += s["bytes"]
    return {"docs": docs, "tokens": tokens, "stats": stats, "chars": chars, "bytes": n_bytes, "sources": sources,
            **best}


def feed_checked(path: Path, sha256: str, router: Router, bar) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(COPY_BLOCK):
            digest.update(block)
            router.feed(block)
            bar.update(len(block))
    if digest.hexdigest() != sha256:
        raise DataError(f"{path}: sha256 {digest.hexdigest()} does not match its manifest's {sha256}; "
                        f"prepare this part again")
