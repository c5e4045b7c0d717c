"""Megatron <-> Hugging Face name tables, one per architecture.

Each row is `(megatron pattern, HF name or names, transform)`. `{L}` is the global layer index,
`{E}` the global expert index, `{R}` any rest of a name (a whole Hugging Face
module kept as it is: a VLM's vision tower). Rows for parameters a given model does not have (Transformer
Engine's fused norm names when running the local spec, dense MLPs in an all-MoE model) simply
never match. Adding an architecture means adding a table here, not a code path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from mrl.weights.transforms import (DELTANET_CONV, DELTANET_QKV_Z_B_A, DELTANET_QKVZ_BA, GATE_UP, GATED_QKV, IDENTITY,
                                    INTERLEAVED_GATE_UP, QKV_FUSED, TRANSPOSED, VOCAB,
                                    Transform)

HFNames = Union[str, tuple[str, ...]]


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: HFNames
    transform: Transform = IDENTITY

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,) if isinstance(self.hf, str) else self.hf


def _rules(*rows) -> tuple[Rule, ...]:
    return tuple(Rule(*row) for row in rows)


_A = "decoder.layers.{L}.self_attention"
_M = "decoder.layers.{L}.mlp"
_HA = "model.layers.{L}.self_attn"
_HM = "model.layers.{L}.mlp"

EMBEDDINGS = _rules(
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight", VOCAB),
    ("decoder.final_layernorm.weight", "model.norm.weight"),
    ("output_layer.weight", "lm_head.weight", VOCAB),
)

ATTENTION = _rules(
    ("decoder.layers.{L}.input_layernorm.weight", "model.layers.{L}.input_layernorm.weight"),
    (f"{_A}.linear_qkv.layer_norm_weight", "model.layers.{L}.input_layernorm.weight"),  # TE fused norm
    (f"{_A}.linear_qkv.weight", (f"{_HA}.q_proj.weight", f"{_HA}.k_proj.weight", f"{_HA}.v_proj.weight"), QKV_FUSED),
    (f"{_A}.linear_proj.weight", f"{_HA}.o_proj.weight"),
    ("decoder.layers.{L}.pre_mlp_layernorm.weight", "model.layers.{L}.post_attention_layernorm.weight"),
)

QKV_BIAS = _rules(
    (f"{_A}.linear_qkv.bias", (f"{_HA}.q_proj.bias", f"{_HA}.k_proj.bias", f"{_HA}.v_proj.bias"), QKV_FUSED),
)

QK_NORM = _rules(
    (f"{_A}.q_layernorm.weight", f"{_HA}.q_norm.weight"),
    (f"{_A}.k_layernorm.weight", f"{_HA}.k_norm.weight"),
)

DENSE_MLP = _rules(
    (f"{_M}.linear_fc1.layer_norm_weight", "model.layers.{L}.post_attention_layernorm.weight"),  # TE fused norm
    (f"{_M}.linear_fc1.weight", (f"{_HM}.gate_proj.weight", f"{_HM}.up_proj.weight"), GATE_UP),
    (f"{_M}.linear_fc2.weight", f"{_HM}.down_proj.weight"),
)


def _experts(router: str, expert: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """Routed experts: megatron's SequentialMLP (local spec) and TEGroupedMLP (grouped GEMM) names."""
    e = f"{expert}.{{E}}"
    return _rules(
        (f"{_M}.router.weight", router),
        (f"{_M}.experts.local_experts.{{E}}.linear_fc1.weight", (f"{e}.{gate}.weight", f"{e}.{up}.weight"), GATE_UP),
        (f"{_M}.experts.local_experts.{{E}}.linear_fc2.weight", f"{e}.{down}.weight"),
        (f"{_M}.experts.linear_fc1.weight{{E}}", (f"{e}.{gate}.weight", f"{e}.{up}.weight"), GATE_UP),
        (f"{_M}.experts.linear_fc2.weight{{E}}", f"{e}.{down}.weight"),
    )


QWEN_MOE_EXPERTS = _experts("model.layers.{L}.mlp.gate.weight", "model.layers.{L}.mlp.experts",
                            "gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERTS = _experts("model.layers.{L}.block_sparse_moe.gate.weight",
                           "model.layers.{L}.block_sparse_moe.experts", "w1", "w3", "w2")

# Qwen2-MoE's always-on expert and its sigmoid gate (megatron's SharedExpertMLP, `moe_shared_expert_gate`).
QWEN2_MOE_SHARED = _rules(
    (f"{_M}.shared_experts.linear_fc1.weight", (f"{_HM}.shared_expert.gate_proj.weight",
                                                f"{_HM}.shared_expert.up_proj.weight"), GATE_UP),
    (f"{_M}.shared_experts.linear_fc2.weight", f"{_HM}.shared_expert.down_proj.weight"),
    (f"{_M}.shared_experts.gate_weight", f"{_HM}.shared_expert_gate.weight"),
)

# DeepSeek-V3 multi-latent attention (megatron's MLASelfAttention): every projection keeps the HF
# layout (q_b / kv_b rows are per head [nope | rope] and [k_nope | v], as megatron splits them; the
# down projections are column-parallel over their latent rows), so every row is the identity.
# `linear_q_proj` is the one q projection of models without a q bottleneck (q_lora_rank null).
_DS_A = "model.layers.{L}.self_attn"
MLA = _rules(
    ("decoder.layers.{L}.input_layernorm.weight", "model.layers.{L}.input_layernorm.weight"),
    (f"{_A}.linear_q_proj.weight", f"{_DS_A}.q_proj.weight"),
    (f"{_A}.linear_q_down_proj.weight", f"{_DS_A}.q_a_proj.weight"),
    (f"{_A}.q_layernorm.weight", f"{_DS_A}.q_a_layernorm.weight"),
    (f"{_A}.linear_q_up_proj.weight", f"{_DS_A}.q_b_proj.weight"),
    (f"{_A}.linear_kv_down_proj.weight", f"{_DS_A}.kv_a_proj_with_mqa.weight"),
    (f"{_A}.kv_layernorm.weight", f"{_DS_A}.kv_a_layernorm.weight"),
    (f"{_A}.linear_q_up_proj.layer_norm_weight", f"{_DS_A}.q_a_layernorm.weight"),    # TE fused norm
    (f"{_A}.linear_kv_up_proj.layer_norm_weight", f"{_DS_A}.kv_a_layernorm.weight"),  # TE fused norm
    (f"{_A}.linear_kv_up_proj.weight", f"{_DS_A}.kv_b_proj.weight"),
    (f"{_A}.linear_proj.weight", f"{_DS_A}.o_proj.weight"),
    ("decoder.layers.{L}.pre_mlp_layernorm.weight", "model.layers.{L}.post_attention_layernorm.weight"),
)

# DeepSeek-V3's shared experts (no gate) and its router's score-correction bias (a buffer on both
# sides: megatron's `expert_bias`, HF's `e_score_correction_bias`).
DEEPSEEK_MOE_EXTRAS = _rules(
    (f"{_M}.router.expert_bias", "model.layers.{L}.mlp.gate.e_score_correction_bias"),
    (f"{_M}.shared_experts.linear_fc1.weight", (f"{_HM}.shared_experts.gate_proj.weight",
                                                f"{_HM}.shared_experts.up_proj.weight"), GATE_UP),
    (f"{_M}.shared_experts.linear_fc2.weight", f"{_HM}.shared_experts.down_proj.weight"),
)

# gpt-oss: biases on o_proj, the router and the experts; each head's attention sink (Transformer
# Engine's and mrl's `core_attention.softmax_offset`); experts stacked per projection in the
# checkpoint, here one expert's row of each (`experts.{E}.gate_up_proj` is row E of
# `experts.gate_up_proj`, `mrl.weights.stacked`): gate/up interleaved and input-major.
_GE = "model.layers.{L}.mlp.experts.{E}"
GPT_OSS = _rules(
    (f"{_A}.linear_proj.bias", f"{_HA}.o_proj.bias"),
    (f"{_A}.core_attention.softmax_offset", f"{_HA}.sinks"),
    (f"{_M}.router.weight", f"{_HM}.router.weight"),
    (f"{_M}.router.bias", f"{_HM}.router.bias"),
    (f"{_M}.experts.local_experts.{{E}}.linear_fc1.weight", f"{_GE}.gate_up_proj", INTERLEAVED_GATE_UP),
    (f"{_M}.experts.local_experts.{{E}}.linear_fc1.bias", f"{_GE}.gate_up_proj_bias", INTERLEAVED_GATE_UP),
    (f"{_M}.experts.local_experts.{{E}}.linear_fc2.weight", f"{_GE}.down_proj", TRANSPOSED),
    (f"{_M}.experts.local_experts.{{E}}.linear_fc2.bias", f"{_GE}.down_proj_bias"),
    (f"{_M}.experts.linear_fc1.weight{{E}}", f"{_GE}.gate_up_proj", INTERLEAVED_GATE_UP),
    (f"{_M}.experts.linear_fc1.bias{{E}}", f"{_GE}.gate_up_proj_bias", INTERLEAVED_GATE_UP),
    (f"{_M}.experts.linear_fc2.weight{{E}}", f"{_GE}.down_proj", TRANSPOSED),
    (f"{_M}.experts.linear_fc2.bias{{E}}", f"{_GE}.down_proj_bias"),
)

# Gemma 3's text model: norms before and after attention and the MLP (mrl's `post_norm` on
# megatron's attention and MLP, `mrl.models.gemma3`); the checkpoint's `post_attention_layernorm` is
# the norm after attention, its `pre_feedforward_layernorm` megatron's pre-MLP norm.
GEMMA3 = _rules(
    ("decoder.layers.{L}.input_layernorm.weight", "model.layers.{L}.input_layernorm.weight"),
    (f"{_A}.linear_qkv.layer_norm_weight", "model.layers.{L}.input_layernorm.weight"),  # TE fused norm
    (f"{_A}.linear_qkv.weight", (f"{_HA}.q_proj.weight", f"{_HA}.k_proj.weight", f"{_HA}.v_proj.weight"), QKV_FUSED),
    (f"{_A}.linear_proj.weight", f"{_HA}.o_proj.weight"),
    (f"{_A}.post_norm.weight", "model.layers.{L}.post_attention_layernorm.weight"),
    ("decoder.layers.{L}.pre_mlp_layernorm.weight", "model.layers.{L}.pre_feedforward_layernorm.weight"),
    (f"{_M}.linear_fc1.layer_norm_weight", "model.layers.{L}.pre_feedforward_layernorm.weight"),  # TE fused norm
    (f"{_M}.linear_fc1.weight", (f"{_HM}.gate_proj.weight", f"{_HM}.up_proj.weight"), GATE_UP),
    (f"{_M}.linear_fc2.weight", f"{_HM}.down_proj.weight"),
    (f"{_M}.post_norm.weight", "model.layers.{L}.post_feedforward_layernorm.weight"),
)

# Qwen3-Next / Qwen3.5 hybrids (`mrl.models.gated_deltanet`): full-attention layers are the Qwen3
# attention with the output gate in q_proj (`GATED_QKV`); linear-attention layers are Gated
# DeltaNets (`linear_attn`) in megatron's self-attention slot, under megatron's GatedDeltaNet names.
GATED_ATTENTION = tuple(Rule(r.megatron, r.hf, GATED_QKV if r.transform is QKV_FUSED else r.transform)
                        for r in ATTENTION)
_HL = "model.layers.{L}.linear_attn"
DELTANET = _rules(
    (f"{_A}.conv1d.weight", f"{_HL}.conv1d.weight", DELTANET_CONV),
    (f"{_A}.A_log", f"{_HL}.A_log"),
    (f"{_A}.dt_bias", f"{_HL}.dt_bias"),
    (f"{_A}.out_norm.weight", f"{_HL}.norm.weight"),
    (f"{_A}.out_proj.weight", f"{_HL}.out_proj.weight"),
)
# Qwen3-Next fuses the input projections per key head (q k v z, then b a); Qwen3.5 keeps four.
QWEN3_NEXT_IN_PROJ = _rules(
    (f"{_A}.in_proj.weight", (f"{_HL}.in_proj_qkvz.weight", f"{_HL}.in_proj_ba.weight"), DELTANET_QKVZ_BA),
)
QWEN3_5_IN_PROJ = _rules(
    (f"{_A}.in_proj.weight", (f"{_HL}.in_proj_qkv.weight", f"{_HL}.in_proj_z.weight", f"{_HL}.in_proj_b.weight",
                              f"{_HL}.in_proj_a.weight"), DELTANET_QKV_Z_B_A),
)

# A VLM's Hugging Face vision tower (`mrl.models.vlm_gpt`), replicated, under its checkpoint names:
# `{R}` is the rest of the name, the same on both sides.
VISION_TOWER = _rules(("vision.{R}", "visual.{R}"))



def _under(prefix: str, rows: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """`rows` with their Hugging Face names' leading `model.` replaced by `prefix` (`lm_head` stays)."""
    def move(name: str) -> str:
        return prefix + name[len("model."):] if name.startswith("model.") else name
    return tuple(Rule(r.megatron, tuple(move(n) for n in r.hf_names) if not isinstance(r.hf, str) else move(r.hf),
                      r.transform) for r in rows)


# HF checkpoint model_type -> its table.
TABLES: dict[str, tuple[Rule, ...]] = {
    "llama": EMBEDDINGS + ATTENTION + DENSE_MLP,
    "mistral": EMBEDDINGS + ATTENTION + DENSE_MLP,
    "qwen2": EMBEDDINGS + ATTENTION + QKV_BIAS + DENSE_MLP,
    "qwen3": EMBEDDINGS + ATTENTION + QK_NORM + DENSE_MLP,
    # Qwen3-MoE may keep dense MLPs in some layers (`mlp_only_layers`): both row groups apply.
    "qwen3_moe": EMBEDDINGS + ATTENTION + QK_NORM + DENSE_MLP + QWEN_MOE_EXPERTS,
    # Qwen2-MoE: Qwen2 attention (QKV bias), Qwen MoE experts plus the gated shared expert; dense
    # MLPs where `mlp_only_layers` / `decoder_sparse_step` say so.
    "qwen2_moe": EMBEDDINGS + ATTENTION + QKV_BIAS + DENSE_MLP + QWEN_MOE_EXPERTS + QWEN2_MOE_SHARED,
    "mixtral": EMBEDDINGS + ATTENTION + MIXTRAL_EXPERTS,
    # Qwen2.5-VL: the Qwen2 language model (its checkpoint keeps the `model.` names) and the tower.
    "qwen2_5_vl": EMBEDDINGS + ATTENTION + QKV_BIAS + DENSE_MLP + VISION_TOWER,
    # Qwen3-VL: the Qwen3 language model (QK-norm, no bias) and the tower (its deepstack mergers
    # included), under the nested names its checkpoints keep (`model.language_model.`, `model.visual.`).
    "qwen3_vl": _under("model.language_model.", EMBEDDINGS + ATTENTION + QK_NORM + DENSE_MLP)
                + _rules(("vision.{R}", "model.visual.{R}")),
    # DeepSeek-V3 / R1 (and Kimi-K2): MLA, dense MLPs in the first `first_k_dense_replace` layers,
    # then routed experts (Qwen-MoE names) with shared experts and the router's correction bias.
    "deepseek_v3": EMBEDDINGS + MLA + DENSE_MLP + QWEN_MOE_EXPERTS + DEEPSEEK_MOE_EXTRAS,
    # GLM-4.5 / 4.6: GQA attention with QKV bias (`attention_bias`) and optional QK-norm
    # (`use_qk_norm`), dense MLPs in the first `first_k_dense_replace` layers, then DeepSeek-V3's
    # experts, shared experts and correction bias under the same names.
    "glm4_moe": EMBEDDINGS + ATTENTION + QKV_BIAS + QK_NORM + DENSE_MLP + QWEN_MOE_EXPERTS + DEEPSEEK_MOE_EXTRAS,
    # gpt-oss: GQA attention with biases and sinks, every layer's MLP routed experts.
    "gpt_oss": EMBEDDINGS + ATTENTION + QKV_BIAS + GPT_OSS,
    "gemma3_text": EMBEDDINGS + GEMMA3 + QKV_BIAS + QK_NORM,
    # Qwen3-Next: hybrid layers, routed experts with the gated shared expert (Qwen2-MoE names) in
    # every layer (or a dense MLP where `mlp_only_layers` says); Qwen3.5: the same layers, its own
    # DeltaNet projections, dense (qwen3_5_text) or MoE (qwen3_5_moe_text).
    "qwen3_next": (EMBEDDINGS + GATED_ATTENTION + QK_NORM + DELTANET + QWEN3_NEXT_IN_PROJ + DENSE_MLP
                   + QWEN_MOE_EXPERTS + QWEN2_MOE_SHARED),
    "qwen3_5_text": EMBEDDINGS + GATED_ATTENTION + QK_NORM + DELTANET + QWEN3_5_IN_PROJ + DENSE_MLP,
    "qwen3_5_moe_text": (EMBEDDINGS + GATED_ATTENTION + QK_NORM + DELTANET + QWEN3_5_IN_PROJ + DENSE_MLP
                         + QWEN_MOE_EXPERTS + QWEN2_MOE_SHARED),
    # The multimodal Qwen3.5 (dense, MoE): its text model's rows under `model.language_model.`, the
    # tower as `model.visual.*`, an untied head as `lm_head` (the names transformers saves).
    "qwen3_5": _under("model.language_model.", EMBEDDINGS + GATED_ATTENTION + QK_NORM + DELTANET + QWEN3_5_IN_PROJ
                      + DENSE_MLP) + _rules(("vision.{R}", "model.visual.{R}")),
    "qwen3_5_moe": _under("model.language_model.", EMBEDDINGS + GATED_ATTENTION + QK_NORM + DELTANET + QWEN3_5_IN_PROJ
                          + DENSE_MLP + QWEN_MOE_EXPERTS + QWEN2_MOE_SHARED) + _rules(("vision.{R}", "model.visual.{R}")),
    # The multimodal Gemma 3, under the names its checkpoints keep (transformers 5 writes them too,
    # though it holds `model.language_model.*` in memory): the text model under `language_model.model.`,
    # the SigLIP tower and the projector (`mrl.models.gemma3_vlm.Gemma3Vision`) as `vision_tower.*` and
    # `multi_modal_projector.*`; an untied head as `lm_head` (stored `language_model.lm_head`: LEGACY_PREFIXES).
    "gemma3": _under("language_model.model.", EMBEDDINGS + GEMMA3 + QKV_BIAS + QK_NORM)
              + _rules(("vision.vision_tower.{R}", "vision_tower.{R}"),
                       ("vision.multi_modal_projector.{R}", "multi_modal_projector.{R}")),
}

# Rows whose megatron side is a buffer, not a parameter (mapped like one when the model has it).
BUFFER_SUFFIXES = (".router.expert_bias",)

# Heads that replace the output layer for the critic and the reward model (`*ForTokenClassification`
# / `*ForSequenceClassification` name their one-output projection `score`).
VALUE_HEAD = _rules(("output_layer.weight", "score.weight"))


# LoRA adapters (`mrl.models.lora`) <-> PEFT's names for them, below PEFT's `base_model.model.` prefix.
# The adapters are stored per Hugging Face projection even where megatron fuses the base weight
# (q/k/v in `linear_qkv`, gate/up in `linear_fc1`): `A [r, in]`, `B [out, r]`, and each adapter
# tensor is TP-split along one dimension in rank order (column-parallel B by output rows, row-
# parallel A by input columns), so every row is the identity transform.
def _adapter_rows(linear: str, hf_module: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{linear}.lora.{m}.{hf_module.rsplit('.', 1)[1]}", f"{hf_module}.lora_{m}.weight") for m in "AB")


def is_adapter_name(name: str) -> bool:
    """Whether a megatron parameter name is a LoRA adapter's (`mrl.models.lora`)."""
    return ".lora.A." in name or ".lora.B." in name or name.startswith("lora.")


LORA_ADAPTERS = _rules(
    *_adapter_rows(f"{_A}.linear_qkv", f"{_HA}.q_proj"),
    *_adapter_rows(f"{_A}.linear_qkv", f"{_HA}.k_proj"),
    *_adapter_rows(f"{_A}.linear_qkv", f"{_HA}.v_proj"),
    *_adapter_rows(f"{_A}.linear_proj", f"{_HA}.o_proj"),
    *_adapter_rows(f"{_M}.linear_fc1", f"{_HM}.gate_proj"),
    *_adapter_rows(f"{_M}.linear_fc1", f"{_HM}.up_proj"),
    *_adapter_rows(f"{_M}.linear_fc2", f"{_HM}.down_proj"),
)
PEFT_PREFIX = "base_model.model."


def embedding_name(model_type: str) -> str:
    """The checkpoint's name of the word embedding (what a tied LM head reads)."""
    return next(r.hf for r in TABLES[model_type] if r.megatron == "embedding.word_embeddings.weight")


def table_for(model_type: str, role: str = "actor") -> tuple[Rule, ...]:
    """The rows for `model_type`; critic and reward-model roles swap the LM head for the value head."""
    from mrl.errors import UserError

    if model_type not in TABLES:
        raise UserError(f"model.path: no weight-mapping table for model_type {model_type!r} "
                        f"(tables: {', '.join(sorted(TABLES))})")
    rows = TABLES[model_type]
    if role in ("critic", "reward"):
        rows = tuple(r for r in rows if r.megatron != "output_layer.weight") + VALUE_HEAD
    return rows


# Other checkpoint layouts of a type, as (stored prefix, the table's prefix) pairs, applied on
# import (`hf_import.Checkpoint`). Gemma 3: the Hub's checkpoints (written by transformers 4) nest
# the SigLIP tower under `vision_tower.vision_model.`; transformers 5's in-memory names
# (`model.language_model.*`, ...) as some tools save them; an untied head as the tables' `lm_head`.
LEGACY_PREFIXES: dict[str, tuple[tuple[str, str], ...]] = {
    "gemma3": (("vision_tower.vision_model.", "vision_tower."), ("model.language_model.", "language_model.model."),
               ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."),
               ("language_model.lm_head.", "lm_head.")),
}
