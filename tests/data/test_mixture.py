"""data.mix: weighted mixtures of prepared folders, deterministic across world sizes and
resumes, in exact proportion, with per-source epochs, validation and one tokenizer."""
import json
from fractions import Fraction

import numpy as np
import pytest

from distlm.config import load_config
from distlm.data import DataError
from distlm.data.loader import BatchLoader
from distlm.data.mixture import MixtureLoader, Schedule, load_sources, parse_mix
from test_order import GPT2_TOK, blocks_of, numbered, write_folder

BS = 4
SIZES = {"web": 50, "books": 20, "code": 7}  # blocks in each source's train split


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Three sources whose block i of source s starts with token 1000*s + i: a row names both."""
    root = tmp_path_factory.mktemp("mix")
    return {name: write_folder(root / name, numbered(n, BS, 1000 * s), numbered(12, BS, 1000 * s + 500))
            for s, (name, n) in enumerate(SIZES.items())}


def mix_text(folders, weights=("0.7", "0.2", "0.1")) -> str:
    return ",".join(f"{name}={folders[name]}:{w}" for name, w in zip(SIZES, weights))


def loader(folders, weights=("0.7", "0.2", "0.1"), **kw) -> MixtureLoader:
    args = {"seed": 11, "global_batch": 8, "micro_batch": 2, **kw}
    return MixtureLoader(load_sources(mix_text(folders, weights), BS), **args)


def rows(ld, step):
    return np.concatenate([x[:, 0].numpy() for x, _ in ld.micro_batches(step)])


def test_parse_mix():
    entries = parse_mix("web=data/owt:0.7, data/gut:1/5\n code=/abs/code:0.1")
    assert [(e.name, str(e.path), e.weight) for e in entries] == [
        ("web", "data/owt", Fraction(7, 10)), ("gut", "data/gut", Fraction(1, 5)),
        ("code", "/abs/code", Fraction(1, 10))]
    for bad, why in (("", "empty"), ("data/owt", "NAME=FOLDER:WEIGHT"), ("a=x:0", "above 0"),
                     ("a=x:lots", "not a number"), ("a=x:1,a=y:1", "twice"), ("x:1,x:2", "twice")):
        with pytest.raises(DataError, match=why):
            parse_mix(bad)


def test_config_field_is_one_string_on_the_command_line_and_in_yaml(tmp_path):
    text = "web=data/owt:0.7,books=data/gut:0.2,code=data/code:0.1"
    (tmp_path / "c.yaml").write_text(f"data:\n  mix: {text}\n")
    assert load_config(str(tmp_path / "c.yaml")).data.mix == text
    assert load_config("tiny", [f"data.mix={text}"]).data.mix == text
    assert [e.name for e in parse_mix(load_config("tiny", [f"data.mix={text}"]).data.mix)] == ["web", "books", "code"]


def test_the_same_global_batches_at_dp_1_2_4(folders):
    one = loader(folders)
    for dp in (2, 4):
        ranks = [loader(folders, micro_batch=1, dp_rank=r, dp_size=dp) for r in range(dp)]
        for step in (0, 1, 5, 17):
            assert np.array_equal(np.concatenate([rows(r, step) for r in ranks]), rows(one, step)), (dp, step)


def test_resume_yields_the_same_batches(folders):
    a = loader(folders)
    for _ in range(13):
        a.next()
    b = loader(folders, micro_batch=2, dp_rank=1, dp_size=2)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.step == 13
    fresh = loader(folders)
    for step in range(13, 20):
        assert np.array_equal(rows(b, step), rows(fresh, step)[4:])
        assert np.array_equal(rows(a, step), rows(fresh, step))


@pytest.mark.parametrize("weights", [("0.7", "0.2", "0.1"), ("1", "1", "1"), ("0.55", "0.3", "0.15"),
                                     ("5", "1/3", "2")])
def test_proportions_stay_within_one_sample_of_exact(folders, weights):
    ld = loader(folders, weights)
    shares = [Fraction(w) for w in weights]
    shares = [s / sum(shares) for s in shares]
    seen = np.zeros(3)
    for step in range(150):
        got = rows(ld, step) // 1000  # the source of each row
        seen += np.bincount(got, minlength=3)
        assert np.all(np.abs(seen - np.array([float(s) for s in shares]) * 8 * (step + 1)) < 1), (step, seen)
        before, after = ld.schedule.counts(step * 8), ld.schedule.counts((step + 1) * 8)
        assert [b - a for a, b in zip(before, after)] == np.bincount(got, minlength=3).tolist()


def test_schedule_keeps_every_prefix_within_one_for_many_weightings():
    rng = np.random.default_rng(0)
    for _ in range(40):
        weights = [Fraction(int(w)) for w in rng.integers(1, 200, rng.integers(2, 8))]
        sched = Schedule(weights)
        h = np.arange(1, 2 * sched.period + 1)
        src = np.concatenate([sched.source, sched.source])
        for s, share in enumerate(sched.shares):
            assert np.abs(np.cumsum(src == s) - float(share) * h).max() < 1, weights
        assert sched.counts(2 * sched.period + 3) == [2 * u + int(np.sum(sched.source[:3] == s))
                                                     for s, u in enumerate(sched.units)]


def test_each_source_walks_its_own_epochs(folders):
    ld = loader(folders)
    per_source = {s: [] for s in range(3)}
    for step in range(60):
        for r in rows(ld, step):
            per_source[int(r) // 1000].append(int(r) % 1000)
    for s, n in enumerate(SIZES.values()):
        seq = per_source[s]
        for e in range(len(seq) // n):  # every block once per epoch of its own source
            assert sorted(seq[e * n:(e + 1) * n]) == list(range(n)), (s, e)
    # code (10%, 7 blocks) starts its 2nd epoch within the step holding its 8th sample
    counts = np.array([ld.schedule.counts((step + 1) * ld.global_batch)[2] for step in range(60)])
    first_repeat = int(np.argmax(counts >= 8))
    assert f"source code starts epoch 2 at step {first_repeat}: its 7 blocks repeat from here" in \
        ld.epoch_events(first_repeat)
    assert not any("source code" in m for step in range(first_repeat) for m in ld.epoch_events(step))


def test_validation_per_source_and_overall(folders):
    sets = [loader(folders, dp_rank=r, dp_size=2).val_sets(2) for r in range(2)]
    assert list(sets[0]) == ["web", "books", "code"]
    for name, vs in sets[0].items():
        assert vs.n_blocks == 4 and vs.describe().startswith(f"{name}: 4 blocks (every 3rd of 12)")
        assert np.array_equal(np.concatenate([x[:w, 0].numpy() // 500 for s in sets for x, _, w in s[name].weighted()]),
                              np.full(4, 2 * list(SIZES).index(name) + 1))  # its own val split, and only it
    assert loader(folders).overall({"web": 1.0, "books": 2.0, "code": 3.0}) == pytest.approx(0.7 + 0.4 + 0.3)
    assert loader(folders).overall({"web": 1.0, "books": 2.0}) == pytest.approx((0.7 + 0.4) / 0.9)


def test_sources_must_share_one_tokenizer(folders, tmp_path):
    other = write_folder(tmp_path / "other", numbered(9, BS), None, {**GPT2_TOK, "name": "bpe:4096",
                                                                       "vocab_size": 4096, "fingerprint": "a" * 64})
    with pytest.raises(DataError) as e:
        load_sources(f"web={folders['web']}:1,other={other}:1", BS)
    msg = str(e.value)
    assert "\n" not in msg and str(folders["web"]) in msg and str(other) in msg and "different tokenizers" in msg
    same_name = write_folder(tmp_path / "same", numbered(9, BS), None, {**GPT2_TOK, "fingerprint": "b" * 64})
    with pytest.raises(DataError, match="fingerprint"):  # same name and size, another vocabulary
        load_sources(f"web={folders['web']}:1,same={same_name}:1", BS)


def test_a_checkpoint_resumes_only_on_its_own_mixture(folders):
    state = loader(folders).state_dict()
    with pytest.raises(DataError, match="differs from data.mix"):
        loader(folders, ("0.6", "0.3", "0.1")).load_state_dict(state)
    with pytest.raises(DataError, match="set data.mix"):
        BatchLoader(blocks_of(folders["web"]), seed=11, global_batch=8, micro_batch=2).load_state_dict(state)
    plain = BatchLoader(blocks_of(folders["web"]), seed=11, global_batch=8, micro_batch=2).state_dict()
    with pytest.raises(DataError, match="not the mixture"):
        loader(folders).load_state_dict(plain)
    assert "web 70.0%" in loader(folders).describe()
