"""The HF engine's norms, biases and row-parallel projections on CPU in bf16 / fp16: rounded where
the trainer's CPU model rounds them (`mrl.models.attention.RMSNorm`, megatron's local linear layers).

Why: the bf16 quickstart's audit (`rollout/logprob_abs_diff_mean`, one rank) was 9.1e-6 at step 1
and 9.0e-4 / 7.6e-4 at steps 2 / 3, after the first weight sync, with the engine holding the
trainer's bytes exactly; at TP=2 it was 8.4e-4 from step 1. Three places where transformers and
the trainer round differently; the first two do not show while the weights are the initial ones,
since norm weights start at 1 and biases at 0:

- RMSNorm. transformers' Llama-style norm (`weight * x_normed.to(dtype)`) rounds the normalised
  activations to bf16 and then rounds again after the weight; the trainer's `torch.nn.RMSNorm`
  (torch's `rms_norm`) multiplies by the weight in float32 and rounds once (24% of the outputs of
  a random bf16 norm differ by one ulp). The norms here call the trainer's op,
  `torch.nn.functional.rms_norm`.
- Biases. megatron's local linear layers compute `matmul(x, w.t())`, rounded, and add the bias
  after (`output + bias`, or the bias-dropout-add of an output projection), rounding again;
  `nn.Linear` with a bias is one `addmm` that adds it before its single rounding (28% of the
  outputs differ with a random bias). The biased layers here compute `linear(x, w) + b`.
- Tensor parallelism (`parallel.tensor` = t > 1). A row-parallel layer (attention's output
  projection, the MLP's down projection) gives each rank a slice of the input dimension; each
  rank's partial product is rounded and the all-reduce sums them. Here `o_proj` / `down_proj`
  compute the t slices' products and add them in rank order, as a two-rank all-reduce does (with
  more ranks the all-reduce may add in another order).

Measured on the bf16 quickstart (hf engine, CPU), audit mean at steps 1..5: one rank 9.1e-6,
2.2e-6, 4.6e-8 (steps 1..3; before: 9.1e-6, 9.0e-4, 7.6e-4); TP=2 1.8e-7, 1.9e-6, 1.1e-7, 4.4e-8,
4.5e-8 (before: 8.4e-4, 9.1e-4, 8.1e-4, 8.3e-4, 8.9e-4).

What remains is the floor of bf16 decoding, not a rounding of mrl's: the engine's full forward of
the sampled tokens equals the trainer's bit for bit, and its decoding departs from that forward
only at an attention output (tests/rollout/test_hf_rounding.py checks both). Decoding runs one
query against the KV cache; the trainer (and a full forward) the causal block of the whole
sequence; both in float32 (`hf_attention`), summing in other orders: about 60% of the float32
outputs differ in their last bits and 6e-5 of them round to another bf16 value. No decoding
kernel can round as the trainer does: the trainer's own output at a position (torch's CPU flash
kernel, causal, which the full forward also runs) moves alike with the sequence's total length,
which decoding does not know yet (random q, k, v: 21 tokens against their first 15, 56% and
4.4e-5), and the two paths are equally close to float64 (6.9e-5 and 7.6e-5 of their bf16
roundings off). One element one ulp off moves the token's logits (through o_proj and
the residual) and every later token of its row (through the next layer's keys and values): in the
test's tiny model a log-prob by 1e-4 to 1e-2. Which responses meet such a rounding depends on
their tokens, so the audit depends on the draws, of either sampler alike (the test's scenario,
seeds 0..39: audit mean above 0 at 15 seeds with `torch.multinomial` and 22 with the race for
qwen3, largest 2.1e-4 and 2.9e-4, rounding-apart rate 6.2e-5 and 7.1e-5; qwen2 8 and 11, 2.6e-4
and 1.4e-4, 6.7e-5 and 5.5e-5; the full forward 0 at all 160). It is not low-probability tokens
(the worst tokens' probabilities 0.0013 to 0.029 in a vocabulary of 250), nor the first token after
the prompt (never the worst here), nor left padding (rows with and without it alike). The
quickstart's one-rank step 15 of 20 has the same signature (3.1e-5: one token's logit one bf16
ulp apart, the engine's full forward equal to the trainer's to 2.5e-7; not traced to its op).

Only the language model changes (a vision tower runs the same transformers modules on both
sides); norms of another formula keep theirs (gpt-oss' already multiplies in float32 and rounds
once, Gemma 3's `1 + w` is computed in float32 on both sides); MoE experts are not `nn.Linear`s
and keep theirs; on GPUs nothing changes (the trainer's kernels there are Transformer Engine's).
`mrl.rollout.hf_attention` does the same for attention.
"""
from __future__ import annotations

import types

import torch

#: transformers' names of the projections megatron splits by their input dimension (`RowParallelLinear`)
ROW_PARALLEL = ("o_proj", "down_proj")

#: transformers' RMSNorm classes that compute `weight * hidden_states.to(input_dtype)` (Llama's)
LLAMA_STYLE_NORMS = frozenset({
    "LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen2MoeRMSNorm",
    "Qwen3MoeRMSNorm", "DeepseekV3RMSNorm", "Glm4MoeRMSNorm", "Qwen2_5_VLRMSNorm", "Qwen3VLTextRMSNorm",
})


def _rms_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


def _linear_rounded(self, x: torch.Tensor) -> torch.Tensor:
    """`x @ w.t()` rounded, over `_mrl_tp` contiguous slices of the input dimension summed in rank
    order (each slice's product rounded: a row-parallel layer's partial sums and their all-reduce),
    then `+ bias`, rounded again."""
    tp = self._mrl_tp
    if tp == 1:
        out = torch.nn.functional.linear(x, self.weight)
    else:
        k = x.shape[-1] // tp
        out = torch.nn.functional.linear(x[..., :k], self.weight[:, :k])
        for r in range(1, tp):
            out = out + torch.nn.functional.linear(x[..., r * k:(r + 1) * k], self.weight[:, r * k:(r + 1) * k])
    return out if self.bias is None else out + self.bias


def _language_modules(model: torch.nn.Module):
    """(name, module) of `model` outside a vision tower."""
    for name, module in model.named_modules():
        if not any(part in ("visual", "vision_tower", "vision_model") for part in name.split(".")):
            yield name, module


def trainer_rounding_on_cpu(model: torch.nn.Module, tensor_parallel: int = 1) -> int:
    """Make `model`'s Llama-style RMSNorms, biased `nn.Linear`s and (with `tensor_parallel` > 1, the
    trainer's `parallel.tensor`) row-parallel projections round as the trainer's CPU model does,
    when its parameters are bf16 / fp16 on CPU; returns how many modules changed (0 otherwise)."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype not in (torch.bfloat16, torch.float16):
        return 0
    changed = 0
    for name, module in _language_modules(model):
        if type(module).__name__ in LLAMA_STYLE_NORMS:
            module.forward = types.MethodType(_rms_norm, module)
            changed += 1
        elif type(module) is torch.nn.Linear:
            row = tensor_parallel > 1 and name.rsplit(".", 1)[-1] in ROW_PARALLEL \
                and module.in_features % tensor_parallel == 0
            if module.bias is None and not row:
                continue
            module._mrl_tp = tensor_parallel if row else 1
            module.forward = types.MethodType(_linear_rounded, module)
            changed += 1
    return changed
