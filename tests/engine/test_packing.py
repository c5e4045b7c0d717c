"""Token-balanced micro-batch planning, packing layout, and the Batch container."""
import pytest
import torch

from mrl.batch import Batch
from mrl.engine import pack, plan
from mrl.errors import UserError


def test_plan_fits_budget_uses_fewest_micro_batches_and_balances():
    lengths = [9, 7, 6, 5, 4, 3, 2, 2]  # 38 tokens
    bins = plan(lengths, 20)
    assert len(bins) == 2 and sorted(i for b in bins for i in b) == list(range(8))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert max(loads) <= 20 and max(loads) - min(loads) <= 2
    tight = plan(lengths, 10)
    assert 4 <= len(tight) <= 5 and all(sum(lengths[i] for i in b) <= 10 for b in tight)
    assert len(plan(lengths, 1000, min_micro_batches=3)) == 3
    assert len(plan([5, 5], 1000, min_micro_batches=4)) == 2  # never more than sequences


def test_plan_refuses_a_sequence_longer_than_the_budget():
    with pytest.raises(UserError, match=r"actor.micro_batch_tokens = 8 .*\(9 tokens"):
        plan([3, 9], 8, budget_name="actor.micro_batch_tokens")


def _batch():
    return Batch.from_sequences([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]], loss_masks=[[1, 1], [1, 0, 1]])


def test_pack_concatenates_sequences_with_thd_boundaries_and_positions():
    b = _batch()
    mb = pack(b, [0, 1], pad_to_multiple=4)
    assert mb.tokens.tolist() == [[1, 2, 3, 6, 7, 4, 5, 8, 9, 10, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]]
    # response token t of a sequence is predicted at the position before it
    assert mb.response_positions.tolist() == [2, 3, 6, 7, 8]
    assert mb.response_labels.tolist() == [6, 7, 8, 9, 10]
    # sequence boundaries for the attention backends; the row padding is a sequence of its own
    psp = mb.packed_seq_params
    assert psp.qkv_format == "thd" and psp.cu_seqlens_q.tolist() == [0, 5, 10, 12] and psp.max_seqlen_q == 5
    assert not hasattr(mb, "attention_mask")  # no [T, T] mask exists on any path
    assert mb.sequence_tokens == 10 and mb.loss_tokens == 4
    flat = torch.arange(5, dtype=torch.float32) + 1
    assert mb.to_padded(flat).tolist() == [[1, 2, 0], [3, 4, 5]]


def test_batch_cuts_keep_prompts_whole():
    b = Batch.from_sequences([[1]] * 6, [[2]] * 6, group_index=[0, 0, 1, 1, 2, 2])
    b = b.add(rewards=torch.arange(6.0), tags=list("abcdef"))
    minis = b.mini_batches(3, shuffle=True, generator=torch.Generator().manual_seed(0))
    assert sorted(m["rewards"].tolist() for m in minis) == [[0, 1], [2, 3], [4, 5]]
    assert b.dp_shard(1, 3).meta["tags"] == ["c", "d"]
    with pytest.raises(ValueError, match="already has"):
        b.add(rewards=torch.zeros(6))
    with pytest.raises(ValueError, match="do not split"):
        b.mini_batches(2)
