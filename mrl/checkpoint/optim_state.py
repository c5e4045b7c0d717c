"""The optimizer's state in mrl's own per-rank format: each rank writes what it holds, as it is.

Why: megatron's reshardable distributed-optimizer format ('fully_reshardable') gathers every
parameter's state into freshly zeroed buffers on one rank before writing, and writes fp32
master weights that, for an fp32 model, are the model's own weights (half the save's time went
there on a 135M model). Here every rank writes its own flat shard of the optimizer's state, with
no gather and no copy, and records for each piece which model tensor and which part of it it is:

    optim/rank_00003.bin    the raw bytes of rank 3's pieces, one after another
    optim/rank_00003.json   {"format": "mrl-optim-1", "pieces": [{"state": "exp_avg",
                             "key": "decoder.layers.mlp.linear_fc1.weight", "global_shape": [...],
                             "offset": [...], "shape": [...], "range": [a, b], "dtype": "float32",
                             "at": byte offset in the .bin, "scalars": {"step": 3.0}}, ...]}

A piece is the flat elements [a, b) of one box of a model tensor in megatron's model space: the
key, global shape and offset of a `ShardedTensor` of the model's `sharded_state_dict` (so TP/PP
sharding, SwiGLU's split fc1 and tied embeddings mean here what they mean for the weights), the
box's shape, and the range of the box's flattened elements the rank's optimizer holds (its
distributed-optimizer shard; the whole box for megatron's plain optimizers). States: the Adam
moments (any per-element optimizer state), and `param`, the fp32 master weights, only where they
are not the model's own storage (a bf16 model): an fp32 model's master weights *are* its weights,
written once, with the model. A tensor replicated over TP or PP (a layer norm, the last stage's
copy of a tied embedding) is written by its main replica only.

Loading at any TP/PP/DP layout asks, for each state element this rank's optimizer holds, which
saved pieces cover it: a piece of the same box is a 1-D range intersection read straight into the
optimizer's tensor (the same layout, or another DP size); another box (another TP size) is
intersected in global coordinates, a slab at a time. One saved piece at a time is read (seek +
readinto), never a full copy of the model's state. Every element must be covered exactly once
(a tensor that may change shape between layouts, megatron's padded vocabulary, may be partly
uncovered: those elements start at zero). The files are raw bytes and JSON: nothing is unpickled,
and every number of an index is checked (dtype, shapes, ranges inside the box, bytes inside the
file) before it is used; the manifest has already checked every file's bytes.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from mrl.errors import UserError
from mrl.optim.step import inner_optimizers

__all__ = ["FORMAT", "DIR", "Unsupported", "plan", "write", "present", "load", "saved_states"]

FORMAT = "mrl-optim-1"
DIR = "optim"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES = {v: k for k, v in _DTYPES.items()}
_SLAB = 1 << 22          # elements per slab when boxes differ (resharding at load)


class Unsupported(Exception):
    """An optimizer (or model) this format cannot describe; the caller uses megatron's format."""


@dataclass
class _Entry:
    """One model parameter's optimizer state on this rank: the flat range [start, end) of the
    local parameter it covers, its master weights (flat) and its per-element/scalar states."""
    param: torch.Tensor
    start: int
    end: int
    main: torch.Tensor
    state: dict
    dp_sharded: bool     # a distributed-optimizer shard (DP ranks hold different ranges)

    def own_storage(self) -> bool:
        """Whether the master weights are the model parameter's own bytes (an fp32 model)."""
        return (self.main.dtype == self.param.dtype
                and self.main.untyped_storage().data_ptr() == self.param.untyped_storage().data_ptr())

    def tensors(self) -> dict:
        n = self.end - self.start
        return {k: v.detach().view(-1) for k, v in self.state.items() if torch.is_tensor(v) and v.dim() > 0
                and v.numel() == n}

    def scalars(self) -> dict:
        return {k: float(v) for k, v in self.state.items()
                if (torch.is_tensor(v) and v.dim() == 0) or isinstance(v, (int, float))}


def _entries(optimizer) -> list[_Entry]:
    """This rank's optimizer state, parameter by parameter (megatron's distributed optimizer, its
    fp32 optimizer and its float16 optimizer, alone or chained); `Unsupported` otherwise."""
    out = []
    for opt in inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        kind = type(opt).__name__
        config = getattr(opt, "config", None)
        if inner is None or getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
            raise Unsupported(f"{kind} holds its state outside torch's optimizer")
        if kind == "DistributedOptimizer":
            for gbuf_range_maps in opt.gbuf_ranges:
                for per_dtype in gbuf_range_maps.values():
                    for gbuf_range_map in per_dtype:
                        for model_param, ranges in gbuf_range_map["param_map"].items():
                            r = ranges["param"]
                            group, order = opt.model_param_group_index_map[model_param]
                            main = inner.param_groups[group]["params"][order]
                            out.append(_Entry(model_param, r.start, r.end, main, inner.state[main], True))
        elif kind == "FP32Optimizer":
            for g in inner.param_groups:
                out += [_Entry(p, 0, p.numel(), p, inner.state[p], False) for p in g["params"]]
        elif kind == "Float16OptimizerWithFloat16Params":
            for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                out += [_Entry(p, 0, p.numel(), m, inner.state[m], False) for p, m in zip(model_group, main_group)]
            for g in opt.fp32_from_fp32_groups:
                out += [_Entry(p, 0, p.numel(), p, inner.state[p], False) for p in g]
        else:
            raise Unsupported(f"{kind} is not one of megatron's distributed, fp32 or float16 optimizers")
    for e in out:
        if not e.main.is_contiguous() or any(not t.is_contiguous() for t in e.tensors().values()):
            raise Unsupported("an optimizer state tensor is not contiguous")
    return out


@dataclass(frozen=True)
class _Box:
    """A box of a model tensor in model space (megatron's `ShardedTensor`), and where its first
    element lies in the local parameter's flat storage."""
    key: str
    global_shape: tuple
    offset: tuple
    shape: tuple
    p0: int
    main_replica: bool       # over TP and PP (a distributed-optimizer shard is not a DP replica)
    fully_main: bool         # over TP, PP and DP
    may_differ: bool         # megatron's allow_shape_mismatch (the padded vocabulary)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _main(replica_id, dims=None) -> bool:
    ids = tuple(replica_id) if isinstance(replica_id, (tuple, list)) else (replica_id,)
    return all(r == 0 for r in (ids[:dims] if dims is not None and len(ids) == 3 else ids))


def _boxes(chunks) -> dict[int, list[_Box]]:
    """id(model parameter) -> the boxes of the model's `sharded_state_dict` that hold it (a SwiGLU
    fc1 weight is two), each a contiguous part of the parameter."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out: dict[int, list[_Box]] = {}
    for c in chunks:
        for v in nested_values(getattr(c, "module", c).sharded_state_dict()):
            if isinstance(v, ShardedTensorFactory):
                made = [t for t in nested_values(v.build()) if isinstance(t, ShardedTensor)]
            elif isinstance(v, ShardedTensor):
                made = [v]
            else:
                continue
            param = v.data
            if param is None or id(param) in out:
                continue   # the same parameter under a second name (a tied weight): its first name holds it
            boxes = []
            for t in made:
                d = t.data
                if (t.flattened_range is not None or d is None or not d.is_contiguous()
                        or d.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()):
                    raise Unsupported(f"{t.key} is not a contiguous part of its parameter")
                boxes.append(_Box(t.key, tuple(t.global_shape), tuple(t.global_offset),
                                  (1,) * t.prepend_axis_num + tuple(t.local_shape),
                                  (d.data_ptr() - param.data_ptr()) // param.element_size(),
                                  _main(t.replica_id, 2), _main(t.replica_id), bool(t.allow_shape_mismatch)))
            if sum(b.numel for b in boxes) != param.numel():
                raise Unsupported(f"{v.key} does not cover its parameter")
            out[id(param)] = boxes
    return out


def _overlaps(e: _Entry, boxes: list[_Box]):
    """(box, [a, b) within the box, [a, b) within the entry's flat tensors) for each box part of
    the entry's range."""
    for b in boxes:
        lo, hi = max(e.start, b.p0), min(e.end, b.p0 + b.numel)
        if lo < hi:
            yield b, (lo - b.p0, hi - b.p0), (lo - e.start, hi - e.start)


def plan(chunks, optimizer) -> list[tuple[dict, torch.Tensor]]:
    """What this rank writes: (index entry, flat tensor) pairs, in file order. Raises
    `Unsupported` (before anything is written) for an optimizer or model this format cannot hold."""
    boxes = _boxes(chunks)
    out, at = [], 0
    for e in _entries(optimizer):
        if id(e.param) not in boxes:
            raise Unsupported("an optimized parameter is not in the model's sharded state dict")
        tensors = e.tensors()
        if not e.own_storage():
            tensors["param"] = e.main.detach().view(-1)
        scalars = e.scalars()
        for box, (a, b), (s, t) in _overlaps(e, boxes[id(e.param)]):
            if not (box.main_replica if e.dp_sharded else box.fully_main):
                continue
            for name, ten in sorted(tensors.items()):
                if ten.dtype not in _NAMES:
                    raise Unsupported(f"optimizer state {name} is {ten.dtype}")
                entry = {"state": name, "key": box.key, "global_shape": list(box.global_shape),
                         "offset": list(box.offset), "shape": list(box.shape), "range": [a, b],
                         "dtype": _NAMES[ten.dtype], "at": at, "scalars": scalars}
                out.append((entry, ten[s:t]))
                at += (t - s) * ten.element_size()
    return out


def _name(rank: int) -> str:
    return f"rank_{rank:05d}"


def write(directory: Path, pieces: list[tuple[dict, torch.Tensor]], rank: int) -> None:
    """Write this rank's pieces (`plan`) under `directory/optim`, raw bytes then the index, each
    fsynced. The tensors are written from their own memory (no copy)."""
    d = Path(directory) / DIR
    d.mkdir(exist_ok=True)
    with open(d / f"{_name(rank)}.bin", "wb") as f:
        for _, ten in pieces:
            if ten.numel():
                f.write(ten.view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    with open(d / f"{_name(rank)}.json", "w") as f:
        json.dump({"format": FORMAT, "pieces": [entry for entry, _ in pieces]}, f)
        f.flush()
        os.fsync(f.fileno())


def present(ckpt: Path) -> bool:
    """Whether the checkpoint `ckpt` holds its optimizer state in this format."""
    return (Path(ckpt) / DIR).is_dir()


@dataclass(frozen=True)
class _Piece:
    file: Path
    at: int
    dtype: torch.dtype
    offset: tuple
    shape: tuple
    a: int
    b: int
    scalars: dict


def _ints(v, n: Optional[int] = None) -> bool:
    return (isinstance(v, list) and (n is None or len(v) == n)
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v))


def _checked(raw, binary: Path, size: int, where: str) -> tuple[str, str, _Piece]:
    """One index entry as a `_Piece`, every number checked; `UserError` naming the file otherwise."""
    ok = isinstance(raw, dict) and isinstance(raw.get("state"), str) and isinstance(raw.get("key"), str)
    ok = ok and raw.get("dtype") in _DTYPES and _ints(raw.get("global_shape")) and _ints(raw.get("range"), 2)
    n = len(raw["global_shape"]) if ok else 0
    ok = ok and _ints(raw.get("offset"), n) and _ints(raw.get("shape"), n) and isinstance(raw.get("at"), int)
    ok = ok and isinstance(raw.get("scalars"), dict) and all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in raw["scalars"].items())
    if ok:
        a, b = raw["range"]
        dtype = _DTYPES[raw["dtype"]]
        numel = math.prod(raw["shape"])
        nbytes = (b - a) * (torch.finfo(dtype).bits // 8)
        inside = all(o + s <= g for o, s, g in zip(raw["offset"], raw["shape"], raw["global_shape"]))
        ok = inside and a <= b <= numel and raw["at"] >= 0 and raw["at"] + nbytes <= size
    if not ok:
        raise UserError(f"{where} is not an mrl optimizer index (a piece's dtype, shape, range or bytes are out of "
                        "bounds); nothing was loaded from it")
    return raw["state"], raw["key"], _Piece(binary, raw["at"], dtype, tuple(raw["offset"]), tuple(raw["shape"]),
                                            a, b, {k: float(v) for k, v in raw["scalars"].items()})


def _index(ckpt: Path) -> dict[tuple[str, str], list[_Piece]]:
    """(state, key) -> the saved pieces, from every rank's index of `ckpt`."""
    out: dict[tuple[str, str], list[_Piece]] = {}
    for idx in sorted((Path(ckpt) / DIR).glob("rank_*.json")):
        where = f"checkpoint {ckpt}: {DIR}/{idx.name}"
        binary = idx.with_suffix(".bin")
        if not binary.is_file():
            raise UserError(f"{where}: its data file {binary.name} is missing")
        try:
            body = json.loads(idx.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{where} is not valid JSON ({e})") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(body.get("pieces"), list):
            raise UserError(f"{where} is not an mrl optimizer index (format {FORMAT})")
        size = binary.stat().st_size
        for raw in body["pieces"]:
            state, key, piece = _checked(raw, binary, size, where)
            out.setdefault((state, key), []).append(piece)
    return out


def saved_states(ckpt: Path) -> set[str]:
    """The optimizer states (`exp_avg`, `param`, ...) the checkpoint `ckpt` holds."""
    return {state for state, _ in _index(ckpt)}


class _Reader:
    """Reads elements of saved pieces (seek + readinto), keeping each data file open once."""

    def __init__(self):
        self.files = {}

    def into(self, piece: _Piece, lo: int, hi: int, dst: torch.Tensor) -> None:
        """Saved elements [lo, hi) of `piece` (relative to its range) into `dst` (hi - lo elements)."""
        direct = dst.dtype == piece.dtype and dst.is_contiguous()
        buf = dst.detach() if direct else torch.empty(hi - lo, dtype=piece.dtype)
        if not buf.numel():
            return
        f = self.files.get(piece.file) or self.files.setdefault(piece.file, open(piece.file, "rb"))
        f.seek(piece.at + lo * buf.element_size())
        view = buf.view(torch.uint8).numpy().data
        if f.readinto(view) != len(view):
            raise UserError(f"checkpoint: {piece.file} ends before its index says")
        if not direct:
            with torch.no_grad():
                dst.copy_(buf)

    def read(self, piece: _Piece) -> torch.Tensor:
        out = torch.empty(piece.b - piece.a, dtype=piece.dtype)
        self.into(piece, 0, piece.b - piece.a, out)
        return out

    def close(self):
        for f in self.files.values():
            f.close()


def _strides(shape: tuple) -> list[int]:
    out, s = [], 1
    for n in reversed(shape):
        out.append(s)
        s *= n
    return out[::-1]


def _flat(lo: list[int], hi: list[int], origin: tuple, shape: tuple) -> torch.Tensor:
    """Flat indices, in the box (`origin`, `shape`), of the global box [lo, hi) (row-major)."""
    idx = torch.zeros((), dtype=torch.int64)
    nd = len(lo)
    for d, (l, h, o, s) in enumerate(zip(lo, hi, origin, _strides(shape))):
        view = [1] * nd
        view[d] = h - l
        idx = idx + ((torch.arange(l, h, dtype=torch.int64) - o) * s).view(view)
    return idx.reshape(-1)


def _fill_reshard(dst: torch.Tensor, a: int, b: int, box: _Box, piece: _Piece, reader: _Reader) -> int:
    """Elements [a, b) of `box` that the saved `piece` (another box of the same tensor) holds, into
    `dst`; returns how many. The intersection is walked in slabs along its first axis."""
    lo = [max(x, y) for x, y in zip(box.offset, piece.offset)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(box.offset, box.shape, piece.offset, piece.shape)]
    if any(l >= h for l, h in zip(lo, hi)):
        return 0
    src = reader.read(piece)
    rows = max(1, _SLAB // max(1, math.prod(h - l for l, h in zip(lo[1:], hi[1:]))))
    count = 0
    for r in range(lo[0], hi[0], rows):
        slab_lo, slab_hi = [r, *lo[1:]], [min(r + rows, hi[0]), *hi[1:]]
        mine = _flat(slab_lo, slab_hi, box.offset, box.shape)
        theirs = _flat(slab_lo, slab_hi, piece.offset, piece.shape)
        keep = (mine >= a) & (mine < b) & (theirs >= piece.a) & (theirs < piece.b)
        if keep.any():
            with torch.no_grad():
                dst[mine[keep] - a] = src[theirs[keep] - piece.a].to(dst.dtype)
            count += int(keep.sum())
    return count


def _fill(dst: torch.Tensor, a: int, b: int, box: _Box, pieces: list[_Piece], reader: _Reader, what: str) -> dict:
    """Elements [a, b) of `box` from the saved `pieces` of its tensor into `dst`; returns the
    scalars (`step`) of a piece used. Every element must be covered exactly once."""
    count, scalars = 0, None
    if box.may_differ:
        with torch.no_grad():
            dst.zero_()
    for p in pieces:
        if p.offset == box.offset and p.shape == box.shape:
            lo, hi = max(a, p.a), min(b, p.b)
            if lo < hi:
                reader.into(p, lo - p.a, hi - p.a, dst[lo - a:hi - a])
                n = hi - lo
            else:
                n = 0
        else:
            n = _fill_reshard(dst, a, b, box, p, reader)
        if n:
            count += n
            scalars = scalars if scalars is not None else p.scalars
    if count > b - a or (count < b - a and not box.may_differ):
        how = "more than once" if count > b - a else f"only {count} of {b - a} elements"
        raise UserError(f"checkpoint: the optimizer state {what} of this layout is covered {how} by the saved "
                        "pieces (a damaged or foreign optimizer index)")
    return scalars or {}


def load(ckpt: Path, chunks, optimizer) -> None:
    """Fill `optimizer`'s state (its Adam moments, master weights and steps) from the checkpoint
    `ckpt`, at this rank's layout, after the model's weights were loaded into `chunks`. Master
    weights not in the checkpoint (an fp32 save loaded into a bf16 model) come from the loaded
    weights. An optimizer or model this format cannot describe is a `UserError`."""
    index = _index(ckpt)
    try:
        boxes = _boxes(chunks)
        entries = _entries(optimizer)
    except Unsupported as e:
        raise UserError(f"checkpoint {ckpt}: its optimizer state is in mrl's per-rank format, which this "
                        f"optimizer cannot take ({e})") from None
    reader = _Reader()
    try:
        for e in entries:
            if id(e.param) not in boxes:
                raise UserError(f"checkpoint {ckpt}: an optimized parameter of shape {tuple(e.param.shape)} is not "
                                "in the model's sharded state dict; its optimizer state cannot be found")
            targets = e.tensors()
            separate = not e.own_storage()
            main = e.main.detach().view(-1)
            if separate and not any(("param", b.key) in index for b in boxes[id(e.param)]):
                with torch.no_grad():
                    main.copy_(e.param.detach().view(-1)[e.start:e.end])
            scalars = {}
            for box, (a, b), (s, t) in _overlaps(e, boxes[id(e.param)]):
                want = dict(targets)
                if ("param", box.key) in index:
                    want["param"] = main      # the saved master weights (an fp32 model's are its weights)
                for name, dst in want.items():
                    pieces = index.get((name, box.key))
                    if not pieces:
                        raise UserError(f"checkpoint {ckpt} holds no optimizer state {name!r} of {box.key} "
                                        "(saved by another optimizer?)")
                    scalars = _fill(dst[s:t], a, b, box, pieces, reader, f"{name!r} of {box.key}") or scalars
            for k, v in e.state.items():
                if k in scalars and torch.is_tensor(v) and v.dim() == 0:
                    v.fill_(scalars[k])
                elif k in scalars and isinstance(v, (int, float)):
                    e.state[k] = type(v)(scalars[k])
    finally:
        reader.close()
