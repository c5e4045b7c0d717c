"""The four model roles, built from one Hugging Face config.

- actor: the policy; log-probs and entropy of given tokens from its (vocab-parallel) logits;
- critic: the output layer replaced by a value head, one value per token;
- ref: the policy's architecture, frozen (no grads, no optimizer state);
- reward: a value head whose value at each sequence's last token is the reward.

Value-head weights are named `score.weight` in Hugging Face checkpoints, as in `transformers`'
`*ForTokenClassification` / `*ForSequenceClassification` models.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

import torch

from mrl.models.megatron import build_gpt, padded_vocab_size, transformer_config
from mrl.platform.config import ParallelConfig

Role = Literal["actor", "critic", "ref", "reward"]
ROLES: tuple[str, ...] = ("actor", "critic", "ref", "reward")


class ValueHead(torch.nn.Module):
    """A scalar per token in place of the LM head: `hidden @ weight.T`, weight `[1, hidden]`.

    Replicated on every tensor-parallel rank. It takes the output layer's call signature and,
    under sequence parallelism, gathers the sequence first so every rank holds full values.
    """

    def __init__(self, config):
        super().__init__()
        self.sequence_parallel = bool(config.sequence_parallel)
        weight = torch.empty(1, config.hidden_size, dtype=config.params_dtype)
        torch.nn.init.normal_(weight, mean=0.0, std=config.init_method_std)
        self.weight = torch.nn.Parameter(weight)

    def forward(self, hidden: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden)
        return torch.nn.functional.linear(hidden, self.weight), None


def build_role_model(role: Role, hf: dict[str, Any], parallel: ParallelConfig, *, dtype: str, device: str,
                     recompute: str = "none", vp_stage: Optional[int] = None, vocab_multiple: int = 128,
                     attention: str = "auto", fused: bool = True, pg_collection=None,
                     **config_overrides) -> torch.nn.Module:
    """This rank's GPTModel shard for `role` (one virtual-pipeline chunk).

    Critic and reward models never tie the embedding to an output layer: their head is a value head.
    `attention` and `fused` are the job's `model.attention` and `model.use_fused_kernels`;
    `pg_collection` the model's own process groups (`mrl.models.megatron.build_gpt`).
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    valued = role in ("critic", "reward")
    cfg = dict(hf, tie_word_embeddings=False) if valued else hf
    config = transformer_config(cfg, dtype=dtype, parallel=parallel, device=device, recompute=recompute,
                                attention=attention, fused=fused, **config_overrides)
    model = build_gpt(cfg, config, vp_stage=vp_stage, vocab_multiple=vocab_multiple, attention=attention,
                      pg_collection=pg_collection)
    if valued and model.post_process:
        model.output_layer = ValueHead(config)
    if role == "ref":
        freeze(model)
    if device == "cuda":
        model = model.cuda(torch.cuda.current_device())
    return model


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """Eval mode and no gradients: a reference model holds no optimizer state."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, *, tp_rank: int = 0) -> torch.Tensor:
    """Logits with Megatron's vocabulary padding set to -inf, so padding rows (zeros after an HF
    import) take no probability mass. `logits` is this TP rank's slice `[..., V_pad/tp]`."""
    width = logits.shape[-1]
    start = tp_rank * width
    if start + width <= vocab_size:
        return logits
    keep = max(vocab_size - start, 0)
    masked = logits.clone()
    masked[..., keep:] = float("-inf")
    return masked


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int, temperature: float = 1.0,
                   tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of `labels`, entropy) per position from vocab-parallel `logits [..., V_pad/tp]`.

    The fused kernels do the work (their torch twins on cpu); the padded vocabulary is masked.
    Label -100 gives log-prob 0.
    """
    import mrl_kernels

    tp_rank = torch.distributed.get_rank(tp_group) if tp_group is not None else 0
    logits = mask_padded_vocab(logits, vocab_size, tp_rank=tp_rank)
    return mrl_kernels.logprob_entropy(logits, labels, temperature, group=tp_group)


def last_token_values(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The value at each row's last real token: `values [B, S(, 1)]`, `attention_mask [B, S]`
    (1 = token; padding on either side) -> `[B]`. A reward model's score."""
    if values.dim() == 3:
        values = values.squeeze(-1)
    mask = attention_mask.bool()
    if not mask.any(dim=1).all():
        raise ValueError("last_token_values: a row has no tokens")
    last = mask.shape[1] - 1 - mask.flip(1).long().argmax(dim=1)
    return values.gather(1, last.unsqueeze(1)).squeeze(1)


def padded_vocab(hf: dict[str, Any], tensor_parallel: int, multiple: int = 128) -> int:
    return padded_vocab_size(hf["vocab_size"], tensor_parallel, multiple)
