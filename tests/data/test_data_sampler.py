"""The prompt sampler: sharding, determinism, reshuffles, and resume mid-epoch and at epoch boundaries."""
import pytest

from mrl.data.sampler import PromptSampler
from mrl.errors import UserError


def take(sampler, steps):
    return [sampler.next() for _ in range(steps)]


def test_epochs_cover_every_prompt_and_reshuffle():
    s = PromptSampler(10, 5, seed=7)
    assert s.steps_per_epoch == 2
    e0, e1 = take(s, 2), take(s, 2)
    first = [i for b in e0 for i in b.indices]
    second = [i for b in e1 for i in b.indices]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second  # each epoch reshuffles
    assert [(b.epoch, b.step_in_epoch) for b in e0 + e1] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    again = PromptSampler(10, 5, seed=7)
    assert [b.indices for b in take(again, 4)] == [b.indices for b in e0 + e1]  # deterministic
    other = PromptSampler(10, 5, seed=8)
    assert [b.indices for b in take(other, 2)] != [b.indices for b in e0]
    assert [b.indices for b in take(PromptSampler(10, 5, shuffle=False), 2)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_partial_last_batch_is_skipped():
    s = PromptSampler(11, 5, seed=0)
    assert s.steps_per_epoch == 2
    assert [len(b.indices) for b in take(s, 3)] == [5, 5, 5] and s.epoch == 1


def test_ranks_split_the_global_batch():
    ranks = [PromptSampler(12, 6, dp_rank=r, dp_size=3, seed=1) for r in range(3)]
    single = PromptSampler(12, 6, seed=1)
    for _ in range(4):
        parts = [r.next().indices for r in ranks]
        assert all(len(p) == 2 for p in parts)
        assert sum(parts, []) == single.next().indices


@pytest.mark.parametrize("stop", [1, 3, 4, 8])  # mid-epoch (1, 3) and exactly at an epoch boundary (4, 8)
def test_resume_continues_with_the_right_prompts(stop):
    straight = PromptSampler(8, 2, seed=5)
    expected = take(straight, 12)
    before = PromptSampler(8, 2, seed=5)
    take(before, stop)
    state = before.state_dict()
    resumed = PromptSampler(8, 2, seed=5)
    resumed.load_state_dict(state)
    got = take(resumed, 12 - stop)
    assert [(b.epoch, b.step_in_epoch, b.indices) for b in got] == \
           [(b.epoch, b.step_in_epoch, b.indices) for b in expected[stop:]]
    assert got, "a resume must produce batches"


def test_resume_at_boundary_from_unnormalized_state():
    """A state saved as (epoch e, step == steps_per_epoch) continues with epoch e + 1, not nothing."""
    s = PromptSampler(8, 2, seed=5)
    state = {**s.state_dict(), "epoch": 1, "step_in_epoch": 4}
    s.load_state_dict(state)
    assert (s.epoch, s.step_in_epoch) == (2, 0)
    assert s.next().indices == PromptSampler(8, 2, seed=5).global_batch(2, 0)


def test_resume_on_another_dp_size_keeps_the_global_order():
    one = PromptSampler(12, 4, seed=2)
    take(one, 2)
    halves = [PromptSampler(12, 4, dp_rank=r, dp_size=2, seed=2) for r in range(2)]
    for h in halves:
        h.load_state_dict(one.state_dict())
    assert halves[0].next().indices + halves[1].next().indices == one.next().indices


def test_resume_refuses_a_changed_dataset():
    s = PromptSampler(8, 2, seed=5)
    with pytest.raises(UserError, match="num_prompts was 9 when saved, is 8 now"):
        s.load_state_dict({**s.state_dict(), "num_prompts": 9})
    with pytest.raises(UserError, match="does not split over 3 data-parallel ranks"):
        PromptSampler(8, 2, dp_size=3)
    with pytest.raises(UserError, match="fewer than data.prompts_per_step 16"):
        PromptSampler(8, 16)
