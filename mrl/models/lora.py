"""LoRA adapters on megatron's tensor-parallel linears, named by the Hugging Face modules they adapt.

`y = W x + (alpha / r) * B A dropout(x)` for every targeted HF module (`q_proj`, `k_proj`,
`v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`), with `A [r, in]` and `B [out, r]` in
PEFT's convention (A Kaiming-uniform, B zero: a fresh adapter leaves the model unchanged).

Megatron fuses q/k/v into `linear_qkv` and gate/up into `linear_fc1` (column-parallel) and keeps
`linear_proj` (o_proj) and `linear_fc2` (down_proj) row-parallel. The adapters live *beside* the
base weight, as `<linear>.lora.A.<hf_name>` / `<linear>.lora.B.<hf_name>`, and a forward hook adds
their output to the linear's, so every base parameter keeps its name (weight mapping, checkpoints
and the reference model see the plain model). Sharding follows the base weight:

- column-parallel (q/k/v, gate/up): `A` whole on every TP rank, `B` split by output rows exactly as
  the fused weight is (q/k/v rows by query group, gate/up rows by halves). `A x` passes megatron's
  `copy_to_tensor_model_parallel_region` (identity forward, all-reduce backward), so `A` gets the
  full gradient on every TP rank and the input gradient is not counted twice.
- row-parallel (o_proj, down_proj): `A` split by input columns like the weight, `B` whole; the
  partial `A x` is summed over TP (`reduce_from_tensor_model_parallel_region`) before `B`.

So TP=1 and TP=2 compute the same function with the same parameters, and an adapter's state is
TP-sliced in checkpoints like any megatron weight. `apply_lora` freezes every base parameter:
only adapters reach the DDP buffers, the optimizer and (with `adapters_only_checkpoints`) the
checkpoints. `adapters_disabled(chunks)` turns them off: the frozen base is the reference model,
with no second copy of the weights. `merged_weight(param)` is `W + scale * B A` for this rank's
shard: the weight exporter streams merged weights to the rollout engines (see `mrl/weights/`).

Not supported (refused by `lora_problems`): sequence parallelism (the column-parallel input is
sequence-sharded there), and adapters on routed MoE experts.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable, Iterator, Literal, Optional

import torch

from mrl.schema.section import option, section

HF_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
Target = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# megatron linear (suffix of its module name) -> (HF targets it fuses, parallel style)
LINEARS: dict[str, tuple[tuple[str, ...], str]] = {
    "self_attention.linear_qkv": (("q_proj", "k_proj", "v_proj"), "column"),
    "self_attention.linear_proj": (("o_proj",), "row"),
    "mlp.linear_fc1": (("gate_proj", "up_proj"), "column"),
    "mlp.linear_fc2": (("down_proj",), "row"),
}
# HF module path of each target inside a decoder layer
HF_MODULE = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
             "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
             "down_proj": "mlp.down_proj"}


@section
class LoraConfig:
    """Low-rank adapters on the policy's linears; rank 0 trains every weight (full fine-tuning)."""

    rank: int = option(0, ge=0, help="adapter rank r; 0 = no adapters (verl: lora_rank)")
    alpha: float = option(16.0, gt=0, help="scale numerator: updates are scaled by alpha / rank (verl: lora_alpha)")
    dropout: float = option(0.0, ge=0, lt=1, help="dropout on the adapter input (PEFT's lora_dropout)")
    target_modules: tuple[Target, ...] = option(HF_TARGETS, help="Hugging Face module names to adapt "
                                                "(verl: target_modules; the default, all seven, is verl's 'all-linear')")
    adapter_path: Optional[str] = option(None, help="start the adapters from a saved PEFT adapter directory "
                                                    "(adapter_config.json + adapter_model.safetensors; its r, lora_alpha "
                                                    "and target_modules must equal this table's) instead of B = 0 "
                                                    "(verl: lora_adapter_path)")


def lora_problems(cfg: LoraConfig, key: str, *, sequence_parallel: bool = False,
                  num_experts: Optional[int] = None, model_type: Optional[str] = None) -> list[tuple[str, str]]:
    """(dotted key, message) for every LoRA setting the adapters cannot honour."""
    from mrl.models.facts import HYBRID_TYPES

    out = []
    if not cfg.rank:
        return out
    if model_type in HYBRID_TYPES:
        out.append((f"{key}.rank", f"LoRA on {model_type} is not supported yet (its gated q_proj and Gated "
                                   "DeltaNet projections have no adapters); set it to 0"))
    if not cfg.target_modules:
        out.append((f"{key}.target_modules", "is empty; name at least one module (e.g. [\"q_proj\", \"v_proj\"])"))
    if len(set(cfg.target_modules)) != len(cfg.target_modules):
        out.append((f"{key}.target_modules", f"lists a module twice: {list(cfg.target_modules)}"))
    if sequence_parallel:
        out.append(("parallel.sequence_parallel", f"LoRA ({key}.rank {cfg.rank}) does not support sequence "
                                                  "parallelism yet; set it to false"))
    mlp = sorted(set(cfg.target_modules) & {"gate_proj", "up_proj", "down_proj"})
    if num_experts and mlp:
        out.append((f"{key}.target_modules", f"{', '.join(mlp)} on a mixture-of-experts model: adapters on routed "
                                             "experts are not supported; target the attention modules"))
    return out


# ---------------------------------------------------------------------------------------------
# modules

class LoraAdapters(torch.nn.Module):
    """The adapters of one megatron linear: `A[t]`, `B[t]` per targeted HF module `t`.

    `out_rows[t]`: this TP rank's output rows of `t` (column-parallel) or the full output
    (row-parallel); `in_features`: this rank's input width (the full hidden size for
    column-parallel, this rank's slice for row-parallel).
    """

    def __init__(self, targets: tuple[str, ...], style: str, *, in_features: int, in_full: int,
                 out_rows: dict[str, int], rank: int, alpha: float, dropout: float, dtype: torch.dtype,
                 device, tp_rank: int, tp_size: int, seed: int):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.targets, self.style, self.rank = targets, style, rank
        self.scale = alpha / rank
        self.dropout = dropout
        self.active = True
        self.A = torch.nn.ParameterDict()
        self.B = torch.nn.ParameterDict()
        for i, t in enumerate(targets):
            # A: PEFT's init (kaiming_uniform, a=sqrt(5)) drawn whole from a seed, then sliced, so
            # every TP layout starts from the same adapter
            gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
            bound = 1.0 / math.sqrt(in_full)
            a_full = (torch.rand(rank, in_full, generator=gen) * 2 - 1) * bound
            if style == "row":
                a = a_full[:, tp_rank * in_features:(tp_rank + 1) * in_features]
            else:
                a = a_full
            self.A[t] = torch.nn.Parameter(a.to(dtype=dtype, device=device).contiguous())
            self.B[t] = torch.nn.Parameter(torch.zeros(out_rows[t], rank, dtype=dtype, device=device))
            if tp_size > 1:
                sharded, dim = (self.A[t], 1) if style == "row" else (self.B[t], 0)
                set_tensor_model_parallel_attributes(sharded, True, dim, 1)

    def axis_map(self) -> dict[str, int]:
        """Checkpoint sharding of each adapter tensor (the TP-split one only)."""
        return {f"{'A' if self.style == 'row' else 'B'}.{t}": (1 if self.style == "row" else 0) for t in self.targets}


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _qkv_dims(config, tp_size: int) -> tuple[int, int, int]:
    """(query groups on this rank, query heads per group, head dim)."""
    groups = config.num_query_groups or config.num_attention_heads
    return groups // tp_size, config.num_attention_heads // groups, config.kv_channels


def _fused_delta(linear, parts: dict[str, torch.Tensor], lead: tuple[int, ...]) -> torch.Tensor:
    """Lay per-target outputs `parts[t] [..., rows_t]` out as the fused linear's local output
    `[..., out_local]` (zeros for untargeted pieces)."""
    lora: LoraAdapters = linear.lora
    kind = linear.mrl_lora_kind
    ref = next(iter(parts.values()))
    if kind == "self_attention.linear_qkv":
        ng, qpg, hn = _qkv_dims(linear.config, _tp()[1])
        sizes = {"q_proj": qpg * hn, "k_proj": hn, "v_proj": hn}
        pieces = [parts[t].reshape(*lead, ng, sizes[t]) if t in parts else ref.new_zeros(*lead, ng, sizes[t])
                  for t in ("q_proj", "k_proj", "v_proj")]
        return torch.cat(pieces, dim=-1).reshape(*lead, ng * (qpg + 2) * hn)
    if kind == "mlp.linear_fc1":
        half = linear.mrl_lora_rows["gate_proj"]
        pieces = [parts[t] if t in parts else ref.new_zeros(*lead, half) for t in ("gate_proj", "up_proj")]
        return torch.cat(pieces, dim=-1)
    (t,) = lora.targets
    return parts[t]


def _lora_hook(linear, args, output):
    lora: LoraAdapters = linear.lora
    if not lora.active:
        return output
    from megatron.core.tensor_parallel import mappings

    x = args[0]
    out, bias = output
    if lora.dropout and linear.training:
        x = torch.nn.functional.dropout(x, p=lora.dropout, training=True)
    lead = tuple(x.shape[:-1])
    if lora.style == "column":
        a = torch.cat([lora.A[t] for t in lora.targets], dim=0)          # [k*r, in]
        h = mappings.copy_to_tensor_model_parallel_region(x @ a.t())     # full grad of A on every rank
        hs = h.split(lora.rank, dim=-1)
        parts = {t: hs[i] @ lora.B[t].t() for i, t in enumerate(lora.targets)}
        delta = _fused_delta(linear, parts, lead)
    else:
        (t,) = lora.targets
        h = mappings.reduce_from_tensor_model_parallel_region(x @ lora.A[t].t())
        delta = h @ lora.B[t].t()
    return out + lora.scale * delta.to(out.dtype), bias


def _sharded_state_dict(linear, prefix="", sharded_offsets=(), metadata=None):
    """The linear's checkpoint entries with its adapters sharded like their base weight."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    out = type(linear).sharded_state_dict(linear, prefix, sharded_offsets, metadata)
    out = {k: v for k, v in out.items() if not k.startswith(f"{prefix}lora.")}
    lora_state = linear.lora.state_dict(prefix="", keep_vars=True)
    out.update(make_sharded_tensors_for_checkpoint(lora_state, f"{prefix}lora.", linear.lora.axis_map(),
                                                   sharded_offsets, tp_group=getattr(linear, "tp_group", None),
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group")))
    return out


def lora_linears(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, linear) of every megatron linear carrying adapters."""
    for name, module in model.named_modules():
        if hasattr(module, "mrl_lora_kind"):
            yield name, module


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, *, seed: int = 0) -> torch.nn.Module:
    """Attach adapters for `cfg.target_modules` to one GPTModel chunk and freeze its base
    weights (in place; returns `model`). A no-op when `cfg.rank` is 0."""
    if not cfg.rank:
        return model
    from mrl.errors import UserError

    tp_rank, tp_size = _tp()
    wanted = set(cfg.target_modules)
    qkv = sorted(wanted & {"q_proj", "k_proj", "v_proj"})
    if qkv and getattr(getattr(model, "config", None), "multi_latent_attention", False):
        raise UserError(f"LoRA: target_modules {qkv} on multi-latent attention (deepseek_v3): its q/k/v come from "
                        "latent projections (q_a/q_b, kv_a/kv_b) that LoRA does not adapt yet; target o_proj")
    for p in model.parameters():
        p.requires_grad_(False)
    found = 0
    for name, module in list(model.named_modules()):
        kind = next((k for k in LINEARS if name.endswith(k)), None)
        if kind is None or ".experts." in name:
            continue
        fused, style = LINEARS[kind]
        targets = tuple(t for t in fused if t in wanted)
        if not targets:
            continue
        weight = module.weight
        config = module.config
        if kind == "self_attention.linear_qkv":
            ng, qpg, hn = _qkv_dims(config, tp_size)
            rows = {"q_proj": ng * qpg * hn, "k_proj": ng * hn, "v_proj": ng * hn}
        elif kind == "mlp.linear_fc1":
            rows = {"gate_proj": weight.shape[0] // 2, "up_proj": weight.shape[0] // 2}
        else:
            rows = {fused[0]: weight.shape[0]}
        in_local = weight.shape[1]
        in_full = in_local * tp_size if style == "row" else in_local
        layer = _layer_number(name, model)
        module.lora = LoraAdapters(targets, style, in_features=in_local, in_full=in_full, out_rows=rows,
                                   rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout, dtype=weight.dtype,
                                   device=weight.device, tp_rank=tp_rank, tp_size=tp_size,
                                   seed=seed * 7919 + layer * 4 + list(LINEARS).index(kind))
        module.mrl_lora_kind = kind
        module.mrl_lora_rows = rows
        module.register_forward_hook(_lora_hook)
        module.sharded_state_dict = _bind(_sharded_state_dict, module)
        weight.mrl_merged = _bind(merged_weight_of, module)
        found += 1
    if not found and _has_decoder_layers(model):
        raise UserError(f"LoRA: no linear of this model matches target_modules {list(cfg.target_modules)}")
    return model


def _bind(fn, module):
    import functools

    return functools.partial(fn, module)


def _has_decoder_layers(model) -> bool:
    decoder = getattr(model, "decoder", None)
    return decoder is not None and len(getattr(decoder, "layers", [])) > 0


def _layer_number(name: str, model) -> int:
    """The global (0-based) decoder layer a module belongs to."""
    parts = name.split(".")
    if "layers" in parts:
        local = int(parts[parts.index("layers") + 1])
        return model.decoder.layers[local].layer_number - 1
    return 0


def merged_weight_of(linear) -> torch.Tensor:
    """This rank's shard of `W + scale * B A` (fused layout, weight dtype); no communication."""
    lora: LoraAdapters = linear.lora
    w = linear.weight.detach()
    with torch.no_grad():
        parts = {t: (lora.B[t].float() @ lora.A[t].float()) for t in lora.targets}   # [rows_t, in_local]
        if lora.style == "column":
            # lay [rows, in] out along the output dim: treat `in` as a trailing feature
            swapped = {t: p.t() for t, p in parts.items()}                       # [in, rows_t]
            delta = _fused_delta(linear, swapped, (w.shape[1],)).t()             # [out_local, in]
        else:
            delta = parts[lora.targets[0]]
        return (w.float() + lora.scale * delta).to(w.dtype)


def merged_weight(param: torch.nn.Parameter) -> torch.Tensor:
    """A parameter's value as exported: merged with its adapters when it carries some."""
    fn = getattr(param, "mrl_merged", None)
    return fn() if fn is not None else param.detach()


def has_lora(chunks: Iterable[torch.nn.Module]) -> bool:
    from mrl.weights.layout import unwrap

    return any(True for c in chunks for _ in lora_linears(unwrap(c)))


@contextlib.contextmanager
def adapters_disabled(chunks: Iterable[torch.nn.Module]):
    """The base model: every adapter off inside the block (the reference model of a LoRA actor)."""
    from mrl.weights.layout import unwrap

    adapters = [m.lora for c in chunks for _, m in lora_linears(unwrap(c))]
    before = [a.active for a in adapters]
    for a in adapters:
        a.active = False
    try:
        yield
    finally:
        for a, b in zip(adapters, before):
            a.active = b


def adapters_only_checkpoints(model: torch.nn.Module) -> torch.nn.Module:
    """Make `model`'s checkpoints hold its adapters only: its `sharded_state_dict` keeps the adapter
    entries and `load_state_dict` reports only missing adapters (the frozen base comes from
    `model.path`, which the checkpoint records). In place; returns `model`."""
    from mrl.weights.tables import is_adapter_name   # the adapters' parameter names, with their table

    full_sd = model.sharded_state_dict
    full_load = model.load_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        return {k: v for k, v in full_sd(prefix, sharded_offsets, metadata).items() if is_adapter_name(k)}

    def load_state_dict(state_dict, strict=True, assign=False):
        result = full_load(state_dict, strict=False, assign=assign)
        missing = [k for k in result.missing_keys if is_adapter_name(k)]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"LoRA checkpoint: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}")
        return torch.nn.modules.module._IncompatibleKeys(missing, result.unexpected_keys)

    model.sharded_state_dict = sharded_state_dict
    model.load_state_dict = load_state_dict
    model.mrl_adapters_only = True
    return model


def trainable_parameters(chunks: Iterable[torch.nn.Module]) -> int:
    from mrl.weights.layout import unwrap

    return sum(p.numel() for c in chunks for p in unwrap(c).parameters() if p.requires_grad)
