"""The classification verbs: `prepare --task classify`, `eval` of a classifier, `predict`.

    distlm prepare --task classify INPUT... --out DIR [--text-field F] [--label-field F] [--max-len N]
                   [--val-input FILE | --split-field F | --val-fraction P] [--seed S]
    distlm eval --checkpoint RUN_OR_CKPT [--data DIR] [--split val|train] [--json]
    distlm predict --checkpoint RUN_OR_CKPT --input FILE [--text-field F] [--out F.csv|F.jsonl]
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import torch

from distlm.config import ConfigError
from distlm.data import DataError


def add_prepare_args(s) -> None:
    s.add_argument("--task", default="lm", choices=["lm", "classify"],
                   help="classify: labelled rows -> padded token arrays + label map")
    s.add_argument("--label-field", default="label", help="classify: label column")
    s.add_argument("--max-len", type=int, default=128, help="classify: tokens kept per text (truncate, then pad)")
    s.add_argument("--val-input", default=None, help="classify: a file with the held-out rows")
    s.add_argument("--split-field", default="split",
                   help="classify: a column saying train or val/test, used when the data has it")


def cmd_prepare_classify(args) -> int:
    from distlm.tasks.classify.data import prepare_classify
    prepare_classify(args.inputs, Path(args.out), text_field=args.text_field, label_field=args.label_field,
                     max_len=args.max_len, val_input=args.val_input, split_field=args.split_field or None,
                     val_fraction=args.val_fraction, seed=args.seed, tokenizer=args.tokenizer)
    return 0


def checkpoint_task(path: str) -> str:
    """The task a checkpoint was trained for ("lm" for runs older than the task section)."""
    from distlm.train import checkpoint as ckpt
    meta = ckpt.read_meta(ckpt.resolve_checkpoint(path))
    return (meta.get("config", {}).get("task") or {}).get("name", "lm")


def load_classifier(path: str | Path, device: torch.device | str = "cpu"):
    """RUN_OR_CKPT -> (classifier in eval mode, config, checkpoint folder, label info)."""
    from distlm.config import config_from_dict
    from distlm.tasks.classify.model import Classifier
    from distlm.train import checkpoint as ckpt
    folder = ckpt.resolve_checkpoint(path)
    cfg = config_from_dict(ckpt.read_meta(folder)["config"])
    info = _label_info(folder, cfg)
    with torch.device("meta"):
        model = Classifier(cfg.model, len(info["labels"]), cfg.task.pooling, cfg.task.attention)
    model.to_empty(device=device)
    model.init_buffers(torch.device(device))
    ckpt.load_checkpoint(folder, model)
    return model.eval(), cfg, folder, info


def _label_info(folder: Path, cfg) -> dict:
    from distlm.data import read_json
    for candidate in (folder.parent.parent / "labels.json", Path(cfg.data.dir or "") / "labels.json"):
        info = read_json(candidate)
        if info and "labels" in info:
            return info
    raise ConfigError(f"{folder}: no labels.json in its run folder or in data.dir={cfg.data.dir}")


@torch.no_grad()
def predict_probs(model, tokens: np.ndarray, lengths: np.ndarray, device, batch_size: int = 64) -> np.ndarray:
    """Probabilities (N, C), batch by batch, each batch trimmed to its longest row."""
    from distlm.tasks.classify.loader import make_batch
    out = []
    for s in range(0, len(lengths), batch_size):
        batch = make_batch(tokens[s:s + batch_size], lengths[s:s + batch_size]).to(device)
        out.append(torch.softmax(model(batch).float(), -1).cpu().numpy())
    return np.concatenate(out)


def cmd_eval_classify(args) -> int:
    from distlm.tasks.classify.data import load_manifest, load_split
    from distlm.tasks.classify.metrics import confusion_text, plot_confusion, scores
    from distlm.train.checkpoint import atomic_write_text
    from distlm.train.setup import resolve_device
    device = resolve_device(args.device)
    model, cfg, folder, info = load_classifier(args.checkpoint, device)
    data_dir = Path(args.data or cfg.data.dir or "")
    manifest = load_manifest(data_dir)
    if manifest["labels"] != info["labels"]:
        raise DataError(f"{data_dir}: labels {manifest['labels']} differ from the model's {info['labels']}")
    split = load_split(data_dir, manifest, args.split)
    if not len(split["labels"]):
        raise DataError(f"{data_dir}: the '{args.split}' split is empty")
    probs = predict_probs(model, split["tokens"], split["lengths"], device)
    C = len(info["labels"])
    confusion = np.zeros((C, C), dtype=np.int64)
    np.add.at(confusion, (split["labels"], probs.argmax(1)), 1)
    result = {"checkpoint": str(folder), "data": str(data_dir), "split": args.split, **scores(confusion),
              "labels": info["labels"], "confusion": confusion.tolist()}
    run_dir = folder.parent.parent
    png = plot_confusion(confusion, info["labels"], run_dir / f"confusion-{args.split}.png",
                         f"{args.split}: accuracy {result['accuracy']:.3f}, macro-F1 {result['macro_f1']:.3f}")
    result["confusion_png"] = str(png)
    atomic_write_text(run_dir / f"eval-{args.split}.json", json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{folder}: {args.split} accuracy {result['accuracy']:.4f}, macro-F1 {result['macro_f1']:.4f} over "
              f"{result['examples']:,} examples (majority class {result['majority_baseline']:.4f})\n"
              f"{confusion_text(confusion, info['labels'])}\nwrote {png}")
    return 0


def add_predict_parser(sub) -> None:
    s = sub.add_parser("predict", help="label texts with a classifier; writes labels and probabilities",
                       description="Texts from a .txt file (one per line) or a column of .csv/.tsv/.jsonl/.parquet "
                       "(optionally .gz/.xz). Output: CSV (index,label,prob_<label>...) or JSONL "
                       "({index, label, probs}), by the --out suffix.")
    s.add_argument("--checkpoint", required=True, metavar="RUN_OR_CKPT")
    s.add_argument("--input", required=True, help="texts to label")
    s.add_argument("--text-field", default="text", help="text column of csv/jsonl/parquet inputs")
    s.add_argument("--out", default=None, help="F.csv or F.jsonl (default: INPUT.predictions.csv)")
    s.add_argument("--batch-size", type=int, default=64)
    s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    s.set_defaults(fn=cmd_predict)


def cmd_predict(args) -> int:
    from distlm.data.tokenizer import load_tokenizer
    from distlm.tasks.classify.data import Row, encode_rows, read_texts
    from distlm.train.checkpoint import atomic_write_text
    from distlm.train.setup import resolve_device
    src = Path(args.input)
    out = Path(args.out) if args.out else src.with_name(src.name + ".predictions.csv")
    if out.suffix not in (".csv", ".jsonl"):
        raise ConfigError(f"--out {out}: the suffix must be .csv or .jsonl")
    if checkpoint_task(args.checkpoint) != "classify":
        raise ConfigError(f"--checkpoint {args.checkpoint}: a language model, not a classifier (task.name=lm)")
    device = resolve_device(args.device)
    model, cfg, folder, info = load_classifier(args.checkpoint, device)
    rows = read_texts(src, args.text_field)
    tok = load_tokenizer(info["tokenizer"]["name"])
    labels = info["labels"]
    arrays = encode_rows([Row(r.text, labels[0], None, r.where) for r in rows], labels, tok, int(info["max_len"]))
    probs = predict_probs(model, arrays["tokens"], arrays["lengths"], device, args.batch_size)
    pred = probs.argmax(1)
    if out.suffix == ".jsonl":
        text = "".join(json.dumps({"index": i, "label": labels[k], "probs": dict(zip(labels, map(float, p)))}) + "\n"
                       for i, (k, p) in enumerate(zip(pred, probs)))
    else:
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["index", "label"] + [f"prob_{name}" for name in labels])
        for i, (k, p) in enumerate(zip(pred, probs)):
            w.writerow([i, labels[k]] + [f"{float(v):.6f}" for v in p])
        text = buf.getvalue()
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)
    print(f"wrote {len(rows):,} predictions to {out} ({folder})")
    return 0
