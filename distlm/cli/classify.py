"""The classifier's verbs: `distlm eval` of a classifier checkpoint and `distlm predict`.

    distlm eval --checkpoint RUN_OR_CKPT [--data DIR] [--split val|train] [--json]
    distlm predict --checkpoint RUN_OR_CKPT --input FILE [--text-field F] [--out F.csv|F.jsonl]

Their flags are parsed in distlm/cli/verbs.py (``evaluate``, ``predict``), which lands here:
this module reads the files, prints and returns the exit status; the model's work is in
distlm/tasks/classify/ (predict.py, metrics.py, data.py). ``distlm prepare --task classify``
calls ``distlm.tasks.classify.data.prepare_classify`` directly.
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Optional

import numpy as np

from distlm.config import ConfigError
from distlm.data import DataError


def evaluate_classifier(checkpoint: str, *, data: Optional[str], split: str, device: str, as_json: bool) -> int:
    """Accuracy, macro-F1 and the confusion matrix (text and PNG) of a classifier checkpoint."""
    from distlm.device import resolve_device
    from distlm.io import atomic_write_text
    from distlm.model.load import load_trained
    from distlm.tasks.classify.data import load_manifest, load_split
    from distlm.tasks.classify.metrics import confusion_text, plot_confusion, scores
    from distlm.tasks.classify.predict import predict_probs, run_folder
    dev = resolve_device(device)
    loaded = load_trained(checkpoint, dev, task="classify")
    folder, labels = loaded.folder, loaded.labels["labels"]
    data_dir = Path(data or loaded.cfg.data.dir or "")
    manifest = load_manifest(data_dir)
    if manifest["labels"] != labels:
        raise DataError(f"{data_dir}: labels {manifest['labels']} differ from the model's {labels}")
    rows = load_split(data_dir, manifest, split)
    if not len(rows["labels"]):
        raise DataError(f"{data_dir}: the '{split}' split is empty")
    probs = predict_probs(loaded.model, rows["tokens"], rows["lengths"], dev, desc="eval")
    confusion = np.zeros((len(labels), len(labels)), dtype=np.int64)
    np.add.at(confusion, (rows["labels"], probs.argmax(1)), 1)
    result = {"checkpoint": str(folder), "data": str(data_dir), "split": split, **scores(confusion),
              "labels": labels, "confusion": confusion.tolist()}
    run_dir = run_folder(folder)
    png = plot_confusion(confusion, labels, run_dir / f"confusion-{split}.png",
                         f"{split}: accuracy {result['accuracy']:.3f}, macro-F1 {result['macro_f1']:.3f}")
    result["confusion_png"] = str(png)
    atomic_write_text(run_dir / f"eval-{split}.json", json.dumps(result, indent=1))
    if as_json:
        print(json.dumps(result))
    else:
        print(f"{folder}: {split} accuracy {result['accuracy']:.4f}, macro-F1 {result['macro_f1']:.4f} over "
              f"{result['examples']:,} examples (majority class {result['majority_baseline']:.4f})\n"
              f"{confusion_text(confusion, labels)}\nwrote {png}")
    return 0


def predict_texts(checkpoint: str, input: str, *, text_field: str, out: Optional[str], batch_size: int,
                  device: str) -> int:
    """`distlm predict`: each text's label and class probabilities, written to ``out`` or
    else into the run folder."""
    from distlm.data.tokenizer import load_tokenizer
    from distlm.device import resolve_device
    from distlm.io import atomic_write_text
    from distlm.model.load import load_trained
    from distlm.tasks.classify.data import Row, encode_rows, read_texts
    from distlm.tasks.classify.predict import predict_probs, run_folder
    src = Path(input)
    if out and Path(out).suffix not in (".csv", ".jsonl"):
        raise ConfigError(f"--out {out}: the suffix must be .csv or .jsonl")
    dev = resolve_device(device)
    loaded = load_trained(checkpoint, dev, task="classify")
    # Without --out the predictions go with the model that made them, never beside the input
    # (which may be a shared or read-only folder).
    dest = Path(out) if out else run_folder(loaded.folder) / f"{src.name}.predictions.csv"
    info = loaded.labels
    rows = read_texts(src, text_field)
    labels = info["labels"]
    arrays = encode_rows([Row(r.text, labels[0], None, r.where) for r in rows], labels,
                         load_tokenizer(info["tokenizer"]["name"]), int(info["max_len"]))
    probs = predict_probs(loaded.model, arrays["tokens"], arrays["lengths"], dev, batch_size)
    pred = probs.argmax(1)
    if dest.suffix == ".jsonl":
        text = "".join(json.dumps({"index": i, "label": labels[k], "probs": dict(zip(labels, map(float, p)))}) + "\n"
                       for i, (k, p) in enumerate(zip(pred, probs)))
    else:
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["index", "label"] + [f"prob_{name}" for name in labels])
        for i, (k, p) in enumerate(zip(pred, probs)):
            w.writerow([i, labels[k]] + [f"{float(v):.6f}" for v in p])
        text = buf.getvalue()
    dest.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(dest, text)
    print(f"wrote {len(rows):,} predictions to {dest} ({loaded.folder})")
    return 0
