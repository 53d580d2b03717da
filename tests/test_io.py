"""Nothing distlm writes goes through a link: every file is made new (O_EXCL | O_NOFOLLOW,
under a random name) and renamed into place, so a symbolic or hard link at the target or at
any temporary name leaves the file it points at as it was. And a folder that holds no run
is never adopted as one, whatever train.resume says."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fault_harness import CLI_TINY  # noqa: E402

from distlm import io as dio  # noqa: E402
from distlm.config import ConfigError, load_config  # noqa: E402
from distlm.train.runlock import RunLock  # noqa: E402

SECRET = "do not write me\n"


def outside(tmp_path: Path, name: str = "precious.txt") -> Path:
    target = tmp_path / "outside" / name
    target.parent.mkdir(exist_ok=True)
    target.write_text(SECRET)
    return target


def link(kind: str, target: Path, at: Path) -> None:
    (os.symlink if kind == "symlink" else os.link)(target, at)


def assert_own_file(path: Path) -> None:
    """``path`` is a regular file of its own (not a link, no other name)."""
    st = os.lstat(path)
    assert not os.path.islink(path) and st.st_nlink == 1, path


# Every writer of distlm/io.py, as (name, write(path, text)).
WRITERS = {
    "atomic_write_text": lambda p, t: dio.atomic_write_text(p, t),
    "write_csv": lambda p, t: dio.write_csv(p, ["a"], [{"a": t.strip()}]),
    "atomic_append": lambda p, t: dio.atomic_append(p, t),
    "replace_and_keep": lambda p, t: dio.replace_and_keep(p, t).close(),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_link_at_the_target_is_replaced_never_written_through(writer, kind, tmp_path):
    target = outside(tmp_path)
    path = tmp_path / "run" / "file.txt"
    path.parent.mkdir()
    link(kind, target, path)
    if writer == "atomic_append" and kind == "symlink":  # it reads the old file first: never through a link
        with pytest.raises(ConfigError) as e:
            WRITERS[writer](path, "new\n")
        assert "\n" not in str(e.value) and "symbolic link" in str(e.value)
        assert target.read_text() == SECRET
        return
    WRITERS[writer](path, "new\n")
    assert target.read_text() == SECRET
    assert_own_file(path)
    assert "new" in path.read_text()


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_links_at_the_old_predictable_temporary_names_are_not_followed(writer, tmp_path):
    """The temporary name held the PID (readable in RUN/.lock): a link placed there took
    the write. Now the name is random, and created with O_EXCL."""
    target = outside(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    for name in (f".file.txt.tmp-{os.getpid()}", f".file.tmp-{os.getpid()}.png", ".file.txt.tmp"):
        os.symlink(target, run / name)
    WRITERS[writer](run / "file.txt", "new\n")
    assert target.read_text() == SECRET
    assert sorted(p.name for p in run.iterdir() if not p.is_symlink()) == ["file.txt"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "file.txt"
    path.write_text("old\n")
    with pytest.raises(RuntimeError):
        with dio.atomic_file(path) as f:
            f.write("half")
            raise RuntimeError("disk on fire")
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["file.txt"]


def test_new_files_get_the_mode_an_ordinary_open_gives(tmp_path):
    old = os.umask(0o022)
    try:
        dio.atomic_write_text(tmp_path / "a.txt", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_folder_swapped_in_whole_replaces_a_link(kind, tmp_path):
    target_dir = tmp_path / "outside"
    target_dir.mkdir()
    (target_dir / "keep.txt").write_text(SECRET)
    path = tmp_path / "tokenizer"
    if kind == "symlink":
        os.symlink(target_dir, path)
    else:
        path.mkdir()
        os.link(target_dir / "keep.txt", path / "keep.txt")
    dio.atomic_write_dir(path, lambda d: (d / "keep.txt").write_text("new"))
    assert (target_dir / "keep.txt").read_text() == SECRET
    assert not path.is_symlink() and (path / "keep.txt").read_text() == "new"


def test_write_new_refuses_a_name_placed_before_it(tmp_path):
    target = outside(tmp_path)
    os.symlink(target, tmp_path / "rank_00000.pt")
    with pytest.raises(FileExistsError):
        dio.write_new(tmp_path / "rank_00000.pt", b"x")
    assert target.read_text() == SECRET


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_plot_replaces_a_link_at_its_name(kind, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from distlm.report.plot import save_figure
    target = outside(tmp_path)
    link(kind, target, tmp_path / "loss.png")
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    save_figure(fig, tmp_path / "loss.png")
    assert target.read_text() == SECRET
    assert_own_file(tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_demo_samples_are_appended_by_replacement(tmp_path):
    from distlm.report.samples import append_samples
    target = outside(tmp_path)
    os.link(target, tmp_path / "samples.txt")
    append_samples(tmp_path / "samples.txt", 3, "h", ["p"], ["t1", "t2"])
    assert target.read_text() == SECRET
    text = (tmp_path / "samples.txt").read_text()
    assert text.startswith(SECRET) and "=== step 3 === h" in text and "pt2" in text


# ---- the training logger: metrics.csv and samples.txt -------------------------------------
def logger(run: Path, step: int = 0):
    from distlm.train.logger import RunLogger
    cfg = load_config("tiny", ["log.tensorboard=false"])
    return RunLogger(run, cfg, enabled=True, resume_step=step)


@pytest.mark.parametrize("name", ["metrics.csv", "samples.txt"])
@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_links_placed_while_the_logger_runs_are_never_written_through(name, kind, tmp_path):
    """A process writing in the run folder swaps a link in after the logger started: rows,
    the merge of the final evaluation and samples still go only to the run's own files."""
    run = tmp_path / "run"
    run.mkdir()
    log = logger(run)
    log.log(1, {"loss": 2.0, "elapsed_s": 1.0})
    target = outside(tmp_path)
    (run / name).unlink(missing_ok=True)
    link(kind, target, run / name)
    log.log(2, {"loss": 1.5, "elapsed_s": 2.0})
    log.log(2, {"val_loss": 1.4})  # merged into step 2's row: the file rewritten whole
    log.samples(2, "h", "p", ["a", "b"])
    log.log(3, {"loss": 1.2, "elapsed_s": 3.0})
    log.close()
    assert target.read_text() == SECRET
    rows = dio.read_csv(run / "metrics.csv")
    assert [r["step"] for r in rows] == ["1", "2", "3"] and rows[1]["val_loss"] == "1.4"


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_resume_over_linked_run_files_writes_new_ones(kind, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    metrics = outside(tmp_path, "metrics.csv")
    metrics.write_text("step,loss\n1,2.0\n2,1.0\n")
    samples = outside(tmp_path, "samples.txt")
    samples.write_text("=== step 1 === h\nx\n=== step 5 === h\ny\n")
    link(kind, metrics, run / "metrics.csv")
    link(kind, samples, run / "samples.txt")
    if kind == "symlink":
        with pytest.raises(ConfigError) as e:
            logger(run, step=1)
        assert "\n" not in str(e.value) and "symbolic link" in str(e.value)
    else:
        log = logger(run, step=1)
        log.log(2, {"loss": 0.5})
        log.samples(2, "h", "p", ["z"])
        log.close()
        assert [r["step"] for r in dio.read_csv(run / "metrics.csv")] == ["1", "2"]
        assert "=== step 5" not in (run / "samples.txt").read_text()
    assert metrics.read_text() == "step,loss\n1,2.0\n2,1.0\n"
    assert samples.read_text() == "=== step 1 === h\nx\n=== step 5 === h\ny\n"


@pytest.mark.parametrize("content", [b"step,loss\nnot-a-step,1\n2,1.0\n", b"step,elapsed_s\n1,abc\n",
                                     b"\xff\xfe binary", b"step\n" + b"x" * 200_000 + b"\n"])
def test_a_damaged_metrics_csv_on_resume_is_one_line_or_harmless(content, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_bytes(content)
    try:
        log = logger(run, step=5)
    except ConfigError as e:
        assert "\n" not in str(e) and "metrics.csv" in str(e)
        return
    log.log(6, {"loss": 1.0})
    log.close()
    assert dio.read_csv(run / "metrics.csv")[-1]["step"] == "6"
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) <= 1


def test_a_damaged_samples_txt_on_resume_is_kept_readable(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "samples.txt").write_bytes(b"=== step 1 === h\n\xff\xfe\n=== step 9 === h\nlater\n")
    log = logger(run, step=2)
    log.close()
    text = (run / "samples.txt").read_text()
    assert "=== step 1" in text and "=== step 9" not in text


# ---- a folder that holds no run is never adopted ------------------------------------------
def foreign_folder(path: Path) -> dict:
    """A folder of someone else's files, a config.yaml and a metrics.csv among them; returns
    its content to compare after."""
    path.mkdir(parents=True, exist_ok=True)
    files = {"config.yaml": "theirs: 1\n", "metrics.csv": "their,columns\n", "notes.txt": SECRET}
    for name, text in files.items():
        (path / name).write_text(text)
    return files


def content(path: Path) -> dict:
    return {p.name: p.read_text() for p in path.iterdir() if p.is_file() and p.name != ".lock"}


def train(root: Path, *extra: str) -> list[str]:
    return ["train", *CLI_TINY, "train.max_steps=2", f"log.root={root}", *extra]


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("resume", ["auto", "never"])
@pytest.mark.parametrize("how", ["named", "dot", "symlink"])
def test_a_folder_that_holds_no_run_is_refused_and_left_as_it_was(how, resume, tmp_path, capsys):
    from distlm.cli import main
    root = tmp_path / "runs"
    if how == "named":
        folder = root / "r"
        name = "r"
    elif how == "dot":
        folder = root
        name = "."
    else:
        folder = tmp_path / "elsewhere"
        root.mkdir()
        os.symlink(folder, root / "r")
        name = "r"
    files = foreign_folder(folder)
    if how == "dot":
        (root / "another-run").mkdir()
    assert main(train(root, f"log.name={name}", f"train.resume={resume}")) == 2
    msg = one_error(capsys)
    # log.name=. is refused by the config itself (a run name is one folder under log.root)
    said = ("log.name='.': a run name is one folder name",) if how == "dot" else ("no distlm run", "already exists")
    assert any(s in msg for s in said), msg
    assert content(folder) == files


@pytest.mark.parametrize("config_yaml", [None, "theirs: 1\n", "- a list\n", "model: {n_layer: 2\n", b"\xff\xfe"])
def test_the_lock_refuses_a_folder_without_a_distlm_run(config_yaml, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "data.bin").write_bytes(b"\0" * 8)
    if config_yaml is not None:
        (run / "config.yaml").write_bytes(config_yaml if isinstance(config_yaml, bytes) else config_yaml.encode())
    with pytest.raises(ConfigError) as e:
        RunLock(run).acquire()
    assert "\n" not in str(e.value) and str(run) in str(e.value) and "no distlm run" in str(e.value)
    assert (run / "data.bin").read_bytes() == b"\0" * 8


@pytest.mark.parametrize("layout", ["empty", "slurm-only", "config", "checkpoint"])
def test_a_new_or_distlm_run_folder_is_still_taken(layout, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    if layout == "slurm-only":
        (run / "slurm").mkdir()
        (run / "slurm" / "job_1_attempt_0.json").write_text("{}")
    elif layout == "config":
        (run / "config.yaml").write_text("model:\n  n_layer: 2\ntrain:\n  max_steps: 3\n")
        (run / "metrics.csv").write_text("step\n")
    elif layout == "checkpoint":
        (run / "checkpoints" / "step_0000002").mkdir(parents=True)
        (run / "checkpoints" / "step_0000002" / "distlm.json").write_text("{}")
    RunLock(run).acquire().release()
