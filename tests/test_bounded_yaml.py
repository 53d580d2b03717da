"""Config files and values bounded before any work: the YAML (size, nesting, aliases
expanded, encoding, duplicate keys, what kind of file it is) and every field's type and
size, each refusal one line naming the file or the field, and fast."""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import typing
from pathlib import Path

import pytest

from distlm import bounded_yaml
from distlm.config import SECTIONS, STRING_LIMIT, ConfigError, config_from_dict, load_config, to_yaml


def refused(path: Path, *words: str, seconds: float = 5.0, named: str = "") -> str:
    """The one-line refusal of config file ``path``, naming it (or ``named``: the field)."""
    t = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    took = time.perf_counter() - t
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400 and (named or str(path)) in msg, msg
    for w in words:
        assert w in msg, msg
    assert took < seconds, f"{took:.1f} s to refuse"
    return msg


def alias_bomb(use: str) -> str:
    """A billion-element tree in under 1 KB: nine levels of ten aliases each."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    return "\n".join(lines) + "\n" + use.replace("BOMB", "*a8") + "\n"


@pytest.mark.parametrize("use", ["", "log: {sample_prompt: BOMB}", "model: {n_layer: BOMB}", "train: BOMB"])
def test_an_alias_bomb_is_refused_fast(use, tmp_path):
    text = alias_bomb(use)
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    assert len(text) < 1024
    refused(path, "alias", seconds=2.0)


def test_a_self_containing_alias_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("log: &a {name: [*a]}\n")
    refused(path)


@pytest.mark.parametrize("depth", [bounded_yaml.MAX_DEPTH + 1, 5000, 200_000])
def test_deep_nesting_is_refused_in_one_line(depth, tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("log: " + "[" * depth + "]" * depth + "\n")
    refused(path, "nested")


def test_a_file_over_the_size_limit_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "big.yaml"
    with open(path, "wb") as f:
        f.truncate(bounded_yaml.MAX_BYTES + 1)
    refused(path, "limit")


@pytest.mark.parametrize("data", [b"log:\n  name: caf\xe9\n", b"\xff\xfe\x00l\x00o\x00g", b"model: {n_layer: 2}\n\x80"])
def test_non_utf8_is_refused_in_one_line(data, tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(data)
    refused(path, "UTF-8")


@pytest.mark.parametrize("text", ["model:\n  n_layer: 2\n  n_layer: 3\n", "train: {max_steps: 1}\ntrain: {lr: 0.1}\n",
                                  "log: {name: a, name: b}\n"])
def test_a_key_given_twice_is_refused(text, tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    refused(path, "twice")


@pytest.mark.parametrize("kind", ["fifo", "folder", "device"])
def test_a_config_that_is_not_a_regular_file_is_named_for_what_it_is(kind, tmp_path):
    if kind == "device":
        path = Path("/dev/null.yaml")
        if not path.exists():
            path = tmp_path / "null.yaml"
            os.symlink("/dev/zero", path)
        word = "character device"
    elif kind == "fifo":
        path = tmp_path / "pipe.yaml"
        os.mkfifo(path)
        word = "FIFO"
    else:
        path = tmp_path / "dir.yaml"
        path.mkdir()
        word = "folder"
    done = []
    worker = threading.Thread(target=lambda: done.append(refused(path, word)), daemon=True)
    worker.start()
    worker.join(10)
    assert done and "not found" not in done[0], "hung or misnamed"


# ---- every field ---------------------------------------------------------------------------
def fields_of(kind) -> list[str]:
    out = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            args = [a for a in typing.get_args(t) if a is not type(None)] or [t]
            if args[0] is kind:
                out.append(f"{section}.{f.name}")
    return out


STRINGS = fields_of(str)
INTS = fields_of(int)
NUMBERS = INTS + fields_of(float)


def test_the_field_lists_cover_the_config():
    assert "log.sample_prompt" in STRINGS and "train.max_steps" in INTS and len(STRINGS) > 20


@pytest.mark.parametrize("key", STRINGS)
def test_every_string_field_has_a_size_limit(key, tmp_path):
    section, name = key.split(".")
    huge = "x" * (max(STRING_LIMIT, 1 << 16) + 1)
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [f"{key}={huge}"])
    msg = str(e.value)
    assert msg.startswith(key) and "characters" in msg and len(msg) < 300, msg[:300]
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({section: {name: huge}}))
    refused(path, "characters", named=key)


@pytest.mark.parametrize("key", STRINGS + NUMBERS)
@pytest.mark.parametrize("value", [[1, 2], {"a": 1}])
def test_every_field_refuses_a_list_or_a_mapping(key, value, tmp_path):
    section, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({section: {name: value}}))
    refused(path, "single value", named=key)


@pytest.mark.parametrize("key", INTS)
def test_every_integer_field_refuses_a_huge_integer_without_printing_it(key, tmp_path):
    section, name = key.split(".")
    digits = "9" * 4000
    for given in (lambda: load_config("tiny", [f"{key}={digits}"]),
                  lambda: config_from_dict({section: {name: int(digits)}}, "marker"),
                  lambda: load_config(str(_yaml(tmp_path, f"{section}:\n  {name}: {digits}\n")))):
        with pytest.raises(ConfigError) as e:
            given()
        msg = str(e.value)
        assert key in msg and "99999999999999999999" not in msg and "\n" not in msg, msg[:200]


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "int.yaml"
    path.write_text(text)
    return path


def test_a_config_at_every_limit_stays_far_below_what_distlm_reads_back(tmp_path):
    """The run's own config.yaml and checkpoint marker must never exceed the limits distlm
    reads them with (a run that trained for days refused its own checkpoints)."""
    from distlm.checkpoint.verify import _MARKER_LIMIT
    cfg = load_config("tiny", ["log.sample_prompt=" + "p" * STRING_LIMIT, "log.name=" + "n" * 200,
                               "log.wandb_project=" + "w" * STRING_LIMIT])
    text = to_yaml(cfg)
    assert len(text.encode()) < bounded_yaml.MAX_BYTES // 4
    marker = json.dumps({"config": cfg.to_dict()}, indent=1)
    assert len(marker.encode()) * 16 < _MARKER_LIMIT
    # and the config.yaml written is read back as it was
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert load_config(str(path)).log.sample_prompt == "p" * STRING_LIMIT
