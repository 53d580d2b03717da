"""Weighted mixtures of prepared folders (``data.mix``), deterministic and resumable.

``data.mix`` is one string, the same on the command line and in YAML::

    web=data/owt:0.7,books=data/gutenberg:0.2,code=data/code:0.1

Entries are separated by commas (or new lines), each ``[NAME=]FOLDER:WEIGHT``; NAME
defaults to the folder's name, weights are positive numbers or fractions (``1/3``)
and are normalised.

Which source sample g of the run comes from: a fixed schedule of period W (the common
denominator of the normalised weights, at most 65,536) in which source s holds w_s of
the W slots, laid out so that after any number of samples every source's count is
within one sample of its exact share (an earliest-deadline schedule; Tijdeman's
chairman-assignment bound says a strictly-within-one layout exists, and EDF finds one).
Sample g reads source ``sched[g % W]`` at that source's own running index
``k = (g // W) * w_s + (occurrences of s in sched before g % W)``, and the block is the
source's own order-2 permutation (``distlm.data.order``, its seed derived from the
run's seed and the source's name) at k. So each global batch holds the sources in
proportion, every sample is a pure function of (seed, step, global batch), a rank
computes only its slice, resuming needs only the step, and each source counts its
epochs separately (k // its block count).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from distlm.data import DataError, load_manifest
from distlm.data.loader import (RankBatches, TokenBlocks, ValSet, check_batch, epoch_messages, human_count,
                                resume_step, val_micro_batches)
from distlm.data.order import ORDER_V2, derived_seed, sample_blocks

MAX_PERIOD = 1 << 16  # schedule slots: 65,536 int32+int64 pairs, under 1 MB, built in well under a second
# A weight is normalised against the others, and a share below 1/MAX_PERIOD is refused
# anyway: exponents past this are typos. Checked on the text, before Fraction, which would
# build 1e99999999 exactly (a hundred-million-digit integer: it never finished).
MAX_WEIGHT_EXPONENT = 30
_WEIGHT = re.compile(r"\s*[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?(\d+))?(\s*/\s*\d+(\.\d*)?([eE][+-]?(\d+))?)?\s*")
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


@dataclass(frozen=True)
class MixEntry:
    name: str
    path: Path
    weight: Fraction  # as written; normalised by Schedule


def parse_mix(text: str) -> list[MixEntry]:
    """``data.mix`` -> entries; DataError naming the entry at fault."""
    items = [item.strip() for item in re.split(r"[,\n]", str(text)) if item.strip()]
    if not items:
        raise DataError("data.mix is empty: give NAME=FOLDER:WEIGHT,... (e.g. web=data/owt:0.7,books=data/gut:0.3)")
    entries, names, paths = [], set(), set()
    for item in items:
        body, colon, weight_text = item.rpartition(":")  # rpartition: a folder may hold a colon, a weight cannot
        if not colon or not body:
            raise DataError(f"data.mix entry {item!r} must look like NAME=FOLDER:WEIGHT (e.g. web=data/owt:0.7)")
        name, eq, folder = body.partition("=")
        if not eq or not _NAME.fullmatch(name.strip()):  # no NAME=: the folder's own name
            name, folder = "", body
        folder = folder.strip()
        name = name.strip() or Path(folder).name
        weight = _parse_weight(item, weight_text)
        if weight <= 0:
            raise DataError(f"data.mix entry {item!r}: weight {weight_text!r} must be above 0")
        if not folder or not name:
            raise DataError(f"data.mix entry {item!r} names no folder")
        if name in names:
            raise DataError(f"data.mix names source {name!r} twice; give each a NAME= of its own")
        resolved = Path(folder).resolve()
        if resolved in paths:
            raise DataError(f"data.mix lists {folder} twice; give it one entry with the summed weight")
        names.add(name)
        paths.add(resolved)
        entries.append(MixEntry(name, Path(folder), weight))
    return entries


def _parse_weight(item: str, text: str) -> Fraction:
    """A positive decimal or fraction (0.7, 1e-3, 1/3), exactly; DataError naming the entry."""
    form = _WEIGHT.fullmatch(text) if len(text) <= 64 else None
    if form is None:
        raise DataError(f"data.mix entry {item!r}: weight {text!r} is not a number (e.g. 0.7, 2, or 1/3)")
    exponents = [int(e) for e in (form.group(4), form.group(8)) if e is not None]
    if any(e > MAX_WEIGHT_EXPONENT for e in exponents):
        raise DataError(f"data.mix entry {item!r}: weight {text.strip()!r} is out of range: exponents up to "
                        f"{MAX_WEIGHT_EXPONENT} (weights only matter relative to each other)")
    try:
        return Fraction(text.strip().replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        raise DataError(f"data.mix entry {item!r}: weight {text!r} is not a number (e.g. 0.7, 2, or 1/3)") from None


class Schedule:
    """Which source each sample of the run comes from (see the module's doc)."""

    def __init__(self, weights: list[Fraction], names: list[str] | None = None):
        total = sum(weights)
        shares = [Fraction(w) / total for w in weights]
        period = math.lcm(*(s.denominator for s in shares))
        if period > MAX_PERIOD:
            units = _largest_remainder(shares, MAX_PERIOD)
            if min(units) == 0:
                small = (names or [str(i) for i in range(len(weights))])[units.index(0)]
                raise DataError(f"data.mix: source {small!r} has a weight below 1/{MAX_PERIOD} of the total")
            g = math.gcd(*units)
            units, period = [u // g for u in units], MAX_PERIOD // g
        else:
            units = [int(s * period) for s in shares]
        self.units, self.period = units, period
        self.source, self.index = _edf_schedule(units)
        # Each source's slots, sorted: counts over a partial period by binary search.
        self.slots = [np.flatnonzero(self.source == s) for s in range(len(units))]

    @property
    def shares(self) -> list[Fraction]:
        """The exact proportions the schedule keeps (the weights, rounded only if W > 65,536)."""
        return [Fraction(u, self.period) for u in self.units]

    def assign(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, that source's running sample index) of each global sample index."""
        g = np.asarray(samples, dtype=np.int64)
        slot = g % self.period
        src = self.source[slot]
        return src, (g // self.period) * np.asarray(self.units, dtype=np.int64)[src] + self.index[slot]

    def counts(self, samples: int) -> list[int]:
        """Samples each source has given among the run's first ``samples``: O(#sources)."""
        whole, part = divmod(int(samples), self.period)
        return [whole * u + int(np.searchsorted(slots, part)) for u, slots in zip(self.units, self.slots)]


def _largest_remainder(shares: list[Fraction], total: int) -> list[int]:
    exact = [s * total for s in shares]
    units = [math.floor(e) for e in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(exact[i] - units[i]), i))
    for i in by_remainder[:total - sum(units)]:
        units[i] += 1
    return units


def _edf_schedule(units: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """A period of slots holding units[s] of each source, every prefix within one sample of
    exact. Source s's j-th sample (count j after it) must sit at a slot h (1-based) with
    (j-1)·W < units[s]·h (never more than one ahead) and h <= ceil(j·W / units[s]) (never one
    behind); earliest deadline first among the sources whose next sample is released."""
    period, n = sum(units), len(units)
    source, index = np.empty(period, dtype=np.int32), np.empty(period, dtype=np.int64)
    count = [0] * n
    for h in range(1, period + 1):
        best, best_deadline = -1, 0
        for s in range(n):
            c, u = count[s], units[s]
            if c < u and c * period < u * h:
                deadline = -(-(c + 1) * period // u)
                if best < 0 or deadline < best_deadline:
                    best, best_deadline = s, deadline
        if best < 0:  # not reachable by the bound above; a valid (if less even) period all the same
            best = max((s for s in range(n) if count[s] < units[s]), key=lambda s: units[s] * h - count[s] * period)
        source[h - 1], index[h - 1] = best, count[best]
        count[best] += 1
    return source, index


@dataclass
class Source:
    name: str
    path: Path
    weight: Fraction
    manifest: dict
    train: TokenBlocks
    val: TokenBlocks | None


def load_sources(mix: str | list[MixEntry], block_size: int, *, verify_checksums: bool = False) -> list[Source]:
    """Open every folder of ``data.mix``: manifests, one shared tokenizer, train and val blocks."""
    entries = parse_mix(mix) if isinstance(mix, str) else list(mix)
    manifests = [load_manifest(e.path) for e in entries]
    check_tokenizers([e.path for e in entries], manifests)
    sources = []
    for e, m in zip(entries, manifests):
        if verify_checksums:
            from distlm.data import verify_shards
            verify_shards(e.path, m)
        has_val = int(m["splits"].get("val", {}).get("tokens", 0)) > 0
        sources.append(Source(e.name, e.path, e.weight, m, TokenBlocks(e.path, "train", block_size, m),
                              TokenBlocks(e.path, "val", block_size, m) if has_val else None))
    return sources


def check_tokenizers(paths: list[Path], manifests: list[dict]) -> dict:
    """The tokenizer every folder shares (the first manifest's); one-line DataError naming the
    first two folders that differ. Same name and vocabulary is not enough for trained BPEs
    (bpe:4096 on two corpora are two tokenizers), hence the fingerprint where both have one."""
    ref = manifests[0]["tokenizer"]
    for path, m in zip(paths[1:], manifests[1:]):
        tok = m["tokenizer"]
        differs = [key for key in ("name", "vocab_size", "fingerprint", "eos_id")
                   if ref.get(key) is not None and tok.get(key) is not None and str(ref[key]) != str(tok[key])]
        if differs:
            detail = ", ".join(f"{k} {_short(ref[k])} vs {_short(tok[k])}" for k in differs)
            raise DataError(f"data.mix: {paths[0]} and {path} were prepared with different tokenizers ({detail}); "
                            f"every source must use one tokenizer")
    return ref


def _short(value) -> str:
    text = str(value)
    return text[:12] + "..." if len(text) > 16 else text


class MixtureLoader(RankBatches):
    """BatchLoader's interface over a weighted mixture: this rank's micro-batches of each
    global batch, rank r taking samples [r*B/dp, (r+1)*B/dp) of it. Its state is the step
    plus what the mixture was built from (names, proportions, block counts), checked on load."""

    order = ORDER_V2  # mixtures postdate order 1

    def __init__(self, sources: list[Source], *, seed: int, global_batch: int, micro_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, pin_memory: bool = False):
        check_batch(global_batch, micro_batch, dp_size)
        if not sources:
            raise DataError("data.mix lists no source")
        self.sources, self.seed = sources, seed
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.block_size = sources[0].train.block_size
        self.pin_memory = pin_memory
        self.schedule = Schedule([s.weight for s in sources], [s.name for s in sources])
        self.seeds = [derived_seed(seed, s.name) for s in sources]
        self.sizes = [len(s.train) for s in sources]
        self.step = 0

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def sample_ids(self, step: int, lo: int = 0, hi: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(source, block id) of rows [lo, hi) of the global batch at ``step``."""
        hi = self.global_batch if hi is None else hi
        g = np.arange(step * self.global_batch + lo, step * self.global_batch + hi, dtype=np.int64)
        src, k = self.schedule.assign(g)
        ids = np.empty_like(k)
        for s in np.unique(src):
            sel = src == s
            ids[sel] = sample_blocks(self.seeds[s], k[sel], self.sizes[s], ORDER_V2)
        return src, ids

    def _rank_rows(self, step: int) -> np.ndarray:
        per_rank = self.global_batch // self.dp_size
        lo = self.dp_rank * per_rank
        src, ids = self.sample_ids(step, lo, lo + per_rank)
        return np.stack([self.sources[s].train.block(int(i)) for s, i in zip(src, ids)])

    # ---- what the log says --------------------------------------------------------------
    def epoch_events(self, step: int) -> list[str]:
        """One message per source whose next epoch starts within the global batch of ``step``:
        from there on that source's blocks repeat. Empty for most steps."""
        a = self.schedule.counts(step * self.global_batch)
        b = self.schedule.counts((step + 1) * self.global_batch)
        return [msg for name, lo, hi, n in zip(self.names, a, b, self.sizes)
                for msg in epoch_messages(f"source {name}", lo, hi, n, step)]

    def describe(self) -> str:
        parts = [f"{s.name} {float(share):.1%} ({n:,} blocks, {human_count(n * self.block_size)} tokens)"
                 for s, share, n in zip(self.sources, self.schedule.shares, self.sizes)]
        tok = self.sources[0].manifest["tokenizer"].get("name")
        return f"mixture of {len(self.sources)} sources ({tok}): " + ", ".join(parts)

    # ---- validation ---------------------------------------------------------------------
    def val_sets(self, n_batches: int | None, micro_batch: int | None = None) -> dict[str, ValSet]:
        """A fixed validation set per source that has a val split (``val_micro_batches`` each,
        named after the source), dealt to this loader's data-parallel rank."""
        m = micro_batch or self.micro_batch
        return {s.name: val_micro_batches(s.val, n_batches, m, self.dp_rank, self.dp_size, name=s.name)
                for s in self.sources if s.val is not None}

    def overall(self, losses: dict[str, float]) -> float:
        """The mixture's validation loss: the sources' losses weighted by their shares (renormalised
        over the sources given), i.e. the expected loss on data drawn as training draws it."""
        shares = dict(zip(self.names, self.schedule.shares))
        total = sum(shares[name] for name in losses)
        if not losses or total == 0:
            return float("nan")
        return sum(float(shares[name] / total) * loss for name, loss in losses.items())

    # ---- state --------------------------------------------------------------------------
    def _mix_state(self) -> list[list]:
        return [[s.name, str(share), n] for s, share, n in zip(self.sources, self.schedule.shares, self.sizes)]

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch, "n_blocks": sum(self.sizes),
                "order": self.order, "mix": self._mix_state()}

    def load_state_dict(self, state: dict) -> None:
        if "mix" not in state:
            raise DataError("the checkpoint's run read one folder (data.dir), not the mixture data.mix: it would not "
                            "resume on the same batches")
        theirs, mine = [[str(x) for x in e] for e in state["mix"]], [[str(x) for x in e] for e in self._mix_state()]
        if theirs != mine:
            raise DataError(f"the checkpoint's mixture [{_show(theirs)}] differs from data.mix [{_show(mine)}]: "
                            f"the resumed run would not see the same batches")
        if int(state.get("order", 0)) != self.order:
            raise DataError(f"the checkpoint's mixture uses sample order {state.get('order')!r}, not {self.order}")
        self.step = resume_step(self.state_dict(), state)


def _show(entries: list[list[str]]) -> str:
    return ", ".join(f"{name} {share} ({int(blocks):,} blocks)" for name, share, blocks in entries)


__all__ = ["MixEntry", "MixtureLoader", "Schedule", "Source", "check_tokenizers", "load_sources", "parse_mix"]
