#!/usr/bin/env bash
# `distlm prepare` at scale (issue 18): MB/s of GPT-2 BPE against worker processes, peak RSS, resume after
# kill -9, and --shard/--merge, on a >= 5 GB corpus built here from the bundled text (nothing to carry).
#   bash benchmarks/prepare_scale.sh                        # all items, within BUDGET seconds (default 540)
#   ONLY="1 2" WORKERS="1 2" SIZE_GB=0.3 bash benchmarks/prepare_scale.sh   # a small dry run (CPU box)
# Items, each skipped when the time left is short:
#   1. corpus: SIZE_GB (default 5.2) of documents made by shuffling and recombining the paragraphs of
#      distlm/assets/gutenberg/gutenberg.tar.xz and, when there, EXTRA (default ../shared/data/corpus: its
#      *.txt files), as JSONL files of FILE_MB (128) in folders of 4 (FORMAT=parquet: Parquet files instead).
#      Kept in WORK between calls (a stamp file says it is complete): build it in one call, measure in the next.
#   2. scaling: prepare() at each of WORKERS (default "1 2 4 8 16"), a fresh process each, on the first
#      min(all, w) folders of 512 MB (8 workers and more, and the largest WORKERS: all of it, >= 5 GB; fewer
#      workers read less so that the whole sweep fits in one 10-minute call). MB/s = MB of UTF-8 text /
#      wall time of the prepare() call (from the first read to the renamed output folder; imports excluded).
#      Peak RSS: getrusage of the parent and of its largest worker (both include the pages a forked worker
#      shares with its parent), and the peak of the process tree's summed PSS (shared pages once), sampled
#      every 0.2 s.
#   3. resume: prepare at the largest WORKERS on all of it, kill -9 once the journal shows half the tasks
#      done, run again (it resumes), and compare the result with item 2's uninterrupted run (manifest
#      without "created", every shard's sha256).
#   4. shard + merge: two parts (--shard 0/2 and 1/2, half the workers each, at the same time, as two
#      machines would), then --merge; compared with item 2's run the same way.
# Results: $OUT/prepare_scale.md and .jsonl (rewritten after each run), resume.txt, merge.txt, and a summary on
# stdout. On the 16-core machine items 1+2 take about 5 minutes and 3+4 about 3: two calls on one warm machine,
# ONLY="1 2" then ONLY="3 4" (WORK, default /tmp/prep-scale, holds the corpus and outputs, ~20 GB, between them).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
if [ -z "${PY:-}" ]; then if [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi; fi
OUT=${OUT:-/tmp/out}; WORK=${WORK:-/tmp/prep-scale}; BUDGET=${BUDGET:-540}
SIZE_GB=${SIZE_GB:-5.2}; FILE_MB=${FILE_MB:-128}; FORMAT=${FORMAT:-jsonl}; WORKERS=${WORKERS:-1 2 4 8 16}
EXTRA=${EXTRA:-$ROOT/../shared/data/corpus}
mkdir -p "$OUT" "$WORK"
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
left() { echo $((BUDGET - SECONDS)); }

{ date -u; echo "host $(hostname), $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GB RAM"
  grep -m1 "model name" /proc/cpuinfo; "$PY" -c "import sys, tiktoken, numpy; print('python', sys.version.split()[0], 'tiktoken', tiktoken.__version__, 'numpy', numpy.__version__)"
  echo "commit ${COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)}"; } | tee "$OUT/machine.txt"

if want 1; then
  "$PY" - "$WORK/corpus" "$SIZE_GB" "$FILE_MB" "$FORMAT" "$EXTRA" <<'EOF'
import json, os, random, re, sys, tarfile, time
from multiprocessing import Pool
from pathlib import Path
out, size_gb, file_mb, fmt, extra = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
stamp = out / "COMPLETE"
if stamp.is_file() and stamp.read_text() == f"{size_gb} {file_mb} {fmt}\n":
    print(f"corpus: {out} already built ({stamp.read_text().strip()})"); sys.exit(0)

def paragraphs(text):
    return [p.strip() for p in re.split(r"\n\s*\n", text.replace("\r\n", "\n")) if len(p.strip()) > 20]

t0 = time.time()
paras = []
from distlm.data.sources import DEFAULT_CORPUS
with tarfile.open(DEFAULT_CORPUS) as tar:
    for m in tar:
        if m.isfile() and not m.name.rsplit("/", 1)[-1].startswith("."):
            paras += paragraphs(tar.extractfile(m).read().decode("utf-8", "replace"))
if os.path.isdir(extra):
    for p in sorted(Path(extra).rglob("*.txt")):
        paras += paragraphs(p.read_text("utf-8", "replace"))
PARAS = paras

def write(k):  # file k: documents of 3-60 random paragraphs, seeded by k; ~file_mb MB of text
    rng, docs, size = random.Random(k), [], 0
    while size < file_mb * 1e6:
        doc = "\n\n".join(rng.choices(PARAS, k=rng.randint(3, 60)))
        docs.append(doc)
        size += len(doc.encode())
    folder = out / f"{k // 4:03d}"
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        import pyarrow as pa, pyarrow.parquet as pq
        pq.write_table(pa.table({"text": docs, "id": [f"{k}-{i}" for i in range(len(docs))]}),
                       folder / f"part-{k:05d}.parquet", row_group_size=1000)
    else:
        with open(folder / f"part-{k:05d}.jsonl", "w") as fh:
            fh.writelines(json.dumps({"text": d, "id": f"{k}-{i}"}) + "\n" for i, d in enumerate(docs))
    return size

n = max(1, round(size_gb * 1e9 / (file_mb * 1e6)))
out.mkdir(parents=True, exist_ok=True)
stamp.unlink(missing_ok=True)
with Pool(os.cpu_count()) as pool:
    total = sum(pool.map(write, range(n)))
stamp.write_text(f"{size_gb} {file_mb} {fmt}\n")
print(f"corpus: {n} {fmt} files, {total / 1e9:.2f} GB of text from {len(PARAS):,} paragraphs, "
      f"in {time.time() - t0:.0f} s: {out}")
EOF
fi

# A measured run: prepare() in a fresh process, its process tree's RSS sampled; one JSON line to $OUT.
measure() {  # measure NAME WORKERS INPUT...
  local name=$1 w=$2; shift 2
  "$PY" - "$name" "$w" "$OUT" "$WORK" "$@" <<'EOF'
import json, os, subprocess, sys, time
name, w, out, work, inputs = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
child = r'''
import json, os, resource, sys, time
from distlm.data.prepare import prepare
t0, c0 = time.perf_counter(), os.times()
m = prepare(sys.argv[3:], sys.argv[1], workers=int(sys.argv[2]), progress=False)
wall = time.perf_counter() - t0
t, s, c = os.times(), resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"text_gb": m["stats"]["text_bytes"] / 1e9, "tokens": m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"],
                  "wall_s": wall, "cpu_parent_s": t.user + t.system - c0.user - c0.system,
                  "cpu_workers_s": t.children_user + t.children_system, "rss_parent_mb": s.ru_maxrss / 1024,
                  "rss_largest_worker_mb": c.ru_maxrss / 1024}))
'''
dest = os.path.join(work, f"out-{name}")
subprocess.run(["rm", "-rf", dest])
proc = subprocess.Popen([sys.executable, "-c", child, dest, str(w), *inputs], stdout=subprocess.PIPE, text=True)
page, peak = os.sysconf("SC_PAGE_SIZE"), 0
def tree(pid):
    kids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(p))
            except OSError:
                pass
    return [pid] + [q for k in kids for q in tree(k)]
while proc.poll() is None:
    total = 0
    for p in tree(proc.pid):  # PSS: pages shared by the forked workers counted once, not per process
        try:
            total += int(next(l for l in open(f"/proc/{p}/smaps_rollup") if l.startswith("Pss:")).split()[1]) * 1024
        except (OSError, StopIteration):
            try:
                total += int(open(f"/proc/{p}/statm").read().split()[1]) * page
            except OSError:
                pass
    peak = max(peak, total)
    time.sleep(0.2)
line = proc.stdout.read().strip().splitlines()
if proc.returncode or not line:
    print(f"[{name}] failed, rc {proc.returncode}"); sys.exit(1)
r = {"name": name, "workers": w, **json.loads(line[-1]), "rss_tree_peak_mb": peak / 2**20}
r["mb_per_s"] = r["text_gb"] * 1e3 / r["wall_s"]
with open(os.path.join(out, "prepare_scale.jsonl"), "a") as fh:
    fh.write(json.dumps(r) + "\n")
print(f"[{name}] {w:2d} workers: {r['text_gb']:.2f} GB in {r['wall_s']:.1f} s = {r['mb_per_s']:.1f} MB/s; CPU parent "
      f"{r['cpu_parent_s']:.1f} s, workers {r['cpu_workers_s']:.1f} s; peak RSS parent {r['rss_parent_mb']:.0f} MB, "
      f"largest worker {r['rss_largest_worker_mb']:.0f} MB, whole tree (PSS) {r['rss_tree_peak_mb']:.0f} MB", flush=True)
EOF
}
folders() { ls -d "$WORK"/corpus/[0-9]* | head -n "$1"; }
N_FOLDERS=$(ls -d "$WORK"/corpus/[0-9]* 2>/dev/null | wc -l)
MAXW=$(echo $WORKERS | tr ' ' '\n' | sort -n | tail -1)

if want 2; then
  for w in $WORKERS; do
    n=$(( w >= 8 || w == MAXW ? N_FOLDERS : (w < N_FOLDERS ? w : N_FOLDERS) ))
    [ "$(left)" -gt 60 ] || { echo "[scale-w$w] skipped: no time left"; continue; }
    measure "w$w" "$w" $(folders "$n")
    [ "$w" = "$MAXW" ] || rm -rf "$WORK/out-w$w"  # only the largest run is compared with later
  done
fi

compare() {  # compare A B: same manifest but "created", same shard checksums?
  "$PY" - "$1" "$2" <<'EOF'
import json, sys
a, b = (json.load(open(f"{d}/manifest.json")) for d in sys.argv[1:3])
same = {k: v for k, v in a.items() if k != "created"} == {k: v for k, v in b.items() if k != "created"}
shards = sum(len(s["shards"]) for s in a["splits"].values())
print(f"identical to the uninterrupted run: {'yes' if same else 'NO'} ({shards} shards, sha256 compared)")
EOF
}

if want 3 && [ "$(left)" -gt 120 ]; then
  dest=$WORK/out-resume; rm -rf "$dest" "$WORK"/.out-resume.*
  "$PY" -c "import sys; from distlm.data.prepare import prepare; prepare(sys.argv[3:], sys.argv[1], workers=int(sys.argv[2]), progress=False)" \
    "$dest" "$MAXW" $(folders "$N_FOLDERS") & pid=$!
  journaled() {  # "TOTAL DONE": tasks in the plan, and tasks the journal's last complete line covers
    python3 -c 'import json, sys
lines = open(sys.argv[1]).read().split("\n"); done = 0
for line in lines[1:-1]:
    try: done = json.loads(line)["unit"] + 1
    except (ValueError, KeyError): break
print(json.loads(lines[0])["units"], done)' "$1" 2>/dev/null || echo "1 0"; }
  start=$SECONDS; total=1; done=0
  while kill -0 $pid 2>/dev/null; do
    j=$(ls "$WORK"/.out-resume.tmp-*/journal.jsonl 2>/dev/null | head -1)
    if [ -n "$j" ]; then
      read -r total done < <(journaled "$j")
      [ "$done" -ge $(( total / 2 )) ] && break
    fi
    sleep 0.5
  done
  kill -9 $pid; wait $pid 2>/dev/null
  echo "[resume] killed after $((SECONDS - start)) s with $done of $total tasks journaled" | tee "$OUT/resume.txt"
  s=$SECONDS
  "$PY" -c "import sys; from distlm.data.prepare import prepare; prepare(sys.argv[3:], sys.argv[1], workers=int(sys.argv[2]), progress=False)" \
    "$dest" "$MAXW" $(folders "$N_FOLDERS") | tee -a "$OUT/resume.txt"
  echo "[resume] the second run took $((SECONDS - s)) s (with imports)" | tee -a "$OUT/resume.txt"
  [ -d "$WORK/out-w$MAXW" ] && compare "$dest" "$WORK/out-w$MAXW" | tee -a "$OUT/resume.txt"
fi

if want 4 && [ "$(left)" -gt 120 ]; then
  half=$(( MAXW / 2 > 0 ? MAXW / 2 : 1 )); s=$SECONDS
  rm -rf "$WORK/part0" "$WORK/part1" "$WORK/out-merged"
  for i in 0 1; do
    "$PY" -m distlm prepare $(folders "$N_FOLDERS") --out "$WORK/part$i" --shard "$i/2" --workers "$half" --quiet &
  done
  wait; t_parts=$((SECONDS - s)); s=$SECONDS
  "$PY" -m distlm prepare --merge "$WORK/part0" "$WORK/part1" --out "$WORK/out-merged" --quiet
  echo "[shard+merge] two parts of $half workers at once: $t_parts s; merge: $((SECONDS - s)) s (with imports)" \
    | tee -a "$OUT/merge.txt"
  [ -d "$WORK/out-w$MAXW" ] && compare "$WORK/out-merged" "$WORK/out-w$MAXW" | tee -a "$OUT/merge.txt"
fi

"$PY" - "$OUT" <<'EOF'
import json, os, sys
rows = [json.loads(l) for l in open(os.path.join(sys.argv[1], "prepare_scale.jsonl"))] if os.path.exists(
    os.path.join(sys.argv[1], "prepare_scale.jsonl")) else []
lines = ["| workers | text GB | wall s | MB/s | CPU parent s | CPU workers s | peak RSS parent MB | largest worker MB | tree peak PSS MB |",
         "|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    lines.append(f"| {r['workers']} | {r['text_gb']:.2f} | {r['wall_s']:.1f} | {r['mb_per_s']:.1f} | {r['cpu_parent_s']:.1f} | "
                 f"{r['cpu_workers_s']:.1f} | {r['rss_parent_mb']:.0f} | {r['rss_largest_worker_mb']:.0f} | {r['rss_tree_peak_mb']:.0f} |")
open(os.path.join(sys.argv[1], "prepare_scale.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
