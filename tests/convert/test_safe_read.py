"""`mrl convert` reads what it is given within bounds (issue 34): YAML bombs (lists, aliases,
interpolations), an oversized file, a binary file, a directory or a FIFO each give one line and
no traceback, and nothing hangs. The tests bound sizes, not time: each input is refused before
the work it would cause."""
from __future__ import annotations

import os
import random

import pytest

from mrl.convert.safe_read import MAX_INPUT_BYTES, MAX_YAML_NODES, load_yaml

LIST_BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 10) + "]\n" for i in range(8))
MAP_BOMB = "a: &a {k0: v, k1: v, k2: v, k3: v, k4: v, k5: v, k6: v, k7: v, k8: v, k9: v}\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} {{" + ", ".join(f"k{j}: *{chr(97 + i)}" for j in range(10)) + "}\n" for i in range(8))
INTERPOLATION_BOMB = "l0: xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\n" + "".join(
    f"l{i + 1}: '" + "${l" + str(i) + "}" * 1 + ("${l" + str(i) + "}") * 9 + "'\n" for i in range(12)) + \
    "trainer:\n  project_name: ${l12}\n"


def _convert(cli, tmp_path, name, text=None):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    rc, out, err = cli("convert", path, "-o", tmp_path / "job.toml")
    assert "Traceback" not in err and "MemoryError" not in err
    return rc, err


@pytest.mark.parametrize("text", [LIST_BOMB, MAP_BOMB], ids=["list bomb", "alias mapping bomb"])
def test_alias_bombs_are_refused_in_one_line(cli, tmp_path, text):
    rc, err = _convert(cli, tmp_path, "bomb.yaml", text)
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and f"more than {MAX_YAML_NODES} nodes" in lines[0]


def test_an_interpolation_bomb_is_refused_in_one_line(cli, tmp_path):
    """Each level repeats the one below 10 times: 10^12 characters at the top. Refused at the cap,
    before the value is built."""
    rc, err = _convert(cli, tmp_path, "interp.yaml", INTERPOLATION_BOMB)
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "expand past 100000 characters" in lines[0]
    assert not (tmp_path / "job.toml").exists()


def test_deep_chains_and_recursive_aliases_are_refused(cli, tmp_path):
    chain = "".join(f"k{i}: ${{k{i + 1}}}\n" for i in range(2000)) + "k2000: 1\ntrainer:\n  total_epochs: ${k0}\n"
    rc, err = _convert(cli, tmp_path, "chain.yaml", chain)
    assert rc == 2 and "nested more than 50 deep" in err and err.count("error:") == 1
    rc, err = _convert(cli, tmp_path, "rec.yaml", "a: &a [1, *a]\n")
    assert rc == 2 and "refers to the node that contains it" in err
    rc, err = _convert(cli, tmp_path, "deep.yaml", "a: " + "[" * 200 + "]" * 200 + "\n")
    assert rc == 2 and "nests deeper" in err


def test_a_file_over_the_size_cap_is_refused_before_it_is_read(cli, tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:              # 150 MB, sparse: nothing is written or read
        f.truncate(150 * 1024 * 1024)
    rc, err = _convert(cli, tmp_path, "big.yaml")
    assert rc == 2 and f"at most {MAX_INPUT_BYTES} bytes" in err and err.count("error:") == 1


@pytest.mark.parametrize("name", ["bin.yaml", "bin.sh"])
def test_binary_files_are_refused(cli, tmp_path, name):
    (tmp_path / name).write_bytes(bytes(random.Random(0).randrange(256) for _ in range(4096)))
    rc, err = _convert(cli, tmp_path, name)
    assert rc == 2 and err.count("error:") == 1 and ("binary" in err or "not UTF-8" in err)


@pytest.mark.parametrize("name", ["dir.yaml", "dir.sh"])
def test_a_directory_is_refused(cli, tmp_path, name):
    (tmp_path / name).mkdir()
    rc, err = _convert(cli, tmp_path, name)
    assert rc == 2 and "a directory" in err and err.count("error:") == 1


@pytest.mark.parametrize("name", ["fifo.yaml", "fifo.sh"])
def test_a_fifo_is_refused_without_waiting_for_a_writer(cli, tmp_path, name):
    os.mkfifo(tmp_path / name)
    rc, err = _convert(cli, tmp_path, name)
    assert rc == 2 and "a FIFO" in err and err.count("error:") == 1


def test_yaml_structure_fuzz_never_escapes_as_a_traceback():
    """Random small documents built from anchors, aliases, lists, maps and scalars: each loads or is
    refused with a UserError, nothing else."""
    from mrl.errors import UserError

    rng = random.Random(7)
    pieces = ["[", "]", "{", "}", ", ", ": ", "&a ", "*a", "&b ", "*b", "x", "1", "- ", "\n", "  ", "'", '"', "${x}"]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40)))
        try:
            load_yaml(text, "fuzz")
        except UserError:
            pass
