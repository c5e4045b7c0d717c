"""`mrl plan JOB`: what one weight sync costs, from the model's config alone (no weights loaded).

The tensors are those the exporter streams (`mrl.weights.hf_export`), listed from the Hugging
Face config of `model.path` (a builtin preset, a local or cached `config.json`, or mrl's table of
known Hub models, `mrl.models.facts.KNOWN_MODELS`) in checkpoint order, and packed into buckets
of `rollout.weight_sync.bucket_mb` exactly as `hf_buckets` packs them.

Each tensor crosses, on the trainer, the gathers the exporter runs: a tensor-parallel all-gather
(sharded tensors: attention and MLP projections, embedding and head), the expert-tensor gather and
the expert-parallel broadcast (expert weights), and the pipeline broadcast (every tensor, from its
stage). Separate rollout ranks then receive the bucket over the trainer/rollout bridge (a broadcast
from trainer rank 0). Colocated engines receive full tensors in the trainer's memory and shard
them themselves (vLLM engine groups of `rollout.tensor_parallel` ranks): no further link.

A group whose ranks share a node runs at the NVLink bandwidth, one spanning nodes at the
InfiniBand bandwidth; delta sync's comparison against the host copy moves every exported byte
over PCIe once. An all-gather of B bytes over n ranks moves B (n-1)/n into each rank; a broadcast
moves B. The estimate is link time only (no latency, no engine load time): a lower bound to
compare layouts and modes with, not a promise.

Expected delta: each tensor goes as sparse (int32 index + value per changed element) or whole,
whichever is smaller, at a stated fraction of changed elements (verl reports 1-3% per step on
dense models in bf16). Only what crosses the bridge (separate placement) or the engine load
shrinks: the trainer's gathers still move full tensors, since the exported bytes are compared.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
INDEX_BYTES = 4   # int32 element indices of a sparse delta


@dataclass(frozen=True)
class Links:
    """Link bandwidths in GB/s (1e9 bytes per second)."""

    nvlink_gbps: float = 450.0      # H100 NVLink 4, per direction
    ib_gbps: float = 50.0           # one NDR 400 Gb/s NIC per GPU
    pcie_gbps: float = 64.0         # PCIe Gen5 x16, per direction


@dataclass(frozen=True)
class HFTensor:
    """One exported tensor: its HF name, shape, and how it is split on the trainer."""

    name: str
    shape: tuple[int, ...]
    tp_sharded: bool = False
    expert: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def hf_tensors(cfg: dict[str, Any]) -> list[HFTensor]:
    """The tensors a checkpoint of a supported architecture holds (llama, qwen2/3, the Qwen MoEs,
    DeepSeek-V3 / Kimi-K2 with multi-latent attention, GLM-4.5, gpt-oss, Gemma 3's text model; an aliased model type as its
    architecture), in checkpoint order. Experts by Qwen / DeepSeek names (Mixtral's sizes are the
    same)."""
    from mrl.models.facts import HYBRID_TYPES, canonical_config, layer_kinds
    from mrl.models.vlm import flatten, is_vlm

    cfg = canonical_config(flatten(cfg) if is_vlm(cfg) else cfg)
    h = cfg["hidden_size"]
    inter = cfg.get("intermediate_size")
    vocab = cfg["vocab_size"]
    model_type = cfg.get("model_type", "llama")
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    moe_inter = cfg.get("moe_intermediate_size") or inter
    sigmoid_moe = model_type in ("deepseek_v3", "glm4_moe")   # DeepSeek's router, shared experts, dense first layers
    first_moe = int(cfg.get("first_k_dense_replace") or 0) if sigmoid_moe else 0
    if inter is None and not experts:
        raise ValueError("the model config has no intermediate_size")
    out = [HFTensor("model.embed_tokens.weight", (vocab, h), tp_sharded=True)]
    for layer in range(cfg["num_hidden_layers"]):
        m = f"model.layers.{layer}.mlp"
        out.append(HFTensor(f"model.layers.{layer}.input_layernorm.weight", (h,)))
        if model_type == "deepseek_v3":
            out += _mla_tensors(cfg, layer)
        elif model_type in HYBRID_TYPES and layer_kinds(cfg)[layer] == "linear_attention":
            out += _deltanet_tensors(cfg, layer)
        else:
            out += _attention_tensors(cfg, layer)
        out.append(HFTensor(f"model.layers.{layer}.post_attention_layernorm.weight", (h,)))
        if model_type in ("gemma3_text", "gemma3"):   # Gemma's norms before and after the MLP
            out += [HFTensor(f"model.layers.{layer}.{n}_feedforward_layernorm.weight", (h,)) for n in ("pre", "post")]
        if model_type == "gpt_oss":   # biased router, experts as rows of the stacked tensors (weights.stacked)
            out += [HFTensor(f"{m}.router.weight", (experts, h)), HFTensor(f"{m}.router.bias", (experts,))]
            for e in range(experts):   # expert_tensor 1: unsplit on the trainer
                x = f"{m}.experts.{e}"
                out += [HFTensor(f"{x}.gate_up_proj", (h, 2 * inter), False, True),
                        HFTensor(f"{x}.gate_up_proj_bias", (2 * inter,), False, True),
                        HFTensor(f"{x}.down_proj", (inter, h), False, True),
                        HFTensor(f"{x}.down_proj_bias", (h,), False, True)]
        elif experts and layer >= first_moe:
            out.append(HFTensor(f"{m}.gate.weight", (experts, h)))
            if sigmoid_moe:
                out.append(HFTensor(f"{m}.gate.e_score_correction_bias", (experts,)))
            for e in range(experts):
                x = f"{m}.experts.{e}"
                out += [HFTensor(f"{x}.gate_proj.weight", (moe_inter, h), True, True),
                        HFTensor(f"{x}.up_proj.weight", (moe_inter, h), True, True),
                        HFTensor(f"{x}.down_proj.weight", (h, moe_inter), True, True)]
            shared = (cfg.get("n_shared_experts") or 0) * moe_inter if sigmoid_moe else 0
            if shared:
                x = f"{m}.shared_experts"
                out += [HFTensor(f"{x}.gate_proj.weight", (shared, h), True), HFTensor(f"{x}.up_proj.weight", (shared, h), True),
                        HFTensor(f"{x}.down_proj.weight", (h, shared), True)]
            gated = cfg.get("shared_expert_intermediate_size") if model_type in ("qwen2_moe",) + HYBRID_TYPES else 0
            if gated:   # Qwen2-MoE's shared expert behind its sigmoid gate (Qwen3-Next, Qwen3.5-MoE too)
                x = f"{m}.shared_expert"
                out += [HFTensor(f"{x}.gate_proj.weight", (gated, h), True), HFTensor(f"{x}.up_proj.weight", (gated, h), True),
                        HFTensor(f"{x}.down_proj.weight", (h, gated), True), HFTensor(f"{m}.shared_expert_gate.weight", (1, h))]
        else:
            out += [HFTensor(f"{m}.gate_proj.weight", (inter, h), True), HFTensor(f"{m}.up_proj.weight", (inter, h), True),
                    HFTensor(f"{m}.down_proj.weight", (h, inter), True)]
    out.append(HFTensor("model.norm.weight", (h,)))
    if not cfg.get("tie_word_embeddings", False):
        out.append(HFTensor("lm_head.weight", (vocab, h), tp_sharded=True))
    if model_type in ("qwen3_vl", "qwen3_5", "qwen3_5_moe"):   # checkpoints nesting the language model (`mrl.weights.tables`)
        out = [dataclasses.replace(t, name="model.language_model." + t.name[len("model."):])
               if t.name.startswith("model.") else t for t in out]
    if model_type == "gemma3":   # the multimodal Gemma 3's: `language_model.model.*`
        out = [dataclasses.replace(t, name="language_model.model." + t.name[len("model."):])
               if t.name.startswith("model.") else t for t in out]
    return out + (_vision_tensors(cfg) if is_vlm(cfg) else [])


def _vision_tensors(cfg: dict[str, Any]) -> list[HFTensor]:
    """A vision-language model's tower (replicated on the trainer, exported under its checkpoint
    names: `visual.*`, Qwen3-VL's `model.visual.*`; `mrl.weights.tables`), sized by `transformers`'
    own module built on the meta device (no memory, no arithmetic of ours to drift from it)."""
    from mrl.models.vlm import vision_tower

    prefix = {"qwen3_vl": "model.visual.", "qwen3_5": "model.visual.", "qwen3_5_moe": "model.visual.",
              "gemma3": ""}.get(cfg["model_type"], "visual.")
    tower = vision_tower(cfg, None, device="meta")
    return [HFTensor(prefix + n, tuple(t.shape)) for n, t in tower.state_dict().items()]


def _attention_tensors(cfg: dict[str, Any], layer: int) -> list[HFTensor]:
    """q/k/v/o of grouped-query attention, with the QKV bias and QK-norm the architecture has."""
    from mrl.models.facts import HYBRID_TYPES

    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    model_type = cfg.get("model_type", "llama")
    oss = model_type == "gpt_oss"   # q/k/v/o biases (attention_bias defaults on) and one sink per head
    bias = model_type in ("qwen2", "qwen2_5_vl") or bool(cfg.get("attention_bias", oss))
    qk_norm = (model_type in ("qwen3", "qwen3_moe", "qwen3_vl", "gemma3_text", "gemma3") + HYBRID_TYPES
               or (model_type == "glm4_moe" and bool(cfg.get("use_qk_norm"))))
    a = f"model.layers.{layer}.self_attn"
    gate = 2 if model_type in HYBRID_TYPES else 1   # Qwen3-Next's q_proj: each head's query and output gate
    out = [HFTensor(f"{a}.q_proj.weight", (gate * heads * hd, h), True), HFTensor(f"{a}.k_proj.weight", (kv * hd, h), True),
           HFTensor(f"{a}.v_proj.weight", (kv * hd, h), True)]
    if bias:
        out += [HFTensor(f"{a}.q_proj.bias", (heads * hd,), True), HFTensor(f"{a}.k_proj.bias", (kv * hd,), True),
                HFTensor(f"{a}.v_proj.bias", (kv * hd,), True)]
    if qk_norm:
        out += [HFTensor(f"{a}.q_norm.weight", (hd,)), HFTensor(f"{a}.k_norm.weight", (hd,))]
    out.append(HFTensor(f"{a}.o_proj.weight", (h, heads * hd), True))
    if oss:
        out += [HFTensor(f"{a}.o_proj.bias", (h,)), HFTensor(f"{a}.sinks", (heads,), True)]
    return out


def _deltanet_tensors(cfg: dict[str, Any], layer: int) -> list[HFTensor]:
    """A Gated DeltaNet layer (`mrl.models.gated_deltanet`): Qwen3-Next's fused input projections
    (or Qwen3.5's four), the depthwise conv over q|k|v, the per-head decay and bias, the gated norm
    and the output projection."""
    h = cfg["hidden_size"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    qk, v = nk * cfg["linear_key_head_dim"], nv * cfg["linear_value_head_dim"]
    a = f"model.layers.{layer}.linear_attn"
    if cfg["model_type"] == "qwen3_next":
        out = [HFTensor(f"{a}.in_proj_qkvz.weight", (2 * qk + 2 * v, h), True),
               HFTensor(f"{a}.in_proj_ba.weight", (2 * nv, h), True)]
    else:
        out = [HFTensor(f"{a}.in_proj_qkv.weight", (2 * qk + v, h), True), HFTensor(f"{a}.in_proj_z.weight", (v, h), True),
               HFTensor(f"{a}.in_proj_b.weight", (nv, h), True), HFTensor(f"{a}.in_proj_a.weight", (nv, h), True)]
    kernel = int(cfg.get("linear_conv_kernel_dim") or 4)
    return out + [HFTensor(f"{a}.conv1d.weight", (2 * qk + v, 1, kernel), True), HFTensor(f"{a}.dt_bias", (nv,), True),
                  HFTensor(f"{a}.A_log", (nv,), True), HFTensor(f"{a}.norm.weight", (cfg["linear_value_head_dim"],)),
                  HFTensor(f"{a}.out_proj.weight", (h, v), True)]


def _mla_tensors(cfg: dict[str, Any], layer: int) -> list[HFTensor]:
    """DeepSeek-V3's multi-latent attention: q (bottleneck + norm, or one projection), the k/v
    latent with the shared RoPE key and its norm, the k/v up projection, the output."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_rank, kv_rank = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    a = f"model.layers.{layer}.self_attn"
    if q_rank:
        out = [HFTensor(f"{a}.q_a_proj.weight", (q_rank, h), True), HFTensor(f"{a}.q_a_layernorm.weight", (q_rank,)),
               HFTensor(f"{a}.q_b_proj.weight", (heads * (nope + rope), q_rank), True)]
    else:
        out = [HFTensor(f"{a}.q_proj.weight", (heads * (nope + rope), h), True)]
    return out + [HFTensor(f"{a}.kv_a_proj_with_mqa.weight", (kv_rank + rope, h), True),
                  HFTensor(f"{a}.kv_a_layernorm.weight", (kv_rank,)),
                  HFTensor(f"{a}.kv_b_proj.weight", (heads * (nope + v), kv_rank), True),
                  HFTensor(f"{a}.o_proj.weight", (h, heads * v), True)]


def delta_bytes(numel: int, elem_bytes: float, changed_fraction: float) -> int:
    """Bytes of one tensor under delta sync: sparse index/value pairs or the whole tensor
    (`elem_bytes` may be fractional: an FP8 weight's byte plus its share of the block scales)."""
    return int(min(numel * elem_bytes, int(round(numel * changed_fraction)) * (INDEX_BYTES + elem_bytes)))


@dataclass(frozen=True)
class Group:
    """A communication group a bucket crosses: what runs over it, its size and its link."""

    what: str
    ranks: int
    link: str           # "NVLink" | "InfiniBand" | "PCIe"


@dataclass
class SyncPlan:
    """Everything `mrl plan` prints for one job."""

    model: str
    source: str
    tensors: int
    elements: int
    dtype: str
    full_bytes: int
    delta_bytes: int
    changed_fraction: float
    bucket_mb: int
    buckets: int
    largest_tensor_bytes: int
    groups: list[tuple[Group, int]]          # (group, bytes through it per full sync)
    trainer_extra_bytes: int                 # device: one bucket + the tensor being gathered
    host_copy_bytes: int                     # delta mode: the host copy per engine-holding rank
    engine_extra_bytes: int
    seconds_full: float
    seconds_delta: float
    notes: list[str] = field(default_factory=list)


def _node_span(members: list[int], ranks_per_node: int) -> str:
    return "NVLink" if len({r // ranks_per_node for r in members}) == 1 else "InfiniBand"


def _group_members(world: int, sizes: list[int], which: int) -> list[int]:
    """Ranks of the group of dimension `which` that holds rank 0, for Megatron's rank order where
    `sizes` lists the dimensions innermost first (e.g. tp, cp, dp, pp)."""
    stride = 1
    for s in sizes[:which]:
        stride *= s
    return [i * stride for i in range(sizes[which])]


def _bw(links: Links, link: str) -> float:
    return {"NVLink": links.nvlink_gbps, "InfiniBand": links.ib_gbps, "PCIe": links.pcie_gbps}[link] * 1e9


def plan_sync(spec, *, links: Links = Links(), changed_fraction: float = 0.02) -> SyncPlan:
    """The sync plan of a resolved job spec (`mrl.config.loader.load`)."""
    from mrl.errors import UserError
    from mrl.models.facts import known_hf_config
    from mrl.weights.hf_export import hf_buckets

    found = known_hf_config(spec.model.path)
    if found is None:
        raise UserError(f"model.path: no config for {spec.model.path!r} here (not a builtin preset, a local or cached "
                        "config.json, nor in mrl's table of known models): mrl plan cannot size its weights")
    cfg, source = found
    dtype = spec.rollout.weight_sync.dtype or spec.rollout.dtype or spec.model.dtype
    elem = DTYPE_BYTES[dtype]
    tensors = hf_tensors(cfg)
    full = sum(t.numel for t in tensors) * elem   # what the trainer's gathers move (export dtype)
    from mrl.weights.fp8 import from_config as fp8_stream

    fp8 = fp8_stream(spec.rollout)
    # what reaches the engine: block-FP8 weights (1 byte + 4 per 128x128 block) when quantized
    wire = [(fp8.nbytes(t.name, t.shape, elem) if fp8 else t.numel * elem, t) for t in tensors]
    sent = sum(b for b, _ in wire)
    delta = sum(delta_bytes(t.numel, b / t.numel, changed_fraction) for b, t in wire)
    bucket_mb = spec.rollout.weight_sync.bucket_mb

    class _Sized:   # hf_buckets packs by numel * element_size, which is all it reads: here, bytes x 1
        def __init__(self, n):
            self.n = n

        def numel(self):
            return self.n

        def element_size(self):
            return 1

    n_buckets = sum(1 for _ in hf_buckets(((t.name, _Sized(b)) for b, t in wire), bucket_mb * 2**20))
    largest = max(t.numel for t in tensors) * elem

    p, rpn = spec.parallel, spec.platform.ranks_per_node
    world = spec.platform.nodes * rpn
    rollout_ranks = spec.rollout.ranks if spec.rollout.placement == "separate" else 0
    trainer_world = world - rollout_ranks
    tp, pp, cp, ep = p.tensor, p.pipeline, p.context, p.expert
    etp = p.expert_tensor or tp
    dp = trainer_world // (tp * pp * cp)
    edp = trainer_world // (etp * ep * pp)
    dense_sizes, expert_sizes = [tp, cp, dp, pp], [etp, ep, edp, pp]
    sharded = sum(t.numel for t in tensors if t.tp_sharded and not t.expert) * elem
    expert_bytes = sum(t.numel for t in tensors if t.expert) * elem
    groups: list[tuple[Group, int]] = []
    seconds = 0.0
    if tp > 1 and sharded:
        g = Group("TP all-gather", tp, _node_span(_group_members(trainer_world, dense_sizes, 0), rpn))
        groups.append((g, sharded))
        seconds += sharded * (tp - 1) / tp / _bw(links, g.link)
    if etp > 1 and expert_bytes:
        g = Group("expert-TP all-gather", etp, _node_span(_group_members(trainer_world, expert_sizes, 0), rpn))
        groups.append((g, expert_bytes))
        seconds += expert_bytes * (etp - 1) / etp / _bw(links, g.link)
    if ep > 1 and expert_bytes:
        g = Group("EP broadcast", ep, _node_span(_group_members(trainer_world, expert_sizes, 1), rpn))
        groups.append((g, expert_bytes))
        seconds += expert_bytes / _bw(links, g.link)
    if pp > 1:
        g = Group("PP broadcast", pp, _node_span(_group_members(trainer_world, dense_sizes, 3), rpn))
        groups.append((g, full))
        seconds += full / _bw(links, g.link)
    notes = []
    bridge = 0.0
    if rollout_ranks:
        members = [0] + list(range(trainer_world, world))
        g = Group("bridge broadcast to rollout ranks", len(members), _node_span(members, rpn))
        groups.append((g, sent))
        bridge = 1 / _bw(links, g.link)
        notes.append(f"separate placement: trainer rank 0 sends every bucket to {rollout_ranks} rollout ranks")
    else:
        notes.append(f"colocated: every trainer rank receives full tensors; engine groups of "
                     f"{spec.rollout.tensor_parallel} ranks ({spec.rollout.engine}) shard them locally")
    if spec.rollout.engine == "vllm":
        notes.append("vllm delta syncs send changed tensors whole, with the rest of their fused module (q/k/v, "
                     "gate/up): more than the delta figure where few elements change")
    if fp8:
        notes.append(f"fp8: linear weights cross as block FP8 with float32 scales per 128x128 block, "
                     f"{sent / full:.1%} of the {dtype} bytes; quantized after the trainer's gathers")
    pcie = Group("host copy compare (delta), per rank", 1, "PCIe")
    compare_s = sent / _bw(links, "PCIe") if spec.platform.device == "cuda" else 0.0
    bucket_bytes = min(bucket_mb * 2**20, sent)   # buckets hold what is sent (fp8: the quantized tensors)
    # the tensor being gathered: its TP shards list plus the assembled full tensor
    trainer_extra = bucket_bytes + 2 * largest
    return SyncPlan(model=spec.model.path, source=source, tensors=len(tensors), elements=full // elem,
                    dtype=dtype + (" -> block fp8 (e4m3)" if fp8 else ""), full_bytes=sent, delta_bytes=delta,
                    changed_fraction=changed_fraction, bucket_mb=bucket_mb,
                    buckets=n_buckets, largest_tensor_bytes=largest, groups=groups + ([(pcie, sent)] if compare_s else []),
                    trainer_extra_bytes=trainer_extra, host_copy_bytes=sent,
                    engine_extra_bytes=max(bucket_bytes, max(b for b, _ in wire)),
                    seconds_full=seconds + sent * bridge, seconds_delta=seconds + delta * bridge + compare_s,
                    notes=notes)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def render(plan: SyncPlan, links: Links, job: str) -> str:
    """The plan as a plain-text table."""
    rows = [
        ("model", f"{plan.model} ({plan.source})"),
        ("tensors / elements", f"{plan.tensors} / {plan.elements / 1e9:.3f} B"),
        ("export dtype", plan.dtype),
        ("bytes per full sync", _size(plan.full_bytes)),
        (f"bytes per delta sync ({plan.changed_fraction:.1%} changed)", _size(plan.delta_bytes)),
        (f"buckets of {plan.bucket_mb} MiB", str(plan.buckets)),
        ("largest tensor", _size(plan.largest_tensor_bytes)),
        ("trainer peak extra (device)", f"{_size(plan.trainer_extra_bytes)} (one bucket + the tensor being gathered)"),
        ("trainer host copy (delta only)", _size(plan.host_copy_bytes)),
        ("engine peak extra", f"{_size(plan.engine_extra_bytes)} (one bucket)"),
    ]
    for g, nbytes in plan.groups:
        rows.append((f"crosses: {g.what}", (f"{g.ranks} ranks over " if g.ranks > 1 else "") + f"{g.link}, {_size(nbytes)} per sync"))
    rows += [
        ("est. sync time, full", f"{plan.seconds_full:.2f} s"),
        ("est. sync time, delta", f"{plan.seconds_delta:.2f} s"),
        ("link bandwidths (GB/s)", f"NVLink {links.nvlink_gbps:g}, InfiniBand {links.ib_gbps:g}, "
                                   f"PCIe {links.pcie_gbps:g}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"weight sync plan: {job}"] + [f"  {k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"  note: {n}" for n in plan.notes]
    lines.append("  note: link time only (no latency, no engine load); trainer gathers move full tensors in both modes")
    return "\n".join(lines)


def plan_text(spec, job: str, links: Optional[Links] = None, changed_fraction: float = 0.02) -> str:
    links = links or Links()
    return render(plan_sync(spec, links=links, changed_fraction=changed_fraction), links, job)
