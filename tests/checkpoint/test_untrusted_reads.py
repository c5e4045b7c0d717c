"""Untrusted bytes are never unpickled: the product (mrl/, kernels/, tools/) is searched for every
way a file could reach a plain unpickler, and crafted checkpoints are given to `mrl merge`.

Readers mrl must not call on a checkpoint directly: `pickle.load(s)`, `torch.load` without
`weights_only=True`, `numpy.load(allow_pickle=True)`, and megatron/torch's readers that unpickle
`.metadata` or `common.pt`. Allowed: `mrl.checkpoint.trust` (the restricted readers), and
`dist_checkpointing.load` only in a function that first ran both restricted readers."""
from __future__ import annotations

import ast
import os
import pickle
from pathlib import Path

import pytest
import torch

from mrl.checkpoint import manifest, store, trust
from mrl.errors import UserError

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("mrl", "kernels", "tools")
# megatron/torch readers that unpickle a checkpoint file themselves
UNVERIFIED_READERS = {"read_metadata", "load_tensors_metadata", "load_common_state_dict", "load_sharded_metadata",
                      "FileSystemReader", "load_plain_tensors", "load_content_metadata"}
# pickle over the job's own process group (rank to rank messages in memory, never a file): allowed
RANK_MESSAGES = {("mrl/platform/bridge.py", "pickle.loads"), ("mrl/train/wire.py", "pickle.loads")}


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return "?"


def _kw_true(call: ast.Call, key: str) -> bool:
    return any(k.arg == key and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def _findings(rel: str, tree: ast.AST) -> list[str]:
    out = []
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))]:
        body_calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
        names = [_name(c.func) for c in body_calls]
        for call, name in zip(body_calls, names):
            where = f"{rel}:{call.lineno} {name}"
            last = name.rsplit(".", 1)[-1]
            if name in ("pickle.load", "pickle.loads", "cPickle.load", "dill.load", "dill.loads", "marshal.loads"):
                if (rel, name) not in RANK_MESSAGES:
                    out.append(where)
            elif name == "torch.load" and not _kw_true(call, "weights_only"):
                out.append(where + " without weights_only=True")
            elif name in ("np.load", "numpy.load") and _kw_true(call, "allow_pickle"):
                out.append(where + " allow_pickle=True")
            elif last in UNVERIFIED_READERS:
                out.append(where + " (unpickles a checkpoint file unverified)")
            elif name.endswith("dist_checkpointing.load") and isinstance(fn, ast.FunctionDef):
                if not {"trust.read_dcp_metadata", "trust.read_common"} <= set(names[:names.index(name)]):
                    out.append(where + " before trust.read_dcp_metadata and trust.read_common")
        for cls in [n for n in ast.walk(fn) if isinstance(n, ast.ClassDef)]:
            if any(_name(b).endswith("Unpickler") for b in cls.bases) and rel != "mrl/checkpoint/trust.py":
                out.append(f"{rel}:{cls.lineno} an Unpickler outside mrl/checkpoint/trust.py")
    return sorted(set(out))


def test_product_never_unpickles_untrusted_bytes():
    found = []
    for top in PRODUCT:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            found += _findings(rel, ast.parse(path.read_text(encoding="utf-8"), filename=rel))
    assert not found, "\n".join(found)


def test_the_search_finds_what_it_looks_for():
    src = ("import pickle, torch\n"
           "def f(p):\n    pickle.load(open(p,'rb'))\n    torch.load(p)\n    torch.load(p, weights_only=False)\n"
           "    torch.load(p, weights_only=True)\n    r.read_metadata()\n"
           "def g(s, p):\n    dist_checkpointing.load(s, p)\n"
           "def h(s, p):\n    trust.read_dcp_metadata(p)\n    trust.read_common(p)\n    dist_checkpointing.load(s, p)\n")
    got = _findings("mrl/x.py", ast.parse(src))
    assert [g.split(" ", 1)[1].split(" ")[0] for g in got] == ["pickle.load", "torch.load", "torch.load",
                                                               "r.read_metadata", "dist_checkpointing.load"]


# ----------------------------------------------------------------------------- crafted checkpoints

class Evil:
    """Unpickling this runs code that creates a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def _crafted(root: Path, marker: Path, which: str) -> Path:
    """A checkpoint root whose step holds a crafted `.metadata` or `common.pt`, with a manifest
    re-written to match (the manifest is integrity, an attacker can write one)."""
    d = root / "step_00000004"
    d.mkdir(parents=True)
    (d / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1, '
                                     '"common_backend": "torch", "common_backend_version": 1}')
    # a recorded model, so a reader that trusted the files would go on to read `.metadata`
    hf = {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    torch.save({"step": 4, "extra": {"hf_config": hf}}, d / "common.pt")
    with open(d / ".metadata", "wb") as f:
        pickle.dump({"state_dict_metadata": {}}, f)
    with open(d / which, "wb") as f:
        pickle.dump({"extra": Evil(str(marker))}, f)
    manifest.write(d, {rel: manifest.file_entry(d / rel) for rel in manifest.listed_files(d)}, step=4, optimizer=False)
    store.write_latest(root, d.name)
    return d


@pytest.mark.parametrize("which, said", [(".metadata", ".metadata is not plain checkpoint metadata"),
                                         ("common.pt", "common.pt is not plain data")])
def test_merge_of_a_crafted_checkpoint_runs_no_code(tmp_path, capsys, which, said):
    from mrl.cli import main

    marker = tmp_path / "pwned"
    _crafted(tmp_path / "ckpt", marker, which)
    assert main(["merge", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_merge_refuses_files_the_manifest_does_not_vouch_for(tmp_path, capsys):
    from mrl.cli import main

    d = _crafted(tmp_path / "ckpt", tmp_path / "pwned", ".metadata")
    (d / ".metadata").write_bytes(b"changed after the manifest")
    assert main(["merge", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was not read: .metadata" in err[0], err
    (d / "manifest.json").unlink()
    assert main(["merge", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    assert "no manifest.json" in capsys.readouterr().err


def test_restricted_readers_accept_plain_checkpoint_files(tmp_path):
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                       TensorStorageMetadata)

    meta = Metadata(state_dict_metadata={"embedding.word_embeddings.weight": TensorStorageMetadata(
        TensorProperties(dtype=torch.bfloat16), torch.Size([8, 4]), [ChunkStorageMetadata(torch.Size([0, 0]),
                                                                                          torch.Size([8, 4]))])})
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    torch.save({"step": 3, "extra": {"a": [1, 2.5, "x"]}, "t": torch.ones(2)}, tmp_path / "common.pt")
    shapes = trust.tensor_shapes(tmp_path)
    assert shapes == {"embedding.word_embeddings.weight": trust.TensorShape((8, 4), torch.bfloat16)}
    assert trust.read_common(tmp_path)["extra"] == {"a": [1, 2.5, "x"]}


# ----------------------------------------------------------------------------- `latest` stays inside its root

@pytest.mark.parametrize("case", ["absolute", "dotdot", "symlink_out", "other_name"])
def test_latest_naming_anything_outside_the_root_is_refused(tmp_path, case):
    from mrl.merge.source import resolve_checkpoint

    root, foreign = tmp_path / "run" / "actor", tmp_path / "other" / "actor"
    for r in (root, foreign):
        (r / "step_00000002").mkdir(parents=True)
    name = {"absolute": str(foreign / "step_00000002"), "dotdot": "../../other/actor/step_00000002",
            "symlink_out": "step_00000009", "other_name": "checkpoints"}[case]
    if case == "symlink_out":
        os.symlink(foreign / "step_00000002", root / "step_00000009")
    (root / "latest").write_text(name + "\n")
    for reader in (store.latest, resolve_checkpoint):
        with pytest.raises(UserError) as e:
            reader(root)
        assert "latest" in str(e.value) and "\n" not in str(e.value) and "refused" in str(e.value)
    # a step symlink leading out of the root is not one of its checkpoints (retention cannot follow it)
    assert [p.name for p in store.checkpoints(root)] == ["step_00000002"]


def test_latest_inside_the_root_still_resolves(tmp_path):
    (tmp_path / "step_00000002").mkdir()
    os.symlink("step_00000002", tmp_path / "step_00000003")   # a link inside the root is fine
    store.write_latest(tmp_path, "step_00000003")
    assert store.latest(tmp_path) == tmp_path / "step_00000003"
