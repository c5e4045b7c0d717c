"""Fixtures: a saved tiny HF model per architecture with its `transformers` reference outputs."""
from __future__ import annotations

import pytest
import torch

from tests.weights.archs import ARCHS, make_hf_model, probe_tokens


def reference_outputs(model, tokens: torch.Tensor) -> dict:
    with torch.no_grad():
        logits = model(tokens).logits.float()
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)
    labels = tokens[:, 1:]
    out = dict(tokens=tokens, logits=logits,
               logprobs=logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1),
               entropy=-(logp_all.exp() * logp_all).sum(-1))
    norms = {n: p for n, p in model.named_parameters() if n.endswith("linear_attn.norm.weight")}
    if norms:   # Gated DeltaNet hybrids: the gradient of the summed log-probs on each gated norm
        logp = torch.log_softmax(model(tokens).logits.float()[:, :-1], -1).gather(-1, labels.unsqueeze(-1)).sum()
        grads = torch.autograd.grad(logp, list(norms.values()))
        out["norm_grads"] = {n: g.detach() for n, g in zip(norms, grads)}
    return out


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """arch -> directory holding config.json, model.safetensors and reference.pt."""
    made: dict = {}

    def get(arch: str):
        if arch not in made:
            d = tmp_path_factory.mktemp(f"hf_{arch}")
            model = make_hf_model(arch, d)
            torch.save(reference_outputs(model, probe_tokens(model.config.vocab_size)), d / "reference.pt")
            made[arch] = d
        return made[arch]

    return get


ALL_ARCHS = sorted(ARCHS)
