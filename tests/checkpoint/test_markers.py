"""The checkpoint marker's own checksum covers every field a resume reads: the step, the
trainer state (its step, the loader's step and order, tokens seen, the schedule clock,
best and protected checkpoints), the config and the file checksums. An edit of one
character of any of them is refused in one line, and resume=auto falls back to the
checkpoint before."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fault_harness import CLI_TINY  # noqa: E402

from distlm.checkpoint import store as ckpt  # noqa: E402
from distlm.checkpoint.errors import CorruptCheckpoint  # noqa: E402
from distlm.checkpoint.verify import SEAL  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    from distlm.cli import main
    root = tmp_path_factory.mktemp("runs")
    assert main(["train", *CLI_TINY, "train.max_steps=4", "train.checkpoint_every=2", f"log.root={root}",
                 "log.name=r"]) == 0
    return root / "r"


def leaves(tree, prefix=()):
    if isinstance(tree, dict) and tree:
        for k, v in tree.items():
            yield from leaves(v, (*prefix, k))
    elif isinstance(tree, list) and tree:
        for i, v in enumerate(tree):
            yield from leaves(v, (*prefix, i))
    else:
        yield prefix, tree


def one_character_off(v):
    """``v`` changed by one character of its JSON text (a digit, a letter), same type where
    the type allows it."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1 if v % 10 != 9 else v - 1
    if isinstance(v, float):
        text = repr(v)
        i = max(i for i, c in enumerate(text) if c.isdigit())
        return float(text[:i] + ("1" if text[i] != "1" else "2") + text[i + 1:])
    if isinstance(v, str):
        return (v[:-1] + ("x" if v[-1:] != "x" else "y")) if v else "x"
    return 0  # null


def fields_a_resume_reads(meta: dict) -> list[tuple]:
    out = [("step",)] + [("trainer", *p) for p, _ in leaves(meta["trainer"])]
    out += [p for p, _ in leaves({"files": meta["files"]})][:3]
    return out


def test_the_field_list_holds_the_trainer_state(trained):
    meta = ckpt.read_meta(trained / "checkpoints" / "step_0000004", resume=True)
    names = {".".join(map(str, p)) for p in fields_a_resume_reads(meta)}
    assert {"step", "trainer.step", "trainer.tokens_seen"} <= names
    assert any(n.startswith("trainer.loader.") for n in names), names


def edit(folder: Path, path: tuple) -> None:
    meta = json.loads((folder / ckpt.MARKER).read_text())
    node = meta
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = one_character_off(node[path[-1]])
    (folder / ckpt.MARKER).write_text(json.dumps(meta, indent=1))  # not resealed


def test_every_field_a_resume_reads_is_covered(trained, tmp_path):
    import shutil
    base = trained / "checkpoints" / "step_0000004"
    meta = json.loads((base / ckpt.MARKER).read_text())
    assert SEAL in meta
    checked = 0
    for path in fields_a_resume_reads(meta):
        folder = tmp_path / f"c{checked}" / "step_0000004"
        shutil.copytree(base, folder)
        edit(folder, path)
        with pytest.raises(CorruptCheckpoint) as e:
            ckpt.read_meta(folder, resume=True)
        msg = str(e.value)
        assert "\n" not in msg and str(folder / ckpt.MARKER) in msg, (path, msg)
        checked += 1
    assert checked >= 6


def test_an_edited_step_falls_back_on_resume_auto_and_is_refused_by_name(trained, tmp_path, capsys):
    import shutil
    from distlm.cli import main
    run = tmp_path / "runs" / "r"
    shutil.copytree(trained, run)
    newest = run / "checkpoints" / "step_0000004"
    edit(newest, ("trainer", "tokens_seen"))
    capsys.readouterr()
    code = main(["train", *CLI_TINY, "train.max_steps=4", "train.checkpoint_every=2", f"log.root={run.parent}",
                 "log.name=r", f"train.resume={newest}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and SEAL in err[0], err
    said = []
    assert ckpt.resume_target("auto", run, say=said.append) == run / "checkpoints" / "step_0000002"
    assert any("skipping corrupt checkpoint" in s and SEAL in s for s in said), said


def test_an_updated_marker_is_resealed(trained, tmp_path):
    import shutil
    folder = tmp_path / "checkpoints" / "step_0000004"
    shutil.copytree(trained / "checkpoints" / "step_0000004", folder)
    ckpt.update_meta(folder, val_loss=1.25, trainer={**ckpt.read_meta(folder)["trainer"], "best_val": 1.25})
    assert ckpt.read_meta(folder, resume=True)["trainer"]["best_val"] == 1.25


def test_a_marker_saved_before_markers_were_sealed_still_reads(trained, tmp_path):
    import shutil
    folder = tmp_path / "checkpoints" / "step_0000004"
    shutil.copytree(trained / "checkpoints" / "step_0000004", folder)
    meta = json.loads((folder / ckpt.MARKER).read_text())
    del meta[SEAL]
    (folder / ckpt.MARKER).write_text(json.dumps(meta))
    assert ckpt.read_meta(folder, resume=True)["step"] == 4
