"""What `mrl convert` reads, bounded: only regular files, at most `MAX_INPUT_BYTES`, UTF-8 text;
YAML composed by libyaml (else PyYAML) and checked before it is built into Python objects, so
that aliases cannot multiply it (a "billion laughs" document is a few hundred bytes that expand to
billions of nodes) and nesting stays shallow. A verl config is some 40 kB, a launch script a few.
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from mrl.errors import UserError

MAX_INPUT_BYTES = 2 * 1024 * 1024
MAX_YAML_NODES = 200_000      # nodes of the document with every alias expanded
MAX_YAML_DEPTH = 64

_Base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class VerlYamlLoader(_Base):
    """YAML as OmegaConf reads it: `1e-6` (no dot) is a float, not a string as in YAML 1.1."""


VerlYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"),
    list("-+0123456789."))


def read_text(path: Path, what: str = "file") -> str:
    """The text of a regular file of at most MAX_INPUT_BYTES; anything else is one line naming it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"{path}: file not found")
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror})")
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file"
        raise UserError(f"{path}: {kind}; mrl convert reads a regular {what}")
    if st.st_size > MAX_INPUT_BYTES:
        raise UserError(f"{path}: {st.st_size} bytes; mrl convert reads a {what} of at most {MAX_INPUT_BYTES} bytes")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror})")
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):     # replaced between stat and open
            raise UserError(f"{path}: not a regular file; mrl convert reads a regular {what}")
        data = f.read(MAX_INPUT_BYTES + 1)
    if len(data) > MAX_INPUT_BYTES:
        raise UserError(f"{path}: larger than {MAX_INPUT_BYTES} bytes; mrl convert reads a {what} of at most that")
    if b"\x00" in data:
        raise UserError(f"{path}: a binary file (it holds NUL bytes), not a {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}); mrl convert reads a {what}")


def load_yaml(text: str, name: str) -> Any:
    """One YAML document, refused in one line when its aliases expand it past MAX_YAML_NODES nodes,
    when it nests deeper than MAX_YAML_DEPTH, or when an alias refers to itself."""
    loader = VerlYamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check(node, name)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise UserError(f"{name}: invalid YAML: {str(e).splitlines()[0]}")
    finally:
        loader.dispose()


def _check(root: yaml.Node, name: str) -> None:
    """Count the nodes of the document as it expands (shared alias targets counted at each use),
    without expanding it: sizes are memoized per node, so the walk is linear in the text."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = _children(node)
        if done:
            active.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children)
            depth[key] = 1 + max((depth[id(c)] for c in children), default=0)
            if size[key] > MAX_YAML_NODES:
                raise UserError(f"{name}: the YAML expands to more than {MAX_YAML_NODES} nodes (aliases repeat "
                                "parts of it); mrl convert refuses it")
            if depth[key] > MAX_YAML_DEPTH:
                raise UserError(f"{name}: the YAML nests deeper than {MAX_YAML_DEPTH} levels; mrl convert refuses it")
            continue
        if key in size:
            continue
        if key in active:
            raise UserError(f"{name}: a YAML alias refers to the node that contains it; mrl convert refuses it")
        active.add(key)
        stack.append((node, True))
        for c in children:
            if id(c) in active:
                raise UserError(f"{name}: a YAML alias refers to the node that contains it; mrl convert refuses it")
            if id(c) not in size:
                stack.append((c, False))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [x for pair in node.value for x in pair]
    return []
