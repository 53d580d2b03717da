"""Every shell command in README.md and docs/*.md, checked: what can run on a CPU runs, at a
tiny size; the rest is parsed and validated for the machine it names.

Collected from fenced blocks marked bash, sh, shell or console, or unmarked: each line (a
trailing backslash joins the next; `$ ` prompts and `# comments` are dropped) whose first word
(after VAR=value assignments) is a command in HEADS. Other lines in those blocks (program
output, file listings) are not commands. `...` stands for the rest of a command given above
it and is dropped; nothing else in a documented command may be a placeholder except the
paths in PLACEHOLDERS.

Every command is validated, in this process and without launching anything:
    distlm VERB ...       the real parser (flags, choices, overrides anywhere on the line); a
                          verb with a config: the config loads, the overrides apply, and it
                          validates, including its layout against the world size the line
                          states (torchrun --nproc_per_node x --nnodes, horovodrun -np, the
                          SLURM script's nodes x GPUs per node; 1 otherwise)
    torchrun / horovodrun / sbatch / srun   the same, for the distlm command they launch
    make TARGET           the Makefile has the target
    bash FILE, python FILE, python -m MODULE   the file or module ships
    python -c CODE        the code compiles
Then test_documented_commands_run runs the README's tour, in order, in a fresh folder, at a
tiny size (see adapt()), and the guides' commands that follow it on a CPU: the Hugging Face
export and load, the SLURM dry runs, `distlm plan`. What is not run is in NOT_RUN with the
reason; a command of a kind NOT_RUN does not cover must run or the test fails.
"""
from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from distlm.cli import _take_overrides, build_parser, main
from distlm.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
HEADS = {"distlm", "python", "python3", "make", "torchrun", "srun", "sbatch", "bash", "horovodrun", "tensorboard",
         "source"}
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
# Paths a documented command may name that stand for the reader's own files; validation
# sees an empty folder there.
PLACEHOLDERS = {
    "path/to/local/gpt2": "a Hugging Face GPT-2 folder the reader has",
    "/data/fineweb": "the reader's corpus",
    "my-text/": "the reader's own text",
    "news.csv": "the reader's labelled texts",
    "runs/my-lm": "a language-model run of the reader's, on GPT-2 tokens",
}
# Kinds of command that are validated but not run here, and why.
NOT_RUN = {
    "torchrun": "several processes, usually GPUs; the layouts run in tests/layout/test_data.py and "
                "tests/layout/test_tensor.py",
    "--nproc-per-node": "several processes, usually GPUs; tests/launch/test_local.py runs it on 2 CPU ranks",
    "horovodrun": "needs the Horovod build (make horovod); tests/parallel/test_horovod.py runs the engine",
    "sbatch": "needs a SLURM cluster; the dry run of the same script runs here, tests/launch/test_slurm.py the rest",
    "srun": "needs a SLURM cluster",
    "make": "make run is the demo (minutes), make test the whole suite, make horovod a build",
    "tensorboard": "starts a server; tests/train/test_logger.py reads the event files",
    "source": "changes the shell, not the project",
    "--interactive": "reads prompts from a terminal",
    "benchmarks/": "a GPU suite (docs/results/ has its figures)",
    "scripts/build_docs_corpus.py": "reads every installed package's sources (minutes on a small machine); "
                                    "benchmarks/tests/test_docs_corpus.py builds and prepares it at a tiny size",
    "-m gpu": "the CUDA-only tests",
    "GPU-sized": "a GPU-sized model or corpus (a 124M+ preset, a folder the reader prepares)",
}
GPU_PRESETS = {"gpt2-124m", "gpt2-124m-1024", "gpt2-355m", "gpt2-774m", "gpt2-1.5b", "llama-124m", "llama-7b",
               "speedrun-124m"}


@dataclasses.dataclass
class Command:
    page: str
    line: int
    text: str
    words: list[str]

    def __str__(self):
        return f"{self.page}:{self.line}: {self.text}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def commands_in(path: Path) -> list[Command]:
    out, block, lines = [], None, path.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"\s*```(\S*)", line)
        if fence:
            block = None if block is not None else fence.group(1)
            i += 1
            continue
        if block is None or block not in SHELL_BLOCKS:
            i += 1
            continue
        start, text = i + 1, line.strip()
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1].rstrip() + " " + lines[i].strip()
        i += 1
        text = text[2:] if text.startswith("$ ") else text
        text = text[:-1].rstrip() if text.endswith(" &") else text  # started in the background: the same command
        first = next((w for w in text.split() if not re.match(r"^[A-Z_][A-Z0-9_]*=", w)), "")
        if first not in HEADS:
            continue
        words = shlex.split(text, comments=True)
        page = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        out.append(Command(page, start, " ".join(text.split()), words))
    return out


def all_commands() -> list[Command]:
    return [c for p in pages() for c in commands_in(p)]


# ---- validation ------------------------------------------------------------------------

def _strip_env(words: list[str]) -> list[str]:
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]
    return words


def _take(words: list[str], names: tuple[str, ...], default=None):
    for i, w in enumerate(words):
        for n in names:
            if w == n and i + 1 < len(words):
                return words[i + 1]
            if w.startswith(n + "="):
                return w.split("=", 1)[1]
    return default


def _sbatch_defaults() -> dict[str, int]:
    text = (ROOT / "scripts/slurm/train.sbatch").read_text()
    return {k: int(v) for k, v in re.findall(r"^#SBATCH --(nodes|gpus-per-node)=(\d+)", text, re.M)}


def launched(words: list[str]) -> tuple[int, list[str], str]:
    """(world size, the distlm argv, the engine) of a command line."""
    words = _strip_env(words)
    head = words[0]
    if head == "torchrun":
        nproc = int(_take(words, ("--nproc_per_node", "--nproc-per-node"), "1"))
        nnodes = int(str(_take(words, ("--nnodes",), "1")).split(":")[-1])
        assert "-m" in words and words[words.index("-m") + 1] == "distlm", "torchrun must launch -m distlm"
        return nproc * nnodes, words[words.index("-m") + 2:], "torch"
    if head == "horovodrun":
        n = int(_take(words, ("-np",)))
        i = words.index("distlm")
        return n, words[i + 1:], "horovod"
    if head in ("python", "python3") and words[1:3] == ["-m", "distlm"]:
        return int(_take(words, ("--nproc-per-node",), "1")), words[3:], "torch"
    if head == "distlm":  # `distlm train --nproc-per-node N` starts N ranks itself
        return int(_take(words, ("--nproc-per-node",), "1")), words[1:], "torch"
    raise AssertionError(f"not a distlm command: {' '.join(words)}")


def validate_distlm(argv: list[str], world: int, engine: str = "torch") -> None:
    """Parse argv with the real parser; a verb with a config loads and validates it, its layout
    against `world` processes. Raises AssertionError with distlm's own message."""
    argv = [w for w in argv if w != "..."]
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            _take_overrides(parser.verb_parsers[args.verb], args, extra, argv)
    except SystemExit:
        raise AssertionError("the command line does not parse (the error is printed above)") from None
    if not hasattr(args, "overrides"):
        return
    config = getattr(args, "config", None)
    try:
        cfg = load_config(config, list(args.overrides))
        p = cfg.parallel
        if engine == "horovod" or p.engine == "horovod":
            product = p.dp_replicate * p.dp_shard * p.tp * p.pp  # Horovod: dp_replicate is -np
            if product not in (1, world):
                raise ConfigError(f"parallel degrees multiply to {product}, but horovodrun starts {world}")
        elif args.verb in ("train", "bench"):
            from distlm.layout import Layout
            from distlm.parallel.dims import ParallelDims
            ParallelDims(**Layout.of(p).degrees(), world_size=world)  # every axis of the registry
    except ConfigError as e:
        raise AssertionError(f"distlm refuses it with {world} process(es): {e}") from None


def validate(cmd: Command) -> None:
    words = _strip_env(cmd.words)
    for w in words:
        assert not (w.startswith("[") or w.endswith("]") or w == "|"), \
            f"{cmd}: `{w}`: a documented command must paste as written (give options on a line of their own)"
    head = words[0]
    if head in ("distlm", "torchrun", "horovodrun") or words[:3] in (["python", "-m", "distlm"],
                                                                     ["python3", "-m", "distlm"]):
        world, argv, engine = launched(words)
        validate_distlm(argv, world, engine)
    elif head == "sbatch":
        script = next(w for w in words[1:] if w.endswith(".sbatch"))
        assert (ROOT / script).is_file(), f"{cmd}: {script} does not ship"
        rest = words[words.index(script) + 1:]
        defaults = _sbatch_defaults()
        world = int(_take(words, ("--nodes", "-N"), defaults["nodes"])) * int(
            _take(words, ("--gpus-per-node",), defaults["gpus-per-node"]))
        validate_distlm(["train", "--config", rest[0], *rest[1:]], world)
    elif head == "bash":
        script = words[1]
        assert (ROOT / script).is_file(), f"{cmd}: {script} does not ship"
        p = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        if script.endswith(".sbatch"):  # its dry run: --nodes N --gpus-per-node G CONFIG [overrides]
            rest = [w for w in words[2:] if w != "--dry-run"]
            world = int(_take(rest, ("--nodes",))) * int(_take(rest, ("--gpus-per-node",)))
            rest = [w for i, w in enumerate(rest) if not (w.startswith("--") or (i and rest[i - 1].startswith("--")))]
            validate_distlm(["train", "--config", rest[0], *rest[1:]], world)
    elif head == "make":
        targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))
        assert words[1] in targets, f"{cmd}: the Makefile has no target {words[1]}"
    elif head in ("python", "python3") and words[1] == "-c":
        compile(words[2], str(cmd), "exec")
    elif head in ("python", "python3") and words[1] == "-m":
        import importlib.util
        assert importlib.util.find_spec(words[2]) is not None, f"{cmd}: no module {words[2]}"
    elif head in ("python", "python3"):
        assert (ROOT / words[1]).is_file(), f"{cmd}: {words[1]} does not ship"
    elif head == "source":
        assert Path(words[1]) in (Path(".venv/bin/activate"), ROOT / ".venv/bin/activate"), \
            f"{cmd}: the venv make creates is .venv"
    elif head == "tensorboard":
        assert _take(words, ("--logdir",), "").endswith("/tensorboard"), f"{cmd}: a run's tensorboard/ folder"
    else:
        raise AssertionError(f"{cmd}: the test does not know how to check `{head}`")


def in_repo(word: str, cwd: Path) -> str:
    """A path as the reader's shell sees it from the repository's root: a file that ships, a
    placeholder (an empty folder under cwd), or what an earlier command makes in cwd."""
    if word in PLACEHOLDERS:
        return str(cwd / word.lstrip("/"))
    key, eq, value = word.partition("=")
    if eq and value in PLACEHOLDERS:  # task.init_from=runs/my-lm
        return f"{key}={cwd / value.lstrip('/')}"
    if "/" in word and "=" not in word and not word.startswith("-") and ships(word):
        return str(ROOT / word)
    return word


def ships(word: str) -> bool:
    """Whether a fresh clone holds this path, also through a tracked link (configs/ is one)."""
    real = (ROOT / word).resolve()
    return word.rstrip("/") in shipped() or (real.is_relative_to(ROOT) and str(real.relative_to(ROOT)) in shipped())


@functools.lru_cache(maxsize=1)
def shipped() -> frozenset[str]:
    """The tracked files and the folders above them: what a fresh clone holds. A path that
    exists only because `make run` or an earlier test made it (data/, runs/, .venv/) is not
    one, so a command that makes it again is run in cwd as a reader's would be."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return frozenset(files) | {str(parent) for f in files for parent in Path(f).parents if str(parent) != "."}


def test_documented_commands_validate(tmp_path, monkeypatch):
    """Every documented command parses and validates where it says it runs (world size included)."""
    monkeypatch.chdir(tmp_path)
    for path in PLACEHOLDERS:
        (tmp_path / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
    commands = all_commands()
    pages_seen = {c.page for c in commands}
    assert "README.md" in pages_seen and len(commands) >= 20, pages_seen
    failures = []
    for cmd in commands:
        cmd.words = [in_repo(w, tmp_path) for w in cmd.words]
        try:
            validate(cmd)
        except AssertionError as e:
            failures.append(f"{cmd}\n    {e}")
        # What the command makes, for the commands after it (the tour's runs/first, say).
        made = _take(cmd.words, ("--out",)) or next(
            (f"runs/{w.split('=', 1)[1]}" for w in cmd.words if w.startswith("log.name=")), None)
        if made and not made.startswith("/"):
            (tmp_path / made).mkdir(parents=True, exist_ok=True)
    assert not failures, "documented commands that do not validate:\n" + "\n".join(failures)


def test_collector_reads_blocks_as_a_reader_does(tmp_path):
    """Continuations, prompts, comments, env assignments; output lines and other languages left out."""
    page = tmp_path / "page.md"
    page.write_text("```bash\n# a comment\ndistlm train --config tiny \\\n    train.max_steps=5   # why\n"
                    "CORPUS=x bash benchmarks/a.sh\n```\n```\n$ distlm plan --gpus 4\n| layout | fits |\n```\n"
                    "```python\ndistlm = 1\n```\n```yaml\nmake: x\n```\n")
    got = [(c.line, c.words) for c in commands_in(page)]
    assert got == [(3, ["distlm", "train", "--config", "tiny", "train.max_steps=5"]),
                   (5, ["CORPUS=x", "bash", "benchmarks/a.sh"]),
                   (8, ["distlm", "plan", "--gpus", "4"])], got


def test_validation_refuses_a_layout_that_does_not_fit_its_world_size():
    """The 4-GPU speed-run line with one micro-batch of 64 sequences: 64 is not a multiple of
    64 x 4 data-parallel ranks. With 16 per GPU it is; with 2 GPUs stated, 64 x 2 fails too."""
    bad = "torchrun --nproc_per_node 4 -m distlm train --config speedrun-124m parallel.dp_replicate=4 " \
          "train.global_batch_size=64 train.micro_batch_size=64 train.max_steps=300"
    with pytest.raises(AssertionError, match="must be a multiple of train.micro_batch_size=64 x data-parallel degree 4"):
        validate(Command("x", 1, bad, shlex.split(bad)))
    good = bad.replace("micro_batch_size=64", "micro_batch_size=16")
    validate(Command("x", 1, good, shlex.split(good)))
    with pytest.raises(AssertionError, match="world size is 2"):
        two = good.replace("--nproc_per_node 4", "--nproc_per_node 2")
        validate(Command("x", 1, two, shlex.split(two)))
    with pytest.raises(AssertionError, match="does not parse"):
        validate(Command("x", 1, "distlm train --max-steps 5", ["distlm", "train", "--max-steps", "5"]))
    with pytest.raises(AssertionError, match="paste as written"):
        validate(Command("x", 1, "", ["distlm", "train", "[parallel.tp=2]"]))


# ---- running ---------------------------------------------------------------------------

CORPUS = "distlm/assets/gutenberg/gutenberg.tar.xz"
LM_TINY = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=32",
           "train.global_batch_size=4", "train.micro_batch_size=4", "train.eval_batches=2", "log.samples=1",
           "train.device=cpu", "log.progress=false"]
CLASSIFY_TINY = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "train.max_steps=4",
                 "train.eval_every=0", "train.device=cpu", "log.progress=false"]
RUN_VERBS = {"prepare", "train", "eval", "generate", "plot", "bench", "plan", "export", "predict", "env"}


def tiny_corpus(out: Path) -> Path:
    """The first 30 KB of six of the vendored books, as a .tar.xz like the real one (preparing
    all of it takes minutes)."""
    with tarfile.open(ROOT / CORPUS, "r:xz") as src, tarfile.open(out, "w:xz") as dst:
        for n, member in enumerate(m for m in src if m.isfile()):
            if n == 6:
                break
            data = src.extractfile(member).read()[:30_000]
            info = tarfile.TarInfo(member.name)
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))
    return out


def tiny_news(cwd: Path, per_label: int = 40) -> Path:
    """The vendored 20 Newsgroups set cut to `per_label` posts of each topic and split: what
    `distlm train --config classify` prepares on first use here (all 17k posts, and an
    evaluation over 6,935, take minutes; tests/tasks/test_classify.py covers the whole set's path)."""
    import lzma
    from distlm.tasks.classify.data import DEFAULT_DATA
    kept, count = [], {}
    with lzma.open(DEFAULT_DATA, "rt") as f:
        for line in f:
            row = json.loads(line)
            key = (row["split"], row["label"])
            if count.get(key, 0) < per_label:
                count[key] = count.get(key, 0) + 1
                kept.append(line)
    out = cwd / "news-slice.jsonl"
    out.write_text("".join(kept))
    return out


def not_run_reason(words: list[str]) -> str | None:
    words = _strip_env(words)
    for key, why in NOT_RUN.items():
        if words[0] == key or key in words or (key.endswith("/") and any(w.startswith(key) for w in words)):
            return why
    if "-m" in words and "gpu" in words:
        return NOT_RUN["-m gpu"]
    config = _take(words, ("--config",))
    if config in GPU_PRESETS and not {"plan", "bench"} & set(words):  # bench: its CPU refusal is checked
        return NOT_RUN["GPU-sized"]
    if any(w in PLACEHOLDERS or w.partition("=")[2] in PLACEHOLDERS for w in words):
        return "names the reader's own files"
    return None


def adapt(argv: list[str], cwd: Path) -> list[str]:
    """The documented command at a tiny size, on the CPU."""
    verb = argv[0]
    args = [str(cwd / "tiny.tar.xz") if w == CORPUS else in_repo(w, cwd) for w in argv[1:]]
    if verb == "train" and ("classify" in args or "task=classify" in args):
        return [verb, *args, *CLASSIFY_TINY]
    if verb == "train":
        return [verb, *args, *LM_TINY, f"train.max_steps={6 if 'train.resume=auto' in args else 4}"]
    if verb == "generate":
        return [verb, *args, "--max-new-tokens", "16", "--device", "cpu"]
    if verb in ("eval", "predict"):
        return [verb, *args, "--device", "cpu"]
    return [verb, *args]


def check(argv: list[str], code: int, out: str, err: str, cwd: Path) -> None:
    """What the user should see from each verb."""
    verb = argv[0]
    if verb == "bench":  # a GPU-sized run on a CPU: one line, and what to run instead
        assert code == 2 and len(err.splitlines()) == 1 and "--config tiny" in err, err
        return
    assert code == 0, (argv, out[-2000:], err[-2000:])
    if verb == "prepare":
        assert re.search(rf"^prepared {re.escape(argv[argv.index('--out') + 1])}: train ", out, re.M), out
    elif verb == "train" and "classify" in argv:
        assert "accuracy" in out and "done: step 4" in out.splitlines()[-1], out
    elif verb == "train":
        steps = 6 if "train.resume=auto" in argv else 4
        if "train.resume=auto" in argv:
            assert "resumed from" in out, out
        assert re.search(rf"^done: step {steps}, val loss [\d.]+ on (all )?[\d,]+ blocks .*, checkpoint ", out, re.M), out
        assert f"samples at step {steps}" in out, out
    elif verb == "eval" and "classify" not in out:
        assert re.search(r"(val loss [\d.]+, perplexity [\d.]+ over|accuracy)", out), out
    elif verb == "generate" and "--out" in argv:
        written = cwd / argv[argv.index("--out") + 1]
        n = len(Path(argv[argv.index("--prompts-file") + 1]).read_text().splitlines())
        assert out.startswith(f"wrote {n} prompts x 1 samples to {argv[argv.index('--out') + 1]}"), out
        assert [json.loads(x)["index"] for x in written.read_text().splitlines()] == list(range(n))
    elif verb == "generate":
        prompt = argv[argv.index("--prompt") + 1]
        assert out.count("--- sample ") == int(argv[argv.index("--num-samples") + 1]), out
        assert out.count(prompt) == out.count("--- sample "), out
    elif verb == "plot":
        import matplotlib.image
        png = cwd / argv[argv.index("--out") + 1]
        assert out.startswith("wrote ") and matplotlib.image.imread(png).shape[0] > 100, out
    elif verb == "plan":
        assert "recommended:" in out, out
    elif verb == "predict":
        written = cwd / argv[argv.index("--out") + 1]
        assert len(written.read_text().splitlines()) >= 2, written.read_text()


INPUT_DESTS = ("inputs", "checkpoint", "input", "prompts_file", "data", "merge", "runs")
INPUT_OVERRIDES = ("data.dir", "task.init_from", "init.from_hf")


def inputs_named(argv: list[str]) -> list[str]:
    """The files and folders a distlm command reads, by its parser: what must exist before it runs."""
    parser = build_parser()
    args, extra = parser.parse_known_args([w for w in argv if w != "..."])
    if extra:
        _take_overrides(parser.verb_parsers[args.verb], args, extra, argv)
    found = []
    for dest in INPUT_DESTS:
        value = getattr(args, dest, None)
        found += [value] if isinstance(value, str) else list(value or [])
    for o in getattr(args, "overrides", []):
        key, _, value = o.partition("=")
        if key in INPUT_OVERRIDES and value not in ("", "null"):
            found.append(value)
    return found


def run_python_c(code: str, cwd: Path) -> None:
    exec(compile(code, "<documented python -c>", "exec"), {"__name__": "__main__"})


def test_documented_commands_run(tmp_path, monkeypatch, capsys):
    """The tour, then the guides' commands that fit a CPU, in page order, in one fresh folder,
    each at a tiny size. A command that names a file which neither ships nor was made by an
    earlier command fails here: the docs must paste as written."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    tiny_corpus(tmp_path / "tiny.tar.xz")
    from distlm.tasks.classify import data as classify_data
    monkeypatch.setattr(classify_data, "DEFAULT_DATA", tiny_news(tmp_path))
    ran, skipped, missing, took = [], [], [], []
    unavailable: set[str] = set()  # what commands that are not run would have made
    fixtures = {p.name for p in tmp_path.iterdir()}  # what this test put there (the tiny corpora)
    left_by_tour = None
    for cmd in all_commands():
        if left_by_tour is None and cmd.page != "README.md":  # the tour is done: what did it leave?
            left_by_tour = sorted(p.name + "/" * p.is_dir() for p in tmp_path.iterdir() if p.name not in fixtures)
        words = _strip_env(cmd.words)
        why = not_run_reason(words)
        out_dir = _take(words, ("--out",)) or next((w.split("=", 1)[1] for w in words if w.startswith("log.name=")), None)
        is_distlm = words[0] in ("distlm", "torchrun", "horovodrun") or words[1:3] == ["-m", "distlm"]
        needs = inputs_named(launched(words)[1]) if is_distlm else []
        if why is None and any(n in unavailable or any(n.startswith(u + "/") for u in unavailable) for n in needs):
            why = "needs what a command not run here makes"
        if why:
            skipped.append((cmd, why))
            if out_dir:
                unavailable.add(out_dir if "/" in out_dir else f"runs/{out_dir}")
            continue
        if words[0] in ("python", "python3") and words[1] == "-c":
            run_python_c(words[2], tmp_path)
            ran.append(cmd)
            continue
        if words[0] == "bash":  # the SLURM dry run: prints what each node would run, starts nothing
            p = subprocess.run(["bash", str(ROOT / words[1]), *words[2:]], capture_output=True, text=True, timeout=120,
                               env={**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
            assert p.returncode == 0 and "-m distlm train" in p.stdout, (str(cmd), p.stdout[-1000:], p.stderr[-1000:])
            ran.append(cmd)
            continue
        _, argv, _ = launched(words)
        assert argv[0] in RUN_VERBS, f"{cmd}: add it to NOT_RUN with the reason, or run it here"
        missing += [f"{cmd}: {path} neither ships nor is made by an earlier command"
                    for path in inputs_named(argv) if not (tmp_path / path).exists() and not (ROOT / path).exists()]
        argv = adapt(argv, tmp_path)
        capsys.readouterr()
        t = time.monotonic()
        code = main(argv)
        out, err = capsys.readouterr()
        check(argv, code, out, err, tmp_path)
        ran.append(cmd)
        took.append(f"  {time.monotonic() - t:5.1f} s  {cmd}")
    assert not missing, "\n".join(missing)
    # The tour writes under the folders a clone ignores (data/, runs/): nothing untracked in its root.
    untracked = [name for name in left_by_tour if subprocess.run(["git", "check-ignore", "-q", name], cwd=ROOT).returncode]
    assert left_by_tour and not untracked, f"the tour leaves {untracked} in the repository's root"
    with capsys.disabled():
        print(f"\ndocumented commands: {len(ran)} ran, {len(skipped)} validated only")
        print("\n".join(took))
        for cmd, why in skipped:
            print(f"  not run: {cmd}  ({why})")
    verbs = {launched(_strip_env(c.words))[1][0] for c in ran if _strip_env(c.words)[0] in ("distlm", "python")
             and _strip_env(c.words)[1] != "-c"}
    assert {"prepare", "train", "eval", "generate", "plot", "bench", "plan", "export", "predict"} <= verbs, verbs


# ---- links ---------------------------------------------------------------------------

RESULTS = ROOT / "docs" / "results"


def test_readme_links_every_guide_and_every_link_resolves():
    """The front page reaches every guide; no relative link in README.md or docs/*.md is dead.
    Anchors are checked against the target's headings (GitHub's slugs)."""
    readme = (ROOT / "README.md").read_text()
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", readme))
    guides = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    assert guides <= linked, f"guides the README does not link: {sorted(guides - linked)}"
    dead = []
    for page in pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() and RESULTS in file.parents and not RESULTS.exists():
                continue  # the results pages arrive with the benchmarks' reorganisation; checked once there
            if not file.exists():
                dead.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and file.suffix == ".md":
                slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                         for h in re.findall(r"^#+ (.*)$", file.read_text(), re.M)}
                if anchor not in slugs:
                    dead.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not dead, "dead links:\n" + "\n".join(dead)
