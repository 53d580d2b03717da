"""Rebuild distlm/assets/20news4/20news4.jsonl.xz from scikit-learn's 20 Newsgroups cache.

    python scripts/build_20news4.py ../shared/data/classify/20news-bydate_py3.pkz distlm/assets/20news4/20news4.jsonl.xz

Reads the `.pkz` without scikit-learn (zlib + pickle, with its Bunch mapped to dict),
strips headers, signature blocks and quoted lines the way scikit-learn's
``remove=("headers", "footers", "quotes")`` does (same rules, re-implemented here,
BSD-3 origin noted in distlm/assets/20news4/README.md), merges the 20 groups into the
4 coarse topics below, drops empty posts, and keeps the first MAX_CHARS characters of
each post (a classifier reading 128-256 tokens never sees more; it keeps the file ~3 MB).
"""
from __future__ import annotations

import io
import json
import lzma
import os
import pickle
import re
import sys
import zlib

MAX_CHARS = 1000
# AG News has World / Sports / Business / Sci-Tech; 20 Newsgroups' nearest 4-way cut.
TOPICS = {
    "comp": ["comp.graphics", "comp.os.ms-windows.misc", "comp.sys.ibm.pc.hardware", "comp.sys.mac.hardware",
             "comp.windows.x"],
    "rec": ["rec.autos", "rec.motorcycles", "rec.sport.baseball", "rec.sport.hockey"],
    "sci": ["sci.crypt", "sci.electronics", "sci.med", "sci.space"],
    "politics_religion": ["talk.politics.guns", "talk.politics.mideast", "talk.politics.misc", "talk.religion.misc",
                          "alt.atheism", "soc.religion.christian"],
}  # misc.forsale is dropped: it has no AG News counterpart
GROUP_TO_TOPIC = {g: t for t, groups in TOPICS.items() for g in groups}
_QUOTE = re.compile(r"(writes in|writes:|wrote:|says:|said:|^In article|^Quoted from|^\||^>)")


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith("sklearn") and name == "Bunch":
            return dict
        if module == "numpy.core.multiarray" or module.startswith("numpy"):
            return super().find_class(module.replace("numpy.core", "numpy._core"), name)
        raise pickle.UnpicklingError(f"refusing {module}.{name}")


def strip_header(text: str) -> str:
    return text.partition("\n\n")[2]


def strip_quotes(text: str) -> str:
    return "\n".join(line for line in text.split("\n") if not _QUOTE.search(line))


def strip_footer(text: str) -> str:
    """Drop everything after the last line made of dashes only (a signature block)."""
    lines = text.strip().split("\n")
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].strip().strip("-") == "":
            break
    return "\n".join(lines[:i]) if i > 0 else text


def rows(pkz: str):
    cache = _Unpickler(io.BytesIO(zlib.decompress(open(pkz, "rb").read()))).load()
    for split in ("train", "test"):
        bunch = cache[split]
        names = bunch["target_names"]
        for text, target in zip(bunch["data"], bunch["target"]):
            topic = GROUP_TO_TOPIC.get(names[int(target)])
            if topic is None:
                continue
            clean = strip_quotes(strip_footer(strip_header(text))).strip()
            clean = re.sub(r"\n{3,}", "\n\n", clean)[:MAX_CHARS]
            if clean:
                yield {"text": clean, "label": topic, "group": names[int(target)], "split": split}


def main(pkz: str, out: str) -> None:
    lines = [json.dumps(r, ensure_ascii=False) for r in rows(pkz)]
    tmp = out + ".tmp"
    with lzma.open(tmp, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}: {len(lines)} posts")


if __name__ == "__main__":
    main(*sys.argv[1:3])
