"""Server mode in the producer (`rollout.mode = "server"`), stage by stage with a fake AsyncEngine
(no model, no process group): over-sampled groups fill the batch, the rest are aborted and
carried with their tokens, and continue in the next step; the groups in hand checkpoint as plain values."""
from __future__ import annotations

import io
from types import SimpleNamespace

import torch

from mrl.config.loader import load
from tests.rollout.fake_async import FakeAsyncEngine
from tests.train.test_partial import Rewarder

QUICKSTART = "jobs/quickstart_cpu.toml"


def continuing(prompt):
    """Prompt (7, 7, L) + the tokens so far: the rest of 0, 1, ..., L - 1."""
    return list(range(len(prompt) - 3, prompt[2]))


def _parts(lengths, rate=0.5, extra=(), rewarder=None):
    from mrl.data.sampler import PromptSampler
    from mrl.rollout.agent_loop import AgentRunner, single_turn
    from mrl.rollout.router import Router
    from mrl.rollout.server import ServerRollout
    from mrl.rollout.vllm_async import LoopThread
    from mrl.train.parts import Generation, Prompts
    from mrl.train.plan import step_plan

    spec, _ = load(QUICKSTART, ["rollout.engine=vllm", "rollout.mode=server", f"rollout.over_sample_rate={rate}",
                                f"rollout.max_staleness={int(rate > 0)}", "data.prompts_per_step=2", "rollout.responses_per_prompt=2",
                                "rollout.max_response_tokens=200",
                                "actor.mini_batch_prompts=1", *extra])
    items = [SimpleNamespace(index=i, token_ids=(7, 7, L), prompt="p", answer="a", data_source="t", extra={})
             for i, L in enumerate(lengths)]
    engine = FakeAsyncEngine(continuing, tick=0.002)
    server = ServerRollout([engine], LoopThread(), AgentRunner(Router([engine]), single_turn))
    run = SimpleNamespace(spec=spec, plan=step_plan(spec), dp=1, separate=False,
                          tokenizer=SimpleNamespace(decode=lambda ids, **kw: "r"), ctx=SimpleNamespace(role="train"))
    gen = Generation(engine=server, generator=server, rewarder=rewarder or Rewarder())
    return run, gen, Prompts(dataset=items, samplers={0: PromptSampler(len(items), 2, seed=0, shuffle=False)}), server


def test_over_sampling_fills_the_batch_aborts_the_rest_and_continues_them_next_step():
    from mrl.train.carry import decode_carry, encode_carry
    from mrl.train.produce import produce

    # step 1 draws two batches of 2 prompts (2, 3 | 150, 190 tokens) and submits 3 groups
    # (ceil(2 x 1.5)); the first two finish, the 150-token group is aborted mid-generation and
    # carried, the 190-token one waits unstarted
    run, gen, prompts, server = _parts([2, 3, 150, 190, 100, 190])
    try:
        gen.version = 0
        s1 = produce(run, gen, prompts, 1, agree_min=lambda x: x).shards[0]
        assert [it.index for it in s1.items] == [0, 1]
        assert [x.token_ids for x in s1.responses] == [[0, 1], [0, 1], [0, 1, 2], [0, 1, 2]]
        assert s1.stats["rollout/aborted"] == 2 and s1.stats["rollout/carried"] == 4
        assert 0 < s1.stats["rollout/engine_busy"] <= 1
        g, waiting = prompts.carry[0].active
        assert g.item.index == 2 and g.finish == [None, None]
        assert waiting.item.index == 3 and waiting.tokens == [[], []]
        assert all(t == list(range(len(t))) and len(t) < 150 for t in g.tokens)
        carried = [len(t) for t in g.tokens]

        # the groups in hand survive a checkpoint (plain values, masks and agent state included)
        buf = io.BytesIO()
        torch.save(encode_carry(prompts.carry), buf)
        buf.seek(0)
        back = decode_carry(torch.load(buf, weights_only=True), prompts.dataset)
        assert encode_carry(back) == encode_carry(prompts.carry)

        # step 2: the carried group continues from its tokens (its log-probs kept, its age that of
        # its first token) beside the waiting 190-token group and a new 100-token one; the new one
        # and the carried one finish, the 190-token group is aborted
        gen.version = 1
        s2 = produce(run, gen, prompts, 2, agree_min=lambda x: x).shards[0]
        assert sorted(it.index for it in s2.items) == [2, 4]
        at = [it.index for it in s2.items].index(2)
        first = s2.responses[2 * at:2 * at + 2]
        assert [x.token_ids for x in first] == [list(range(150))] * 2
        assert all(x.logprobs == [-0.25] * 150 and x.loss_mask == [1] * 150 for x in first)
        assert [x.policy_version for x in first] == [0 if c else 1 for c in carried]
        assert s2.stats["rollout/partial_tokens_carried"] == sum(carried)
        assert s2.stats["rollout/aborted"] == 2   # the 190-token group
        assert [g.item.index for g in prompts.carry[0].active] == [3, 5]
    finally:
        server.shutdown()


def test_without_over_sampling_every_drawn_group_runs_to_its_end():
    from mrl.train.produce import produce

    run, gen, prompts, server = _parts([2, 40, 3, 3], rate=0.0)
    try:
        s1 = produce(run, gen, prompts, 1, agree_min=lambda x: x).shards[0]
        assert [it.index for it in s1.items] == [0, 1]
        assert [len(x.token_ids) for x in s1.responses] == [2, 2, 40, 40]
        assert s1.stats["rollout/aborted"] == 0 and s1.stats["rollout/carried"] == 0
        assert prompts.carry[0].active == [] and prompts.carry[0].ready == []
    finally:
        server.shutdown()


def test_groups_waiting_unstarted_are_not_dropped_as_stale():
    """A group drawn beyond the submitted target waits in hand without a token; steps later it is
    as new as the policy that starts it, so max_staleness never drops it untried, while a group
    that began generating under an old policy is dropped."""
    from mrl.train.groups import GroupInProgress, ShardCarry
    from mrl.train.produce import drop_stale, refresh_unstarted

    waiting = GroupInProgress.new(SimpleNamespace(index=0), 2, version=0)
    begun = GroupInProgress.new(SimpleNamespace(index=1), 2, version=0)
    begun.tokens[0] = [5, 6]
    c = ShardCarry(active=[waiting, begun])
    refresh_unstarted(c.active, 3)
    assert waiting.versions == [3, 3] and begun.versions == [0, 3]
    st = {"stale_dropped_responses": 0, "stale_dropped_tokens": 0}
    drop_stale(c, 2, 2, st)
    assert c.active == [waiting] and st == {"stale_dropped_responses": 2, "stale_dropped_tokens": 2}


def test_the_groups_that_finish_first_make_the_batch():
    """Submitted in the order 6, 2, 6 tokens for a batch of 2: the 2-token group finishes first and
    leads the step's batch, whichever 6-token group joins it (both may finish before the abort)."""
    from mrl.train.produce import produce

    run, gen, prompts, server = _parts([6, 2, 6, 9], rate=0.5)
    try:
        s1 = produce(run, gen, prompts, 1, agree_min=lambda x: x).shards[0]
        assert [it.index for it in s1.items][0] == 1 and len(s1.items) == 2
    finally:
        server.shutdown()


class OddRefused:
    """Groups of even prompts score [1, 0] (kept by dynamic sampling), odd ones [1, 1] (refused)."""

    def __init__(self):
        self.calls = []

    def score(self, samples):
        from mrl.reward.compose import RewardResult

        self.calls.append([s.sample_id for s in samples])
        scores = [float(int(s.sample_id.split()[3]) % 2 == 1 or s.sample_id.endswith(" 0")) for s in samples]
        n = len(samples)
        return RewardResult(scores=scores, valid=[True] * n, source_scores={}, metrics={}, errors=[],
                            stats={"reward/mean": sum(scores) / n})


def test_dynamic_sampling_takes_groups_as_they_finish():
    """Need 2 groups, 3 submitted (rate 0.5) of 2, 3, 30 tokens, a 150-token group waiting: the
    3-token group (odd) is refused as it finishes and the waiting group starts at once in its
    place; the 30-token group completes the need and the 150-token group is aborted with tokens.
    One generation round; each group scored once, as it finished."""
    from mrl.train.produce import produce

    rewarder = OddRefused()
    run, gen, prompts, server = _parts([2, 3, 30, 150, 5, 5], extra=["algorithm.dynamic_sampling.enable=true"],
                                       rewarder=rewarder)
    try:
        gen.version = 0
        s1 = produce(run, gen, prompts, 1, agree_min=lambda x: x).shards[0]
        assert [it.index for it in s1.items] == [0, 2]
        assert s1.stats["rollout/dynamic_refused_groups"] == 1 and s1.stats["rollout/generation_rounds"] == 1
        assert s1.stats["rollout/aborted"] == 2 and s1.stats["rollout/carried"] == 2
        assert [[int(x.split()[3]) for x in call] for call in rewarder.calls] == [[0, 0], [1, 1], [2, 2]]
        (late,) = prompts.carry[0].active
        assert late.item.index == 3 and late.finish == [None, None] and 0 < len(late.tokens[0]) < 150
        assert s1.scores == [1.0, 0.0, 1.0, 0.0]
    finally:
        server.shutdown()


def test_the_other_ranks_of_the_group_replay_the_groups_started_in_flight(monkeypatch):
    """A model-parallel group's other ranks get the leader's outcome by broadcast and draw the same
    replacement groups from their own samplers: their step, carry and data position equal the
    leader's (the broadcasts recorded on the leader, replayed on a follower)."""
    import mrl.train.rollout as rollout_mod
    import mrl.train.scoring as scoring_mod
    import mrl.train.server_round as round_mod
    from mrl.train.carry import encode_carry
    from mrl.train.produce import produce

    sent = []

    def record(obj, group, is_leader, work):
        sent.append(obj)
        return obj

    extra = ["algorithm.dynamic_sampling.enable=true"]
    run, gen, prompts, server = _parts([2, 3, 30, 150, 5, 5], extra=extra, rewarder=OddRefused())
    try:
        monkeypatch.setattr(round_mod, "from_leader", record)
        monkeypatch.setattr(rollout_mod, "from_leader", record)
        monkeypatch.setattr(scoring_mod, "from_leader", record)
        lead = produce(run, gen, prompts, 1, agree_min=lambda x: x).shards[0]
    finally:
        server.shutdown()
    replay = iter(sent)
    monkeypatch.setattr(round_mod, "from_leader", lambda obj, group, is_leader, work: next(replay))
    monkeypatch.setattr(rollout_mod, "from_leader", lambda obj, group, is_leader, work: next(replay))
    monkeypatch.setattr(scoring_mod, "from_leader", lambda obj, group, is_leader, work: next(replay))
    run2, gen2, prompts2, server2 = _parts([2, 3, 30, 150, 5, 5], extra=extra)
    server2.shutdown()
    gen2.generator = gen2.engine = gen2.rewarder = None
    gen2.is_leader = False
    follow = produce(run2, gen2, prompts2, 1, agree_min=lambda x: x).shards[0]
    assert next(replay, None) is None
    assert [it.index for it in follow.items] == [it.index for it in lead.items] == [0, 2]
    assert [x.token_ids for x in follow.responses] == [x.token_ids for x in lead.responses]
    assert follow.scores == lead.scores and follow.stats == lead.stats
    assert encode_carry(prompts2.carry) == encode_carry(prompts.carry)
    assert prompts2.position == prompts.position
