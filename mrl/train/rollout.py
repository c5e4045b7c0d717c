"""The generation stage the producer (`mrl.train.produce`) and evaluation run: responses from the
rollout engine within `rollout.generate_timeout_s`, whole (`generate`) or C tokens a round
(`advance`, partial rollouts: `rollout.partial_rollout_tokens`). Reward scoring is
`mrl.train.scoring`'s; the colocated engine's weights and sleep are `mrl.train.engine_sync`'s and
`mrl.train.colocated`'s.

Generation runs on the group leader (the model-parallel group's first rank, or the engine
group's); the responses are broadcast to the group (`mrl.platform.collectives.from_leader`) so
every rank of it agrees.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch

from mrl.errors import UserError
from mrl.platform.collectives import from_leader
from mrl.rollout.types import Response, Sampling, sampling_from_config
from mrl.train.groups import GroupInProgress
from mrl.train.parts import Generation, Run


def generate(run: Run, gen: Generation, prompt_ids: list[list[int]], sampling: Sampling,
             dp_rank: Optional[int] = None, images: Optional[list] = None) -> list[Response]:
    """Responses to `prompt_ids` (prompt-major, `sampling.n` each), equal on the leader's group.
    Colocated vllm: collective over the world, `dp_rank` naming whose prompts these are.
    `images[i]`: prompt i's `ImageInputs` (vision-language models), passed to the engine with its prompt."""
    timeout = run.spec.rollout.generate_timeout_s
    extra = {"images": list(images)} if images is not None and any(x is not None for x in images) else {}
    if gen.groups is not None and not run.separate:
        from mrl.train.engine_groups import generate_on_groups

        dp = run.ctx.dp_rank if dp_rank is None else dp_rank
        return generate_within(lambda: generate_on_groups(gen.generator, gen.groups, dp, run.dp, prompt_ids, sampling,
                                                          **extra), timeout, len(prompt_ids), sampling.n)
    if gen.groups is not None:   # separate vllm: every rank of the engine group generates together
        return generate_within(lambda: gen.generator.generate(prompt_ids, sampling, **extra), timeout, len(prompt_ids),
                               sampling.n)
    out = (generate_within(lambda: gen.generator.generate(prompt_ids, sampling, **extra), timeout, len(prompt_ids),
                           sampling.n) if gen.is_leader else None)
    return from_leader(out, gen.mp_group, gen.is_leader, "rollout generation")


def generate_within(call, timeout_s: float, prompts: int, n: int):
    """`call()` (a generate call), or a `UserError` once it has run `timeout_s` seconds
    (`rollout.generate_timeout_s`). It runs in a daemon thread carrying this thread's grad mode and
    CUDA device, so a generation that never returns cannot hold the process past the error."""
    import threading

    box: dict[str, Any] = {}
    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run():
        try:
            if device is not None:
                torch.cuda.set_device(device)
            with torch.set_grad_enabled(grad):
                box["out"] = call()
        except BaseException as e:   # re-raised in the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, name="mrl-generate", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise UserError(f"rollout: generating {prompts} prompts x {n} responses ran longer than "
                        f"rollout.generate_timeout_s = {timeout_s:g} s; raise it or lower rollout.max_response_tokens")
    if "error" in box:
        raise box["error"]
    return box["out"]


def advance(run, gen, active: list[GroupInProgress], chunk: int, seed: int, dp_rank: int, st: dict) -> None:
    """Advance every unfinished response of `active` by at most `chunk` tokens: one generate call
    per distinct budget (`chunk`, or what is left of `rollout.max_response_tokens`)."""
    roll = run.spec.rollout
    limit = roll.max_response_tokens
    work = [(g, j) for g in active for j in range(len(g.finish)) if g.finish[j] is None]
    by_budget: dict[int, list] = {}
    for g, j in work:
        by_budget.setdefault(min(chunk, limit - len(g.tokens[j])), []).append((g, j))
    base = sampling_from_config(roll, seed=seed)
    for budget in sorted(by_budget):
        todo = by_budget[budget]
        sampling = replace(base, n=1, max_tokens=budget, seed=(seed * 7919 + budget) % 2**31)
        out = generate(run, gen, [list(g.item.token_ids) + g.tokens[j] for g, j in todo], sampling, dp_rank=dp_rank,
                       images=[getattr(g.item, "images", None) for g, _ in todo])   # a carried response keeps them
        for (g, j), r in zip(todo, out):
            g.tokens[j] += r.token_ids
            g.logprobs[j] += r.logprobs
            if g.routes:   # the call fed prompt + every token so far: its routes cover them all
                g.routes[j] = r.routes
            st["generated"] += 1
            st["tokens"] += len(r.token_ids)
            if r.finish_reason == "stop":
                g.finish[j] = "stop"
            elif len(g.tokens[j]) >= limit:
                g.finish[j] = "length"
