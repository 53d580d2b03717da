"""README's "A 5-minute tour", run as written, in order, at a tiny size on CPU (issue 17).

The commands are read from the first ```bash block under "## A 5-minute tour", so this
test fails when the README and the commands drift apart. Each runs as `python -m distlm`
of this tree through pipes, in a fresh folder (so data/ and runs/ land there, as they
would for a user), with CUDA hidden. What is changed, and why:

    the corpus          distlm/assets/gutenberg/gutenberg.tar.xz -> a .tar.xz of the first
                        30 KB of six of its books (preparing all of it takes minutes)
    distlm train        + a 1-layer, 32-wide model, 4 steps (6 for the resume, which must
                        have something left to do); the classifier: + its own tiny overrides
    distlm generate     + --max-new-tokens 16; prompts.txt is written first (the README
                        assumes the user has one)
    distlm plot         a run it names that does not exist (runs/other) is made first, as a
                        copy of runs/first's metrics.csv
    distlm bench        on a CPU the GPU-sized command is refused in one line that says what
                        to run instead: that refusal is what is checked
Skipped, with the reason in SKIP: activating the venv, torchrun (several processes; see
tests/test_distributed.py), tensorboard (a server), --interactive (reads a terminal).
"""
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
CORPUS = "distlm/assets/gutenberg/gutenberg.tar.xz"
LM_TINY = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=32",
           "train.global_batch_size=4", "train.micro_batch_size=4", "train.eval_batches=2", "log.samples=1"]
CLASSIFY_TINY = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "train.max_steps=4"]
SKIP = {
    "source": "the test runs this tree's python directly",
    "torchrun": "launches several processes; tests/test_distributed.py runs the layouts",
    "tensorboard": "starts a server; tests/test_user_runs.py reads the event files",
    "--interactive": "reads prompts from a terminal",
}


def tour_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## A 5-minute tour\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            commands.append(shlex.join(words))
    return commands


def skip_reason(words: list[str]) -> str | None:
    for key, why in SKIP.items():
        if words[0] == key or key in words:
            return why
    return None


def tiny_corpus(out: Path) -> Path:
    """The first 30 KB of six of the vendored books, as a .tar.xz like the real one."""
    with tarfile.open(ROOT / CORPUS, "r:xz") as src, tarfile.open(out, "w:xz") as dst:
        for n, member in enumerate(m for m in src if m.isfile()):
            if n == 6:
                break
            data = src.extractfile(member).read()[:30_000]
            info = tarfile.TarInfo(member.name)
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))
    return out


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "distlm", *argv], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=180)


def adapt(words: list[str], cwd: Path, trained: set[str]) -> list[str]:
    """The README command at a tiny size (see the module docstring)."""
    verb, args = words[1], [str(cwd / "tiny.tar.xz") if w == CORPUS else w for w in words[2:]]
    if verb == "train" and ("classify" in args or "task=classify" in args):
        return [verb, *args, *CLASSIFY_TINY]
    if verb == "train":
        name = next((a.split("=", 1)[1] for a in args if a.startswith("log.name=")), "")
        steps = 6 if "train.resume=auto" in args else 4
        trained.add(name)
        return [verb, *args, *LM_TINY, f"train.max_steps={steps}"]
    if verb == "generate":
        if "--prompts-file" in args:
            prompts = cwd / args[args.index("--prompts-file") + 1]
            if not prompts.exists():
                prompts.write_text("It was a dark and stormy night\nThe king said\n")
        return [verb, *args, "--max-new-tokens", "16"]
    if verb == "plot":
        for run_dir in (cwd / a for a in args if not a.startswith("-") and a.startswith("runs/")):
            if not run_dir.exists():
                run_dir.mkdir(parents=True)
                shutil.copy(cwd / "runs" / "first" / "metrics.csv", run_dir / "metrics.csv")
    return [verb, *args]


def check(words: list[str], argv: list[str], p: subprocess.CompletedProcess, cwd: Path) -> None:
    """What the user should see from each verb."""
    out, verb = p.stdout, argv[0]
    if verb == "bench":  # a GPU-sized run on a CPU: one line, and what to run instead
        lines = p.stderr.splitlines()
        assert p.returncode == 2 and len(lines) == 1 and "--config tiny" in lines[0], p.stderr
        return
    assert p.returncode == 0, (argv, out[-2000:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr
    if verb == "prepare":
        assert out.startswith(f"prepared {argv[argv.index('--out') + 1]}: train "), out
    elif verb == "train" and "classify" in argv:
        assert "accuracy" in out and "done: step 4" in out.splitlines()[-1], out
    elif verb == "train":
        steps = 6 if "train.resume=auto" in argv else 4
        if "train.resume=auto" in argv:
            assert "resumed from" in out, out
        assert re.search(rf"^done: step {steps}, val loss [\d.]+ on (all )?[\d,]+ blocks .*, checkpoint ", out, re.M), out
        assert f"samples at step {steps}" in out, out
    elif verb == "eval":
        assert re.search(r"val loss [\d.]+, perplexity [\d.]+ over (all )?[\d,]+ blocks.*, [\d,.]+[kM]? tokens", out), out
    elif verb == "generate" and "--out" in argv:
        written = cwd / argv[argv.index("--out") + 1]
        assert out.startswith(f"wrote 2 prompts x 1 samples to {written.name}"), out
        assert [json.loads(x)["index"] for x in written.read_text().splitlines()] == [0, 1]
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


def test_readme_tour(tmp_path):
    commands = tour_commands()
    verbs = [shlex.split(c)[1] for c in commands if c.startswith("distlm ")]
    # The tour as it stands: if a step is added or removed, look at the test's adaptations.
    assert {"prepare", "train", "eval", "generate", "plot", "bench", "plan"} <= set(verbs), verbs
    tiny_corpus(tmp_path / "tiny.tar.xz")
    trained: set[str] = set()
    ran, skipped, t0 = [], [], time.monotonic()
    for command in commands:
        words = shlex.split(command)
        why = skip_reason(words)
        if why:
            skipped.append((command, why))
            continue
        assert words[0] == "distlm", f"a tour command the test does not know how to run: {command}"
        argv = adapt(words, tmp_path, trained)
        t = time.monotonic()
        p = run(argv, tmp_path)
        check(words, argv, p, tmp_path)
        ran.append((command, round(time.monotonic() - t, 1)))
    total = time.monotonic() - t0
    print(f"\nREADME tour: {len(ran)} commands in {total:.0f} s, {len(skipped)} skipped")
    for command, s in ran:
        print(f"  {s:5.1f} s  {command}")
    for command, why in skipped:
        print(f"  skipped  {command}  ({why})")
    assert len(ran) >= 11 and "first" in trained
