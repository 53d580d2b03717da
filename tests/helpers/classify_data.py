"""A toy 4-topic classification set (topic words in shared filler) and the tiny classifier
config, for tests/tasks/test_classify.py and tests/cli/test_outputs.py."""
from __future__ import annotations

import csv
import random
from pathlib import Path

TOPICS = {
    "sport": "goal match team score coach league season player win referee stadium ball".split(),
    "tech": "software computer chip network code server laptop program disk memory keyboard screen".split(),
    "space": "orbit rocket planet moon launch star galaxy telescope nasa comet shuttle satellite".split(),
    "health": "doctor patient disease vaccine hospital medicine nurse therapy virus clinic drug surgery".split(),
}
FILLER = "the a of and to in is was it for on that with as at by this from or be were".split()
TINY = ["task=classify", "model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.d_ff=64",
        "model.block_size=24", "model.position=learned", "model.tie_embeddings=false", "optim.adamw.lr=3e-3",
        "train.min_lr_ratio=0.1", "train.warmup_steps=2", "log.progress=false", "log.tensorboard=false"]


def toy_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = list(TOPICS)[i % 4]
        words = [rng.choice(TOPICS[label]) for _ in range(rng.randint(2, 4))]
        words += [rng.choice(FILLER) for _ in range(rng.randint(2, 14))]
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "topic": label})
    return rows


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path
