"""`.metadata` is unpickled against an exact allowlist (`mrl.checkpoint.pickle_plain`).

Crafted pickles, written opcode by opcode, try every way a pickle can reach code: a dotted
global that `find_class` walks (`("torch.distributed.checkpoint.filesystem", "pickle.loads")`,
as GLOBAL and as protocol-4 STACK_GLOBAL), a non-dotted global of an allowed module that is no
metadata type (`os`, `Path`), INST / OBJ / NEWOBJ_EX, REDUCE of an allowed constructor with
crafted arguments, BUILD on a class or module (setattr on global state). Each one is refused
with one line by every command that reads a checkpoint (`mrl merge`, `mrl eval`, `mrl
generate`, and training's `checkpoint.load_from`, which all read through `trust`), and a
property test generates crafted globals and checks none reaches a callable outside the list.
Real torch_dist metadata written by megatron (fp32 and bf16, `scripts/real_metadata.py`) still
loads, equal to what plain pickle reads.
"""
from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path

import pytest
import torch

from mrl.checkpoint import manifest, pickle_plain, store, trust
from mrl.errors import UserError

FS = "torch.distributed.checkpoint.filesystem"


def _str(s: str) -> bytes:
    b = s.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(b)]) + b if len(b) < 256 else pickle.BINUNICODE + struct.pack("<I", len(b)) + b


def _stack_global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + pickle.STACK_GLOBAL


def _proto(n: int = 4) -> bytes:
    return pickle.PROTO + bytes([n])


def _evil_bytes(marker: Path) -> bytes:
    """A plain pickle that creates `marker` when unpickled (by an unrestricted unpickler)."""
    return pickle.dumps(_Evil(str(marker)), protocol=2)


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def _tuple1(item: bytes) -> bytes:
    return item + pickle.TUPLE1


def crafted(form: str, marker: Path) -> bytes:
    """A `.metadata` of one attack `form`; unpickled unrestricted, it creates `marker` (or, for
    the BUILD forms, changes global state the test checks)."""
    evil = _evil_bytes(marker)
    cmd = _str(f"touch {marker}")
    blob = pickle.BINBYTES + struct.pack("<I", len(evil)) + evil
    if form == "stack_global_dotted":            # the reported breach
        return _proto() + _stack_global(FS, "pickle.loads") + _tuple1(blob) + pickle.REDUCE + pickle.STOP
    if form == "global_dotted":                  # GLOBAL under protocol 4 walks dots too
        return _proto() + pickle.GLOBAL + f"{FS}\nos.system\n".encode() + _tuple1(cmd) + pickle.REDUCE + pickle.STOP
    if form == "inst_dotted":                    # INST: find_class, then klass(*args)
        return _proto() + pickle.MARK + cmd + pickle.INST + f"{FS}\nos.system\n".encode() + pickle.STOP
    if form == "obj_dotted":                     # OBJ: MARK klass args OBJ
        return (_proto() + pickle.MARK + _stack_global(FS, "os.system") + cmd + pickle.OBJ + pickle.STOP)
    if form == "newobj_ex":                      # cls.__new__(cls, *args, **kwargs) of a non-metadata class
        return (_proto() + _stack_global(FS, "Path") + _tuple1(_str(str(marker))) + pickle.EMPTY_DICT
                + pickle.NEWOBJ_EX + pickle.STOP)
    if form == "undotted_foreign":               # a plain name of an allowed module that is no metadata type
        return (_proto() + _stack_global("torch.distributed.checkpoint.format_utils", "os") + pickle.STOP)
    if form == "reduce_allowed_bad_args":        # an allowed constructor called with a crafted object
        return (_proto() + _stack_global("torch", "Size") + _tuple1(_stack_global(FS, "pickle.loads"))
                + pickle.REDUCE + pickle.STOP)
    if form == "reduce_a_dtype":                 # REDUCE of an allowed global that is no constructor
        return _proto() + _stack_global("torch", "float32") + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.STOP
    if form == "build_on_module":                # setattr on a module: os.sep = "!" (slot state)
        return (_proto() + _stack_global(FS, "os") + pickle.NONE + pickle.EMPTY_DICT + _str("sep") + _str("!")
                + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD + pickle.STOP)
    if form == "build_on_class":                 # setattr on an allowed class: Metadata.version = "pwned"
        return (_proto() + _stack_global("torch.distributed.checkpoint.metadata", "Metadata") + pickle.NONE
                + pickle.EMPTY_DICT + _str("version") + _str("pwned") + pickle.SETITEM + pickle.TUPLE2
                + pickle.BUILD + pickle.STOP)
    if form == "build_unknown_field":            # a metadata instance with a field it does not have
        return (_proto() + _stack_global("torch.distributed.checkpoint.metadata", "StorageMeta")
                + pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_DICT + _str("__class__") + _str("x")
                + pickle.SETITEM + pickle.BUILD + pickle.STOP)
    if form == "build_setstate_crafted":         # TensorProperties.__setstate__ fed a state that is no such tuple
        return (_proto() + _stack_global("torch.distributed.checkpoint.metadata", "TensorProperties")
                + pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.MARK + _stack_global(FS, "os") + pickle.NONE
                + pickle.NEWFALSE + pickle.NONE + pickle.NEWFALSE + pickle.TUPLE + pickle.BUILD + pickle.STOP)
    if form == "ext_code":                       # copyreg's extension registry
        return _proto() + pickle.EXT1 + b"\x01" + pickle.STOP
    if form == "persistent_id":
        return _proto() + _str("x") + pickle.BINPERSID + pickle.STOP
    raise AssertionError(form)


FORMS = ["stack_global_dotted", "global_dotted", "inst_dotted", "obj_dotted", "newobj_ex", "undotted_foreign",
         "reduce_allowed_bad_args", "reduce_a_dtype", "build_on_module", "build_on_class", "build_unknown_field",
         "build_setstate_crafted",
         "ext_code", "persistent_id"]


@pytest.fixture
def global_state():
    """os.sep and Metadata.version before, restored after (a BUILD attack on an unrestricted
    unpickler changes them)."""
    from torch.distributed.checkpoint.metadata import Metadata

    before = (os.sep, Metadata.__dict__.get("version"))
    yield before
    os.sep = before[0]
    Metadata.version = before[1]


def _untouched(marker: Path, before) -> bool:
    from torch.distributed.checkpoint.metadata import Metadata

    return not marker.exists() and (os.sep, Metadata.__dict__.get("version")) == before


@pytest.mark.parametrize("form", FORMS)
def test_every_crafted_form_is_refused_in_one_line(tmp_path, form, global_state):
    marker = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(crafted(form, marker))
    with pytest.raises(UserError) as e:
        trust.read_dcp_metadata(tmp_path)
    message = str(e.value)
    assert "\n" not in message and ".metadata is not plain checkpoint metadata" in message, message
    assert _untouched(marker, global_state)


def test_the_crafted_forms_do_run_code_unrestricted(tmp_path, global_state):
    """The attacks are real: plain pickle runs them (so the refusals above are not vacuous)."""
    ran = []
    for form in ("stack_global_dotted", "global_dotted", "inst_dotted", "obj_dotted"):
        marker = tmp_path / f"pwned_{form}"
        try:
            pickle.loads(crafted(form, marker))
        except Exception:   # noqa: BLE001 - the code ran before anything failed
            pass
        ran.append(marker.exists())
    pickle.loads(crafted("build_on_module", tmp_path / "x"))
    changed = os.sep == "!"
    os.sep = global_state[0]
    assert ran == [True] * 4 and changed


# ----------------------------------------------------------------------------- property: crafted globals

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_MODULES = ["torch", "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner", FS,
            "torch.serialization", "collections", "builtins", "os", "pickle", "torch.distributed.checkpoint",
            "torch.distributed.checkpoint.format_utils", "torch.distributed.checkpoint.metadata.torch"]
_NAMES = ["Size", "Metadata", "_StorageInfo", "os", "pickle", "loads", "system", "float32", "bfloat16",
          "OrderedDict", "_get_layout", "Path", "eval", "exec", "getattr", "__builtins__", "__class__", "torch",
          "dcp_to_torch_save", "TensorProperties", "strided", "__reduce_ex__", "load", "_MEM_FORMAT_ENCODING"]


@st.composite
def _dotted(draw):
    parts = draw(st.lists(st.sampled_from(_NAMES), min_size=1, max_size=3))
    return ".".join(parts)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(module=st.one_of(st.sampled_from(_MODULES), st.text(min_size=0, max_size=12)),
       name=st.one_of(_dotted(), st.text(min_size=0, max_size=12)),
       opcode=st.sampled_from(["STACK_GLOBAL", "GLOBAL"]),
       then=st.sampled_from(["none", "call", "newobj", "build"]))
def test_no_crafted_global_reaches_a_callable_outside_the_list(module, name, opcode, then):
    allowed = pickle_plain.allowed_globals()
    if opcode == "GLOBAL":
        if "\n" in module or "\n" in name:
            return
        ref = pickle.GLOBAL + module.encode("utf-8", "surrogatepass") + b"\n" + name.encode("utf-8", "surrogatepass") + b"\n"
    else:
        ref = _stack_global(module, name) if "\ud800" > max(module + name + " ") else None
        if ref is None:
            return
    tail = {"none": b"", "call": pickle.EMPTY_TUPLE + pickle.REDUCE, "newobj": pickle.EMPTY_TUPLE + pickle.NEWOBJ,
            "build": pickle.EMPTY_DICT + pickle.BUILD}[then]
    data = _proto() + ref + tail + pickle.STOP

    reached = []

    class Spy(trust._MetadataUnpickler):
        def find_class(self, m, n):
            obj = super().find_class(m, n)
            reached.append((m, n, obj))
            return obj

    import io
    try:
        Spy(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, TypeError, ValueError, UnicodeDecodeError, EOFError):
        pass
    for m, n, obj in reached:
        assert (m, n) in allowed and "." not in n, (m, n)
        assert obj is pickle_plain.lookup(m, n)
    if (module, name) not in allowed:
        assert reached == []


def test_the_allowlist_is_exact_and_names_no_callable_but_constructors():
    allowed = pickle_plain.allowed_globals()
    assert all("." not in name for _, name in allowed)
    modules = {m for m, _ in allowed}
    assert modules == {"torch", "torch.serialization", "collections", "torch.distributed.checkpoint.metadata",
                       "torch.distributed.checkpoint.planner", FS}
    callables = {(m, n) for m, n in allowed if callable(pickle_plain.lookup(m, n))
                 and not isinstance(pickle_plain.lookup(m, n), (torch.dtype, torch.layout, torch.memory_format))}
    assert callables == {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                         *{(m, n) for m, n in allowed if m.startswith("torch.distributed.checkpoint.")}}


def test_plain_metadata_of_every_kind_round_trips(tmp_path):
    """What torch and megatron write: tensors (fp32, bf16), bytes entries, storage info, plans."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    chunk = ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([8, 4]))
    props = {dt: TensorProperties(dtype=dt) for dt in (torch.float32, torch.bfloat16)}
    meta = Metadata(
        state_dict_metadata={"a": TensorStorageMetadata(props[torch.float32], torch.Size([8, 4]), [chunk]),
                             "b": TensorStorageMetadata(props[torch.bfloat16], torch.Size([8, 4]), [chunk]),
                             "opt/obj": BytesStorageMetadata()},
        storage_data={MetadataIndex("a", torch.Size([0, 0])): _StorageInfo("__0_0.distcp", 0, 128)},
        storage_meta=StorageMeta(checkpoint_id=str(tmp_path), save_id="s", modules=[]), version="1.0.0")
    meta.all_local_plans = [SavePlan([WriteItem(MetadataIndex("a", torch.Size([0, 0])), WriteItemType.SHARD,
                                                tensor_data=TensorWriteData(chunk, props[torch.float32],
                                                                            torch.Size([8, 4])))])]
    for protocol in (2, 4, 5):
        (tmp_path / ".metadata").write_bytes(pickle.dumps(meta, protocol=protocol))
        got = trust.read_dcp_metadata(tmp_path)
        assert got == meta and got.all_local_plans == meta.all_local_plans
    assert trust.tensor_shapes(tmp_path) == {"a": trust.TensorShape((8, 4), torch.float32),
                                             "b": trust.TensorShape((8, 4), torch.bfloat16)}


def test_a_pickle_of_something_else_is_refused(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(UserError, match="holds a dict, not torch.distributed.checkpoint metadata"):
        trust.read_dcp_metadata(tmp_path)


# ----------------------------------------------------------------------------- every command that reads a checkpoint

def _crafted_checkpoint(root: Path, marker: Path) -> Path:
    """`root/step_00000004` with the reported breach in `.metadata` and a matching manifest."""
    from tests.cli.test_cli import REPO

    d = root / "step_00000004"
    d.mkdir(parents=True)
    (d / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1, '
                                     '"common_backend": "torch", "common_backend_version": 1}')
    hf = {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    spec_toml = (REPO / "jobs/quickstart_cpu.toml").read_text()
    torch.save({"step": 4, "extra": {"hf_config": hf, "spec_toml": spec_toml}}, d / "common.pt")
    (d / ".metadata").write_bytes(crafted("stack_global_dotted", marker))
    manifest.write(d, {rel: manifest.file_entry(d / rel) for rel in manifest.listed_files(d)}, step=4, optimizer=False)
    store.write_latest(root, d.name)
    return d


@pytest.mark.parametrize("command", ["merge", "eval", "generate"])
def test_commands_refuse_the_crafted_checkpoint_in_one_line(tmp_path, command):
    from tests.cli.test_eval_generate import mrl, one_error

    marker = tmp_path / "pwned"
    _crafted_checkpoint(tmp_path / "ckpt" / "actor", marker)
    if command == "merge":
        args = ["merge", tmp_path / "ckpt" / "actor", tmp_path / "out"]
    else:
        args = [command, "jobs/quickstart_cpu.toml", f"checkpoint.dir={tmp_path / 'ckpt'}",
                *(["--prompt", "hi"] if command == "generate" else [])]
    r = mrl(*args)
    assert r.returncode == 2 and ".metadata is not plain checkpoint metadata" in one_error(r.stderr), r.stderr
    assert not marker.exists()


def test_training_load_from_refuses_the_crafted_checkpoint(tmp_path):
    """`checkpoint.load_from` (and resume) reach `.metadata` through `mrl.checkpoint.state.load`."""
    from mrl.checkpoint import state

    marker = tmp_path / "pwned"
    d = _crafted_checkpoint(tmp_path / "actor", marker)
    import torch.distributed as dist

    from tests.dist_util import free_port
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(UserError) as e:
            state.load(d, chunks=[torch.nn.Linear(2, 2)], load_rng=False)
    finally:
        dist.destroy_process_group()
    assert "\n" not in str(e.value) and ".metadata is not plain checkpoint metadata" in str(e.value)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_megatron_metadata_still_loads(tmp_path, dtype):
    import subprocess
    import sys

    from tests.cli.test_cli import ENV, REPO
    from tests.dist_util import free_port

    script = Path(__file__).with_name("scripts") / "real_metadata.py"
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), dtype, str(free_port())], cwd=REPO,
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("same"), r.stderr[-3000:]
