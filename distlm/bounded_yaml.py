"""YAML that a config may hold, read with its size bounded before any work.

A config file can come from anyone (a shared preset, a run folder from a tarball), and
PyYAML alone will read a 1 KB alias bomb into a billion-element tree once its values are
walked or printed, recurse until Python's stack runs out on deep nesting, decode
whatever bytes it is given, and keep the last of two equal keys without a word. Here,
before a value is built:

- the file is a regular file (not a link's target outside the folder, a FIFO or a
  device) of at most MAX_BYTES, and UTF-8;
- nesting is at most MAX_DEPTH deep, and the tree, each alias counted as the copy it
  stands for, has at most MAX_NODES nodes (a config has a few hundred);
- a key given twice in one mapping is refused.

Each refusal is one ConfigError line naming the file.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from distlm.errors import ConfigError

MAX_BYTES = 1 << 20
MAX_DEPTH = 16
MAX_NODES = 10_000

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_config_bytes(path: Path, limit: int = MAX_BYTES) -> bytes:
    """The bytes of a config file: a regular file (opened without blocking on a FIFO, checked
    on the open descriptor) of at most ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        if e.errno == errno.EISDIR:
            raise ConfigError(f"{path}: is a folder, not a config file") from None
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # before fdopen, which refuses a folder with a bare OSError
        os.close(fd)
        raise ConfigError(f"{path}: is {_kind(st.st_mode)}, not a config file")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise ConfigError(f"{path}: {st.st_size:,} bytes, over the {limit:,}-byte limit of a config file")
        os.set_blocking(fd, True)
        data = f.read(limit + 1)
    if len(data) > limit:  # grew while read
        raise ConfigError(f"{path}: over the {limit:,}-byte limit of a config file")
    return data


class _Loader(yaml.SafeLoader):
    """SafeLoader with a depth bound while composing and no duplicate keys."""

    def __init__(self, stream, origin: str):
        super().__init__(stream)
        self.origin, self._depth = origin, 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise ConfigError(f"{self.origin}: nested more than {MAX_DEPTH} levels deep (line {mark.line + 1}); "
                                  f"a config is a mapping of sections")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if isinstance(key_node, ScalarNode):
                    if key_node.value in seen:
                        raise ConfigError(f"{self.origin}: key {key_node.value[:80]!r} given twice (line "
                                          f"{key_node.start_mark.line + 1}); each key once")
                    seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


def _expanded_size(root) -> int:
    """Nodes of the tree with every alias expanded, counted without expanding it: a node's
    size is 1 + its children's, each shared node's size computed once (an alias is the same
    node object as its anchor). A node that contains itself (``&a [*a]``) is endless.
    Counting stops past MAX_NODES, or past MAX_DEPTH levels of the expanded tree."""
    sizes: dict[int, int] = {}

    def size(node, depth: int) -> int:
        if depth > MAX_DEPTH:
            return MAX_NODES + 1
        known = sizes.get(id(node))
        if known is not None:
            return MAX_NODES + 1 if known < 0 else known
        sizes[id(node)] = -1  # being counted: met again below, it contains itself
        total = 1
        for child in _children(node):
            total += size(child, depth + 1)
            if total > MAX_NODES:
                break
        sizes[id(node)] = total
        return total

    return size(root, 0)


def _children(node):
    if isinstance(node, SequenceNode):
        return node.value
    if isinstance(node, MappingNode):
        return [x for pair in node.value for x in pair]
    return []


def load_yaml(data: bytes, origin: str):
    """The value of one YAML document ``data`` (bytes), bounded as this module says."""
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{origin}: {len(data):,} bytes, over the {MAX_BYTES:,}-byte limit of a config file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{origin}: not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from None
    loader = _Loader(text, origin)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node) > MAX_NODES:
            raise ConfigError(f"{origin}: more than {MAX_NODES:,} values once its aliases are expanded (an alias "
                              f"bomb?); a config holds a few hundred")
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ConfigError(f"{origin}: invalid YAML: {str(e).splitlines()[0][:200]}") from None
    except RecursionError:
        raise ConfigError(f"{origin}: nested too deeply") from None
    finally:
        loader.dispose()


def read_yaml_file(path: Path):
    """load_yaml of a config file (read_config_bytes)."""
    return load_yaml(read_config_bytes(Path(path)), str(path))
