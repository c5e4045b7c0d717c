"""Partial rollouts (`rollout.partial_rollout_tokens`), stage by stage with small fakes (no model,
no process group), and end to end under torchrun (slow tier)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mrl.config.loader import load
from mrl.rollout.types import Response

QUICKSTART = "jobs/quickstart_cpu.toml"


class LengthEngine:
    """Response j of a prompt whose last token is L stops after L tokens in total (L = 1..9); a
    continuation (prompt + tokens so far) carries on where it left off. Token ids count up."""

    def __init__(self, prompt_len: int):
        self.prompt_len, self.calls = prompt_len, []

    def generate(self, prompt_ids, sampling):
        self.calls.append((len(prompt_ids), sampling.max_tokens))
        out = []
        for i, ids in enumerate(prompt_ids):
            total = ids[self.prompt_len - 1]        # the prompt's own length target
            done = len(ids) - self.prompt_len
            new = min(sampling.max_tokens, total - done)
            out.append(Response(prompt_index=i, token_ids=list(range(done, done + new)), logprobs=[-0.5] * new,
                                finish_reason="stop" if done + new >= total else "length"))
        return out


class Rewarder:
    def score(self, samples):
        from mrl.reward.compose import RewardResult

        n = len(samples)
        return RewardResult(scores=[float(len(s.token_ids) % 2) for s in samples], valid=[True] * n,
                            source_scores={}, metrics={}, errors=[], stats={"reward/mean": 0.5})


def _parts(lengths, k=1, chunk=2, per_step=2, gen_batch=3):
    from mrl.data.sampler import PromptSampler
    from mrl.train.parts import Generation, Prompts

    spec, _ = load(QUICKSTART, [f"rollout.partial_rollout_tokens={chunk}", f"rollout.max_staleness={k}",
                                f"data.prompts_per_step={per_step}", "rollout.responses_per_prompt=2",
                                f"algorithm.dynamic_sampling.generation_batch_prompts={gen_batch}",
                                "rollout.max_response_tokens=9", "actor.mini_batch_prompts=1"])
    items = [SimpleNamespace(index=i, token_ids=(7, 7, L), prompt="p", answer="a", data_source="t", extra={})
             for i, L in enumerate(lengths)]
    from mrl.train.plan import step_plan

    run = SimpleNamespace(spec=spec, plan=step_plan(spec), dp=1, separate=False, tokenizer=SimpleNamespace(decode=lambda ids, **kw: "r"),
                          ctx=SimpleNamespace(role="train", is_main=True))
    gen = Generation(generator=LengthEngine(prompt_len=3), rewarder=Rewarder())
    sampler = PromptSampler(len(items), gen_batch, seed=0, shuffle=False)
    return run, gen, Prompts(dataset=items, samplers={0: sampler})


def test_the_first_groups_to_finish_make_the_batch_and_the_rest_carry_over():
    from mrl.train.produce import produce as produce_partial

    # prompts ask for 2, 8, 3 | 9, 2, 2 tokens: chunks of 2
    run, gen, prompts = _parts([2, 8, 3, 9, 2, 2])
    gen.version = 0
    r1 = produce_partial(run, gen, prompts, 1, agree_min=lambda x: x)
    s1 = r1.shards[0]
    assert [it.index for it in s1.items] == [0, 2]            # 2 and 3 tokens finish first
    assert [len(x.token_ids) for x in s1.responses] == [2, 2, 3, 3]
    assert s1.stats["rollout/partial_tokens_carried"] == 0
    assert s1.stats["rollout/partial_groups_in_flight"] == 1  # the 8-token prompt, 4 tokens in
    assert all(x.policy_version == 0 for x in s1.responses)

    gen.version = 1
    r2 = produce_partial(run, gen, prompts, 2, agree_min=lambda x: x)
    s2 = r2.shards[0]
    # a new batch of 3 prompts (9, 2, 2) joins; the two 2-token ones finish in the first round
    assert [it.index for it in s2.items] == [4, 5]
    assert s2.stats["rollout/partial_groups_in_flight"] == 2
    gen.version = 2
    s3 = produce_partial(run, gen, prompts, 3, agree_min=lambda x: x).shards[0]
    # the 8-token prompt began at version 0 and is 6 tokens in: lag 2 > max_staleness 1 at step 3,
    # dropped and counted
    assert s3.stats["rollout/stale_dropped_responses"] == 2 and s3.stats["rollout/stale_dropped_tokens"] == 2 * 6
    assert 1 not in [it.index for it in s3.items]


def test_carried_tokens_are_counted_and_their_versions_kept():
    from mrl.train.produce import produce as produce_partial
    from mrl.train.step import staleness

    run, gen, prompts = _parts([2, 4, 2, 2, 2, 2], k=1)
    gen.version = 0
    produce_partial(run, gen, prompts, 1, agree_min=lambda x: x)   # takes 0 and 2; 1 is 2 tokens in
    gen.version = 1
    s2 = produce_partial(run, gen, prompts, 2, agree_min=lambda x: x).shards[0]
    assert [it.index for it in s2.items][0] == 1                   # the carried group finishes first
    assert s2.stats["rollout/partial_tokens_carried"] == 2 * 2     # 2 responses x 2 tokens of step 1
    versions = [x.policy_version for x in s2.responses]
    assert versions[:2] == [0, 0] and set(versions[2:]) == {1}
    assert staleness(versions, 2, 1) == {"rollout/version_lag_mean": 0.5, "rollout/version_lag_max": 1.0}
    with pytest.raises(RuntimeError, match="outside"):
        staleness(versions, 3, 1)


def test_the_groups_in_hand_round_trip_through_a_checkpoint():
    from mrl.train.carry import decode_carry, encode_carry
    from mrl.train.produce import produce as produce_partial

    run, gen, prompts = _parts([2, 8, 3, 9, 2, 2])
    produce_partial(run, gen, prompts, 1, agree_min=lambda x: x)
    encoded = encode_carry(prompts.carry)
    # plain values only: a checkpoint's extra is read with weights_only=True
    buf = __import__("io").BytesIO()
    torch.save(encoded, buf)
    buf.seek(0)
    back = decode_carry(torch.load(buf, weights_only=True), prompts.dataset)
    assert encode_carry(back) == encoded and back[0].active[0].item.index == 1


def test_every_shards_groups_in_hand_are_saved_and_each_rank_restores_its_own():
    """DP 2, each rank holding its own shard's groups and sampler position (shard 1 drew one batch
    more): the merged checkpoint holds both; rank 1 restores shard 1's groups at shard 1's
    position (not rank 0's), rank 0 shard 0's; a run of another data-parallel size is refused
    in one line while groups are in hand."""
    from mrl.data.sampler import PromptSampler
    from mrl.errors import UserError
    from mrl.train.carry import encode_carry, merge_carries, restore_shards
    from mrl.train.groups import GroupInProgress, ShardCarry
    from mrl.train.parts import Prompts

    items = [SimpleNamespace(index=i) for i in range(16)]

    def prompts(rank, dp=2):
        return Prompts(dataset=items, samplers={rank: PromptSampler(16, 4, dp_rank=rank, dp_size=dp, seed=0)})

    ranks = [prompts(0), prompts(1)]
    for p in ranks:
        p.samplers[p.shards[0]].next()
    ranks[1].samplers[1].next()
    ranks[0].carry = {0: ShardCarry(active=[GroupInProgress.new(items[3], 2, 0)])}
    ranks[1].carry = {1: ShardCarry(ready=[GroupInProgress.new(items[5], 2, 0)])}
    merged = merge_carries([encode_carry(p.carry, {d: s.state_dict() for d, s in p.samplers.items()}) for p in ranks])
    assert sorted(merged) == ["0", "1"] and merged["1"]["position"]["step_in_epoch"] == 2
    assert merge_carries([{"0": "first"}, {"0": "copy", "1": "own"}]) == {"0": "first", "1": "own"}
    position = ranks[0].position   # the run's (rank 0's): step 1
    again = [prompts(0), prompts(1)]
    assert restore_shards(again[1], position, merged).startswith("1 groups in hand restored")
    assert list(again[1].carry) == [1] and again[1].carry[1].ready[0].item.index == 5
    assert again[1].samplers[1].step_in_epoch == 2
    restore_shards(again[0], position, merged)
    assert again[0].carry[0].active[0].item.index == 3 and again[0].samplers[0].step_in_epoch == 1
    with pytest.raises(UserError, match="of 2 data-parallel shards, this run has 1"):
        restore_shards(prompts(0, dp=1), position, merged)


@pytest.mark.parametrize("patch,key,fragment", [
    (["rollout.max_staleness=0"], "rollout.max_staleness", "lag at least one version"),
    (["rollout.partial_rollout_tokens=9"], "rollout.partial_rollout_tokens", "every response would finish"),
])
def test_partial_rollouts_refuse_what_they_cannot_do(patch, key, fragment):
    """`mrl validate` (the loader's checks) and `mrl train` (the same `partial_problems`) refuse."""
    from mrl.errors import SpecError

    with pytest.raises(SpecError) as e:
        load(QUICKSTART, ["rollout.partial_rollout_tokens=2", "rollout.max_staleness=1", "rollout.max_response_tokens=9",
                          "algorithm.dynamic_sampling.generation_batch_prompts=8", *patch])
    assert any(f"{key}: " in p and fragment in p for p in e.value.problems), e.value.problems


@pytest.mark.slow
def test_partial_rollouts_train_and_resume_exactly(tmp_path):
    """Colocated on 2 ranks with over-sampling (12 prompts in flight for 8 trained): tokens are
    carried over, lags stay within max_staleness 1, and a run stopped at step 2 and resumed equals
    the uninterrupted run (the groups in hand are in the checkpoint)."""
    from tests.dist_util import run_torchrun
    from tests.train.test_train_bf16 import _history

    args = ["rollout.partial_rollout_tokens=3", "rollout.max_staleness=1",
            "algorithm.dynamic_sampling.generation_batch_prompts=12", "checkpoint.every_steps=2", "job.name=run",
            "tracking.backends=[\"mlflow\"]"]

    def train(out, steps):
        run_torchrun("-m mrl train", QUICKSTART, f"job.output_dir={out}", f"trainer.total_steps={steps}", *args,
                     timeout=600)

    train(tmp_path / "whole", 4)
    train(tmp_path / "resumed", 2)
    train(tmp_path / "resumed", 4)
    whole, again = _history(tmp_path / "whole"), _history(tmp_path / "resumed")
    # a step that only trains groups finished earlier scores nothing: reward-pool keys skip it
    keys = [k for k in whole if not k.startswith(("time/", "throughput/", "memory/"))]
    assert keys and all(again.get(k) == whole[k] for k in keys), [k for k in keys if again.get(k) != whole[k]]
    assert sorted(whole["reward/mean"]) == [1, 2, 3, 4]
    assert sum(whole["rollout/partial_tokens_carried"].values()) > 0
    assert max(whole["rollout/version_lag_max"].values()) == 1.0


class RoundEngine:
    """Whole or chunked: the responses to a prompt whose last token is L are L tokens long; with
    `sampling.n` > 1 each prompt gets n of them (whole generation)."""

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len

    def generate(self, prompt_ids, sampling):
        out = []
        for i, ids in enumerate(prompt_ids):
            total, done = ids[self.prompt_len - 1], len(ids) - self.prompt_len
            new = min(sampling.max_tokens, total - done)
            out += [Response(prompt_index=i, token_ids=list(range(done, done + new)), logprobs=[-0.5] * new,
                             finish_reason="stop" if done + new >= total else "length") for _ in range(sampling.n)]
        return out


class IndexRewarder:
    """Even prompts score [i + 1, 0] (kept by dynamic sampling), odd ones [i, i] (dropped);
    `reward/mean` is the mean of the call's scores, so the step's weighted mean differs from its
    last call's."""

    def score(self, samples):
        from mrl.reward.compose import RewardResult

        scores = []
        for s in samples:
            prompt, j = int(s.sample_id.split()[3]), int(s.sample_id.split()[5])
            scores.append(float(prompt + 1) * (j == 0) if prompt % 2 == 0 else float(prompt))
        n = len(samples)
        return RewardResult(scores=scores, valid=[True] * n, source_scores={}, metrics={}, errors=[],
                            stats={"reward/mean": sum(scores) / n, "reward/errors": 0.0})


def test_reward_metrics_are_the_same_with_and_without_partial_rollouts():
    """Dynamic sampling over two rounds (each scores 2 groups; one kept per round): whole
    generation and partial rollouts whose groups all finish in their first round keep the same
    groups and report the same response-weighted `reward/mean` (not the last round's)."""
    from mrl.data.sampler import PromptSampler
    from mrl.train.parts import Generation, Prompts
    from mrl.train.plan import step_plan
    from mrl.train.produce import produce

    def shard(partial: bool):
        patch = ["rollout.partial_rollout_tokens=8", "rollout.max_staleness=1"] if partial else []
        spec, _ = load(QUICKSTART, [*patch, "data.prompts_per_step=2", "rollout.responses_per_prompt=2",
                                    "algorithm.dynamic_sampling.enable=true",
                                    "algorithm.dynamic_sampling.generation_batch_prompts=2",
                                    "rollout.max_response_tokens=9", "actor.mini_batch_prompts=1"])
        items = [SimpleNamespace(index=i, token_ids=(7, 7, L), prompt="p", answer="a", data_source="t", extra={})
                 for i, L in enumerate([3, 5, 4, 2, 6, 6])]
        run = SimpleNamespace(spec=spec, plan=step_plan(spec), separate=False,
                              tokenizer=SimpleNamespace(decode=lambda ids, **kw: "r"),
                              ctx=SimpleNamespace(role="train", is_main=True))
        gen = Generation(generator=RoundEngine(prompt_len=3), rewarder=IndexRewarder())
        prompts = Prompts(dataset=items, samplers={0: PromptSampler(len(items), 2, seed=0, shuffle=False)})
        return produce(run, gen, prompts, 1, agree_min=lambda x: x).shards[0]

    whole, partial = shard(False), shard(True)
    assert [it.index for it in whole.items] == [it.index for it in partial.items] == [0, 2]
    assert whole.scores == partial.scores == [1.0, 0.0, 3.0, 0.0]
    assert [x.token_ids for x in whole.responses] == [x.token_ids for x in partial.responses]
    # round 1 scores 1, 0, 1, 1 (mean 0.75), round 2 scores 3, 0, 3, 3 (mean 2.25): 8 responses, mean 1.5
    for s in (whole, partial):
        assert s.stats["reward/mean"] == 1.5 and s.stats["rollout/generation_rounds"] == 2
        assert s.stats["reward/errors"] == 0.0
    assert {k: v for k, v in whole.stats.items() if k.startswith("reward/")} == \
        {k: v for k, v in partial.stats.items() if k.startswith("reward/")}


class RouteEngine(LengthEngine):
    """`LengthEngine` whose responses carry MoE routes: token position x 10 + the call's number
    (a continuation's routes cover the prompt and every token so far, as the hf engine's do)."""

    def generate(self, prompt_ids, sampling):
        out = super().generate(prompt_ids, sampling)
        call = len(self.calls)
        for ids, r in zip(prompt_ids, out):
            r.routes = (torch.arange(len(ids) + len(r.token_ids)) * 10 + call).to(torch.int16).view(-1, 1, 1)
        return out


def test_partial_rollouts_keep_the_routes_of_each_responses_latest_call():
    import io

    from mrl.train.carry import decode_carry, encode_carry
    from mrl.train.produce import produce as produce_partial

    run, gen, prompts = _parts([2, 8, 3, 9, 2, 2])
    gen.generator = RouteEngine(prompt_len=3)
    gen.version = 0
    s1 = produce_partial(run, gen, prompts, 1, agree_min=lambda x: x).shards[0]
    for x in s1.responses:
        assert x.routes.shape == (3 + len(x.token_ids), 1, 1)
        assert torch.equal(x.routes.view(-1) // 10, torch.arange(3 + len(x.token_ids)))
    assert {int(x.routes.view(-1)[0] % 10) for x in s1.responses[2:]} == {2}   # 3 tokens: two calls of 2
    buf = io.BytesIO()
    torch.save(encode_carry(prompts.carry), buf)
    buf.seek(0)
    back = decode_carry(torch.load(buf, weights_only=True), prompts.dataset)
    carried = back[0].active[0]
    assert carried.item.index == 1 and all(torch.equal(a, b) for a, b in zip(carried.routes, prompts.carry[0].active[0].routes))
    assert carried.routes[0].shape[0] == 3 + len(carried.tokens[0])
