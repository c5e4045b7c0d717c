"""The opcode table and the exact allowlist of `mrl.checkpoint.trust`'s `.metadata` unpickler.

A pickle is a program: its opcodes push values, look up globals (`GLOBAL`, `STACK_GLOBAL`),
call them (`REDUCE`, `NEWOBJ`, `INST`, `OBJ`, `NEWOBJ_EX`) and set state on what they return
(`BUILD`, which calls `__setstate__` or `setattr`). A module-prefix check on globals is not
enough: `find_class` resolves dotted names, so `("torch.distributed.checkpoint.filesystem",
"pickle.loads")` reaches `pickle.loads`. Here every step is checked against what torch_dist
metadata (torch's `Metadata` of `TensorStorageMetadata`/`BytesStorageMetadata`, megatron's
`SavePlan`s in `planner_data`, `_StorageInfo`s in `storage_data`) actually holds:

- `lookup(module, name)`: an exact (module, name) table built here from imports this module
  makes itself; a name is never split on dots and nothing is imported because a pickle names it.
- `REDUCE`: only `torch.Size(tuple of ints)`, `_get_layout(str)`, an enum of the metadata
  (`WriteItemType(value)`, ...) and `OrderedDict()` with plain arguments.
- `NEWOBJ`: `object.__new__` of a metadata dataclass, with no arguments.
- `BUILD`: only on an instance of a metadata dataclass (never a class, an enum or a dtype), with a
  dict of that dataclass's own field names (and megatron's `Metadata.all_local_plans`) (`TensorProperties`: its 5-tuple, through its own
  `__setstate__`, after checking each member's type).
- `APPEND(S)`/`SETITEM(S)`/`ADDITEMS`: only on a list, a dict/`OrderedDict`, a set.
- every other opcode that could call or import something (`INST`, `OBJ`, `NEWOBJ_EX`, `EXT1/2/4`,
  `PERSID`, `BINPERSID`, out-of-band buffers) is not in the table: refused by name.

Data opcodes (numbers, strings, bytes, tuples, lists, dicts, sets, the memo) are Python's own.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import pickle
from typing import Any

__all__ = ["DISPATCH", "lookup", "metadata_class", "allowed_globals"]

# opcodes that only push or rearrange plain data (Python's own implementations)
_DATA_OPS = ("PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE",
             "GET", "BINGET", "LONG_BINGET", "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2",
             "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE",
             "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
             "BYTEARRAY8", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "LIST", "EMPTY_DICT",
             "DICT", "EMPTY_SET", "FROZENSET", "GLOBAL", "STACK_GLOBAL")
_PLAIN_SCALARS = (int, float, bool, str, bytes, type(None))
# attributes set on a dataclass beyond its fields: megatron's saver records every rank's plan on the
# global `Metadata` (`all_local_plans`, read back to reuse a cached global plan)
_EXTRA_FIELDS = {"Metadata": {"all_local_plans"}}


@functools.lru_cache(maxsize=1)
def _tables() -> tuple[dict, frozenset, dict]:
    """(globals by (module, name), the dataclasses NEWOBJ/BUILD may touch, REDUCE's callables ->
    their argument check), built once from this module's own imports."""
    import torch
    import torch.serialization
    from torch.distributed.checkpoint import filesystem, metadata, planner

    dataclass_types = (metadata.Metadata, metadata.MetadataIndex, metadata.ChunkStorageMetadata,
                       metadata.TensorProperties, metadata.TensorStorageMetadata, metadata.BytesStorageMetadata,
                       metadata.StorageMeta, planner.SavePlan, planner.WriteItem, planner.TensorWriteData,
                       planner.BytesIOWriteData, filesystem._StorageInfo)
    enums = (metadata._MEM_FORMAT_ENCODING, planner.WriteItemType, planner.LoadItemType)
    table: dict[tuple[str, str], Any] = {(c.__module__, c.__qualname__): c for c in (*dataclass_types, *enums)}
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) and name.isidentifier():
            table[("torch", name)] = value
    table[("torch", "Size")] = torch.Size
    table[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    table[("collections", "OrderedDict")] = collections.OrderedDict

    def ints(args) -> bool:
        return len(args) == 1 and isinstance(args[0], (tuple, list)) and all(type(n) is int for n in args[0])

    def one_str(args) -> bool:
        return len(args) == 1 and type(args[0]) is str

    calls: dict[Any, Any] = {torch.Size: lambda a: a == () or ints(a),
                             torch.serialization._get_layout: one_str,
                             collections.OrderedDict: lambda a: a == () or (len(a) == 1 and _plain_pairs(a[0]))}
    for e in enums:
        calls[e] = lambda a: len(a) == 1 and type(a[0]) in (int, str)
    return table, frozenset(dataclass_types), calls


def _plain_pairs(items) -> bool:
    return isinstance(items, list) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, _PLAIN_SCALARS) for v in p) for p in items)


def allowed_globals() -> frozenset[tuple[str, str]]:
    """Every (module, name) a `.metadata` may name."""
    return frozenset(_tables()[0])


def metadata_class() -> type:
    from torch.distributed.checkpoint.metadata import Metadata

    return Metadata


def lookup(module: str, name: str):
    """The object of an allowed global; `UnpicklingError` naming it otherwise."""
    if type(module) is not str or type(name) is not str:
        raise pickle.UnpicklingError("refers to a global whose name is not a string")
    found = _tables()[0].get((module, name))
    if found is None:
        raise pickle.UnpicklingError(f"refers to {module[:80]}.{name[:80]}, not a checkpoint-metadata type")
    return found


def _refuse(what: str):
    raise pickle.UnpicklingError(what)


def _reduce(self) -> None:
    args = self.stack.pop()
    func = self.stack[-1]
    calls = _tables()[2]
    try:
        check = calls.get(func)
    except TypeError:   # an unhashable object on the stack is no callable of ours
        check = None
    if check is None or not isinstance(args, tuple) or not check(args):
        _refuse(f"calls {_named(func)} with {_named(args)} arguments, not a checkpoint-metadata constructor")
    self.stack[-1] = func(*args)


def _newobj(self) -> None:
    args = self.stack.pop()
    cls = self.stack.pop()
    if not (isinstance(cls, type) and cls in _tables()[1]) or args != ():
        _refuse(f"creates a {_named(cls)}, not a checkpoint-metadata dataclass")
    self.append(object.__new__(cls))


def _tensor_properties_state(state) -> bool:
    import torch
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    return (type(state) is tuple and len(state) == 5 and isinstance(state[0], torch.dtype)
            and isinstance(state[1], torch.layout) and type(state[2]) is bool
            and isinstance(state[3], _MEM_FORMAT_ENCODING) and type(state[4]) is bool)


def _build(self) -> None:
    from torch.distributed.checkpoint.metadata import TensorProperties

    state = self.stack.pop()
    inst = self.stack[-1]
    cls = type(inst)
    if cls not in _tables()[1]:
        _refuse(f"sets the state of a {_named(inst)}, not of a checkpoint-metadata object")
    if cls is TensorProperties:
        if not _tensor_properties_state(state):
            _refuse("sets a TensorProperties state that is not (dtype, layout, bool, memory format, bool)")
        inst.__setstate__(state)
        return
    fields = {f.name for f in dataclasses.fields(cls)} | _EXTRA_FIELDS.get(cls.__qualname__, set())
    if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
        _refuse(f"sets fields of {cls.__name__} it does not have ({_named(state)} state)")
    inst.__dict__.update(state)


def _append(self) -> None:
    value = self.stack.pop()
    target = self.stack[-1]
    if type(target) is not list:
        _refuse(f"appends to a {_named(target)}")
    target.append(value)


def _appends(self) -> None:
    items = self.pop_mark()
    target = self.stack[-1]
    if type(target) is not list:
        _refuse(f"appends to a {_named(target)}")
    target.extend(items)


def _setitems_into(target, items: list) -> None:
    if type(target) not in (dict, collections.OrderedDict):
        _refuse(f"sets items of a {_named(target)}")
    for i in range(0, len(items) - 1, 2):
        target[items[i]] = items[i + 1]


def _setitem(self) -> None:
    value = self.stack.pop()
    key = self.stack.pop()
    _setitems_into(self.stack[-1], [key, value])


def _setitems(self) -> None:
    items = self.pop_mark()
    if len(items) % 2:
        _refuse("SETITEMS with an odd number of items")
    _setitems_into(self.stack[-1], items)


def _additems(self) -> None:
    items = self.pop_mark()
    target = self.stack[-1]
    if type(target) is not set:
        _refuse(f"adds items to a {_named(target)}")
    target.update(items)


def _named(obj) -> str:
    if isinstance(obj, type):
        return f"class {obj.__module__}.{obj.__qualname__}"[:120]
    return type(obj).__name__[:80]


def _table() -> dict:
    base = pickle._Unpickler.dispatch
    table = {getattr(pickle, op)[0]: base[getattr(pickle, op)[0]] for op in _DATA_OPS}
    for op, fn in (("REDUCE", _reduce), ("NEWOBJ", _newobj), ("BUILD", _build), ("APPEND", _append),
                   ("APPENDS", _appends), ("SETITEM", _setitem), ("SETITEMS", _setitems), ("ADDITEMS", _additems)):
        table[getattr(pickle, op)[0]] = fn
    return _Table(table)


class _Table(dict):
    """The dispatch table; an opcode not in it is refused by name (a KeyError would not say which)."""

    def __missing__(self, code: int):
        names = {getattr(pickle, n)[0]: n for n in dir(pickle) if n.isupper() and isinstance(getattr(pickle, n), bytes)
                 and len(getattr(pickle, n)) == 1}
        name = names.get(code, f"0x{code:02x}")

        def refuse(self):
            _refuse(f"uses the opcode {name}, which checkpoint metadata never needs")
        return refuse


DISPATCH = _table()
