"""Tokenizers: GPT-2 ids, offline loading, trained BPE determinism, safe chunking."""
import json
import random
import socket

import pytest

from distlm.data import DataError
from distlm.data import tokenizer as tkz

UNICODE = "Grüße, 世界! naïve café — 🎉 emoji\ttabs\r\n  spaces   \n\n\nend ümlaut 123,456.7 'tis"
WORDS = ("the of and to in that it was he for on are as with his they at be this from have or by one had "
         "not but what all were when we there can an your which their said if do will each about how up "
         "out them then she many some so these would other into has more her two like him see time").split()


def corpus(n_docs: int, words: int = 60, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n_docs):
        body = " ".join(rng.choice(WORDS) for _ in range(words))
        docs.append(f"Document {i}.\n{body.capitalize()}.\n\n{UNICODE if i % 3 == 0 else ''}")
    return docs


@pytest.fixture(scope="module")
def bpe() -> tkz.BPETokenizer:
    return tkz.train_bpe(corpus(40), 400)


def test_gpt2_known_ids():
    tok = tkz.load_tokenizer("gpt2")
    assert (tok.name, tok.vocab_size, tok.eos_id, tok.dtype) == ("gpt2", 50257, 50256, "uint16")
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode(" the") == [262]
    assert tok.encode("\n\n") == [628]
    assert tok.decode([15496, 995, 50256]) == "Hello world<|endoftext|>"


def test_endoftext_in_text_is_not_special(bpe):
    for tok in (tkz.gpt2(), bpe):
        ids = tok.encode("a<|endoftext|>b")
        assert tok.eos_id not in ids
        assert tok.decode(ids) == "a<|endoftext|>b"
    assert tkz.gpt2().encode("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]


def test_gpt2_round_trip_and_batch():
    tok = tkz.gpt2()
    texts = [UNICODE, "", " leading space", "x" * 1000, "\u00a0nbsp\u2003em space"]
    assert [tok.decode(tok.encode(t)) for t in texts] == texts
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.encode_batch(texts, num_threads=1) == [tok.encode(t) for t in texts]


def test_gpt2_ranks_match_tiktoken_loader(monkeypatch):
    """Our encoder.json reader gives exactly tiktoken's data-gym ranks (which also check vocab.bpe)."""
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # "" = no cache directory
    ranks = data_gym_to_mergeable_bpe_ranks(str(tkz.GPT2_DIR / "vocab.bpe"), str(tkz.GPT2_DIR / "encoder.json"))
    mine, eos = tkz._gpt2_ranks((tkz.GPT2_DIR / "encoder.json").read_bytes())
    assert mine == ranks and eos == 50256


def test_gpt2_builds_offline_without_cache(monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        monkeypatch.setenv(var, str(cache))

    def no_network(*args, **kwargs):
        raise AssertionError("the GPT-2 tokenizer tried to use the network")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    tok = tkz.GPT2Tokenizer()  # a fresh one, not the cached instance
    assert tok.encode("Hello world") == [15496, 995]
    assert not cache.exists()
    assert tok.fingerprint() == tkz.gpt2().fingerprint()
    assert len(tok.fingerprint()) == 64


def test_gpt2_rejects_damaged_vocabulary(monkeypatch, tmp_path):
    for name in tkz.GPT2_SHA256:
        (tmp_path / name).write_bytes((tkz.GPT2_DIR / name).read_bytes())
    (tmp_path / "vocab.bpe").write_bytes(b"#version: 0.2\n")
    monkeypatch.setattr(tkz, "GPT2_DIR", tmp_path)
    with pytest.raises(DataError, match="vocab.bpe"):
        tkz.GPT2Tokenizer()


def hf_ids(json_text: str, texts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer
    hf = Tokenizer.from_str(json_text)
    hf.encode_special_tokens = True
    return [hf.encode(t, add_special_tokens=False).ids for t in texts]


def test_bpe_encodes_exactly_like_tokenizers(bpe):
    """tiktoken on the trained ranks gives the ids of the tokenizers library itself."""
    texts = corpus(30, seed=5) + [UNICODE, "unseen wörds ½ ∑ 𝔘 <|endoftext|>", "  \n\n\t x"]
    assert not isinstance(bpe.encoding, tkz._HFEncoding)
    assert [bpe.encode(t) for t in texts] == hf_ids(bpe._json, texts)
    assert bpe.eos_id == json.loads(bpe._json)["model"]["vocab"]["<|endoftext|>"] == 0


def test_bpe_with_out_of_order_merges_falls_back_to_tokenizers(bpe):
    spec = json.loads(bpe._json)
    merges = spec["model"]["merges"]
    merges[0], merges[5] = merges[5], merges[0]  # rank order no longer follows the ids
    odd = tkz.BPETokenizer("bpe:400", json.dumps(spec))
    texts = corpus(5, seed=2) + [UNICODE, "a<|endoftext|>b"]
    assert isinstance(odd.encoding, tkz._HFEncoding)
    assert [odd.encode(t) for t in texts] == hf_ids(json.dumps(spec), texts) == odd.encode_batch(texts)
    assert odd.decode(odd.encode(UNICODE)) == UNICODE and odd.eos_id not in odd.encode("a<|endoftext|>b")


def test_bpe_round_trip_and_size(bpe):
    assert bpe.name == "bpe:400" and bpe.vocab_size <= 400 and bpe.dtype == "uint16"
    for text in [UNICODE, "unseen wörds ½ ∑ 𝔘", "", "the of and"]:
        assert bpe.decode(bpe.encode(text)) == text
    texts = corpus(5, seed=9)
    assert bpe.encode_batch(texts) == [bpe.encode(t) for t in texts]
    assert len(bpe.encode(" the of and to")) < len(b" the of and to")  # it learned merges


def test_bpe_training_is_deterministic(bpe):
    again = tkz.train_bpe(iter(corpus(40)), 400)
    assert again.fingerprint() == bpe.fingerprint()
    assert again.encode(UNICODE) == bpe.encode(UNICODE)


def test_bpe_save_and_load(bpe, tmp_path):
    bpe.save(tmp_path)
    loaded = tkz.load_tokenizer("bpe:400", tmp_path)
    assert (loaded.name, loaded.vocab_size, loaded.eos_id) == (bpe.name, bpe.vocab_size, bpe.eos_id)
    assert loaded.fingerprint() == bpe.fingerprint()
    assert loaded.encode(UNICODE) == bpe.encode(UNICODE)
    tkz.gpt2().save(tmp_path / "gpt2")  # nothing to write, and no error
    with pytest.raises(DataError, match="more than bpe:300"):
        tkz.load_tokenizer("bpe:300", tmp_path)


@pytest.mark.parametrize("name, message", [("gpt3", "'gpt3'"), ("bpe:abc", "'bpe:abc'"), ("bpe:12", "between"),
                                           ("BPE:100", "'BPE:100'"), ("", "''")])
def test_unknown_tokenizer_names(name, message):
    with pytest.raises(DataError, match=message):
        tkz.load_tokenizer(name)


def test_bpe_load_errors(tmp_path):
    with pytest.raises(DataError, match="data folder"):
        tkz.load_tokenizer("bpe:400")
    with pytest.raises(DataError, match=str(tmp_path / "tokenizer.json")):
        tkz.load_tokenizer("bpe:400", tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizer file"):
        tkz.load_tokenizer("bpe:400", tmp_path)


@pytest.mark.parametrize("size", [7, 40, 300])
def test_split_for_encoding_tokenizes_like_the_whole(bpe, size):
    rng = random.Random(size)
    pieces = [UNICODE, " ", "\n", "  \n", "\t", "word", "!!", "'s", "12", "\u3000", "\n\n \n"]
    text = "".join(rng.choice(pieces) for _ in range(800))
    chunks = list(tkz.split_for_encoding(text, size))
    assert "".join(chunks) == text and len(chunks) > 1
    for tok in (tkz.gpt2(), bpe):
        assert [i for c in chunks for i in tok.encode(c)] == tok.encode(text)


def test_split_for_encoding_leaves_unsplittable_text_whole():
    assert list(tkz.split_for_encoding("x" * 100, 10)) == ["x" * 100]
    assert list(tkz.split_for_encoding("", 10)) == []


def test_large_vocabularies_pack_uint32():
    import numpy as np
    tkz.gpt2().encoding  # noqa: B018 - built before the copy below claims another size
    tok = object.__new__(tkz.GPT2Tokenizer)
    tok.__dict__.update(tkz.gpt2().__dict__, vocab_size=70000)  # as a bpe:N above 65536 tokens would be
    assert tok.dtype == "uint32"
    data, = tok.encode_packed(["Hello world"])
    assert np.frombuffer(data, "<u4").tolist() == [15496, 995]
