"""Lay out the time-to-loss corpus as plain-text documents for `distlm prepare`.

    python scripts/build_speedrun_corpus.py ../shared/data/corpus data/speedrun-text
    distlm prepare data/speedrun-text --out data/speedrun

Gutenberg books and State of the Union speeches are copied as they are (one document per
file). GCIDE comes as one dictzip file (gzip-readable); it is cut into documents of a few
hundred consecutive entries, so the per-document validation split of `prepare` holds out
whole runs of the dictionary rather than one 40 MB document or nothing. GCIDE is GPL: it is
prepared here, on the user's machine, and never vendored into the project.
"""
from __future__ import annotations

import gzip
import re
import shutil
import sys
from pathlib import Path

ENTRIES_PER_DOC = 400
# An entry starts at a line that is not indented, after a blank line (the dict format:
# headword line, then the indented definition).
ENTRY_START = re.compile(r"\n\n(?=\S)")


def gcide_documents(path: Path) -> list[str]:
    text = gzip.open(path, "rb").read().decode("utf-8", "replace")
    entries = [e.strip() for e in ENTRY_START.split(text) if e.strip()]
    return ["\n\n".join(entries[i:i + ENTRIES_PER_DOC]) + "\n" for i in range(0, len(entries), ENTRIES_PER_DOC)]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    src, out = Path(argv[0]), Path(argv[1])
    for name in ("gutenberg", "sotu", "gcide"):
        if not (src / name).is_dir():
            print(f"error: {src / name}: not found (expected the corpus folders gutenberg/, sotu/, gcide/)",
                  file=sys.stderr)
            return 2
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for name in ("gutenberg", "sotu"):
        (tmp / name).mkdir(parents=True)
        for f in sorted((src / name).glob("*.txt")):
            shutil.copyfile(f, tmp / name / f.name)
    (tmp / "gcide").mkdir()
    docs = gcide_documents(src / "gcide" / "gcide.dict.dz")
    for i, doc in enumerate(docs):
        (tmp / "gcide" / f"gcide-{i:05d}.txt").write_text(doc)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"wrote {out}: {sum(1 for _ in out.rglob('*.txt'))} documents ({len(docs)} from GCIDE)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
