"""The product speaks of itself, not of how it was built: no tracked file (code, tests,
configs, docs, results, file names) names development sittings, numbered tickets, trial runs
or tools a user does not have. A figure refers to its card and date, a change to its commit
or topic.

The words are spelled below so that this file does not match them itself (a `git grep` for
any of them finds nothing here).
"""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORDS = {
    "a development sitting": r"\bsess(?:ion)",
    "a numbered ticket": r"\bissues?\s+#?\d+|\bissue\s*#\d+|\bissues?\s+\d+(?:\s*,\s*\d+)*",
    "a numbered device run": r"\bcalls?\s+\d+\b|\bcall\d+/|\(calls?\s+\d|\bdevice[ _]call",
    "a trial run": r"rehe(?:ars)",
    "a tool users do not have": r"\bdevi(?:ce) tool",
    "the system it grew from": r"\bseed (?:system|default|doc(?:ument)?)\b|\bthe seed's\b",
    "a script named after a sitting": r"\bgpu_s\d+|\bgpu_x(?:4|4b)\b|[-/]s\d{1,2}[a-d]?(?:[-/]|\.sh\b)",
}
PATTERN = re.compile("|".join(f"(?:{p})" for p in WORDS.values()), re.I)
# The one API spelling that happens to contain the first word: subprocess's setsid flag.
# Nothing else may.
API = re.compile(r"""start_new_sess(?:ion)""")
# Vendored data: the GPT-2 vocabulary holds these words as tokens.
DATA = {"distlm/assets/gpt2/encoder.json", "distlm/assets/gpt2/vocab.bpe"}


def tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\n")


def hits(name: str, text: str) -> list[str]:
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in PATTERN.finditer(API.sub("", line)):
            found.append(f"{name}:{n}: {m.group(0)!r} in {line.strip()[:120]}")
    return found


def test_no_process_words_in_tracked_files():
    found = []
    for name in filter(None, tracked()):
        found += [f"file name {h}" for h in hits(name, name)]
        path = ROOT / name
        if name in DATA or not path.is_file() or path.is_symlink():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary: images, checkpoints
            continue
        found += hits(name, data.decode("utf-8", "replace"))
    assert not found, f"{len(found)} development-process words in tracked files:\n" + "\n".join(found[:80])


def test_the_patterns_catch_what_they_name():
    # Each example is cut in two, so that this file holds none of them whole.
    caught = ["the twelfth sess" + "ion", "issue" + " 16", "issues" + " 3, 4 and 5", "issue" + " #19", "call" + " 3",
              "(call" + " 2, another", "raw/x/call" + "3/s" + "18/", "a rehe" + "arsal of the script",
              "through the device" + " tool", "the seed sys" + "tem", "benchmarks/gpu" + "_s12.sh", "gpu" + "_x4b.sh",
              "raw/2026-11-27-s" + "12/", "device" + "_call.sh", "the seed" + " default"]
    for text in caught:
        assert hits("x", text), text
    caught.append("@pytest.fixture(scope=\"sess" + "ion\")")  # tests/conftest.py uses package scope
    for text in caught[-1:]:
        assert hits("x", text), text
    kept = ["in posse" + "ssion of", "Popen(cmd, start_new_sess" + "ion=True)",
            "recall 3 items", "s32 = svdvals(g)", "a call to the function", "pytorch/pytorch#193027", "seed 0",
            "gpt2-124m"]
    for text in kept:
        assert not hits("x", text), text
