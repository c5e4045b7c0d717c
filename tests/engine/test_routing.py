"""MoE routes (`mrl.engine.routing`, `mrl.train.moe`): layouts, replay hook, metrics, by hand.

The 2-rank replay equivalence (EP1/EP2/TP2/PP2) is `test_engine_dist.py::test_routing_replay_*`."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mrl.batch import Batch
from mrl.engine import packing
from mrl.engine.routing import (ObservingReplay, load_ratio, moe_layer_numbers, pack_row, same_experts, sp_slice,
                                unpack_row)
from mrl.rollout.types import Response, routes_to
from mrl.train.batching import rollout_routes


def token_routes(batch: Batch, layers: int = 2, k: int = 2) -> dict:
    """Routes whose every entry is the token id (layer l, slot j: id + 1000 l + 100 j): where a
    route lands in a row says exactly which token it came with."""
    def of(ids):
        extra = torch.arange(layers)[:, None] * 1000 + torch.arange(k)[None] * 100
        return (ids[..., None, None] + extra).to(torch.int16)
    return {"rollout_prompt_routes": of(batch["prompt_ids"]), "rollout_response_routes": of(batch["response_ids"])}


def small_batch() -> Batch:
    b = Batch.from_sequences([[1, 2, 3], [4], [5, 6]], [[7, 8], [9, 10, 11], [12]], group_index=[0, 1, 2])
    return b.add(**token_routes(b))


def test_moe_layer_numbers_from_megatron_fields():
    assert moe_layer_numbers(4, 1) == [1, 2, 3, 4]
    assert moe_layer_numbers(4, 2) == [1, 3]
    assert moe_layer_numbers(3, [0, 1, 1]) == [2, 3]
    with pytest.raises(ValueError):
        moe_layer_numbers(3, [1, 1])


def test_routes_follow_the_tokens_through_packing_and_the_micro_batch_split():
    batch = small_batch()
    for index in ([0, 2], [1], [2, 0, 1]):
        mb = packing.pack(batch, index, pad_to_multiple=4)
        row = mb.routes["rollout"]
        used = mb.sequence_tokens
        assert row.shape == (mb.row_tokens, 2, 2)
        assert torch.equal(row[:used, 0, 0].long(), mb.tokens[0, :used])   # the route sits on its token
        assert torch.equal(row[:used, 1, 1].long(), mb.tokens[0, :used] + 1100)
        assert (row[used:] == -1).all()                                     # the row's padding: unknown
    # mini-batches and DP shards select the route fields with their responses
    for mini in batch.mini_batches(3):
        mb = packing.pack(mini, range(len(mini)))
        assert torch.equal(mb.routes["rollout"][:mb.sequence_tokens, 0, 0].long(), mb.tokens[0, :mb.sequence_tokens])


def test_routes_follow_the_tokens_onto_context_parallel_ranks():
    """Under CP2 each rank's routes are those of its chunks: on every real token its own route,
    -1 on the padding of each sequence (2N chunks) and of the row."""
    batch = small_batch()
    for rank in range(2):
        mb = packing.pack(batch, [0, 1, 2], cp_size=2, cp_rank=rank)
        row = mb.routes["rollout"]
        assert row.shape == (mb.row_tokens, 2, 2)
        assert torch.equal(row[mb.real, 0, 0].long(), mb.tokens[0, mb.real])
        assert torch.equal(row[mb.real, 1, 1].long(), mb.tokens[0, mb.real] + 1100)
        assert (row[~mb.real] == -1).all() and (~mb.real).any()


def test_unpack_row_inverts_pack_row():
    batch = small_batch()
    p_lens, r_lens = batch.prompt_lengths.tolist(), batch["response_lengths"].tolist()
    row = pack_row(batch["rollout_prompt_routes"], batch["rollout_response_routes"], p_lens, r_lens, 20)
    prompt, response = unpack_row(row, p_lens, r_lens, batch["prompt_ids"].shape[1], batch.response_width)
    pm, rm = batch["prompt_mask"] > 0, torch.arange(batch.response_width)[None] < batch["response_lengths"][:, None]
    assert torch.equal(prompt[pm], batch["rollout_prompt_routes"][pm]) and (prompt[~pm] == -1).all()
    assert torch.equal(response[rm], batch["rollout_response_routes"][rm]) and (response[~rm] == -1).all()
    with pytest.raises(ValueError):
        pack_row(batch["rollout_prompt_routes"], batch["rollout_response_routes"], p_lens, r_lens, 5)


def test_sp_slice_is_the_ranks_contiguous_chunk():
    row = torch.arange(8)[:, None, None]
    assert sp_slice(row, 1, 2).flatten().tolist() == [4, 5, 6, 7]
    assert sp_slice(row, 0, 1).shape[0] == 8
    with pytest.raises(ValueError):
        sp_slice(torch.zeros(7, 1, 1), 0, 2)


def test_same_experts_ignores_order_inside_the_top_k():
    a = torch.tensor([[1, 3], [0, 2], [1, 2]])
    b = torch.tensor([[3, 1], [0, 3], [1, 2]])
    assert same_experts(a, b).tolist() == [True, False, True]


def test_load_ratio_by_hand():
    assert load_ratio(torch.tensor([[2, 2], [3, 1], [0, 0], [4, 0]])).tolist() == [1.0, 1.5, 1.0, 2.0]


def test_observing_replay_returns_targets_and_keeps_the_routers_own():
    scores = torch.tensor([[0.1, 0.5, 0.3, 0.9], [0.8, 0.1, 0.2, 0.4]])

    def own(s, k, num_groups=None, group_topk=None):
        return torch.topk(s, k, dim=1)

    hook = ObservingReplay()
    probs, idx = hook.get_replay_topk(scores, 2, None, None, own)
    assert idx.tolist() == [[3, 1], [0, 3]] and torch.equal(hook.used, idx)
    hook.target = torch.tensor([[0, 2], [-1, -1]], dtype=torch.int16)   # token 2: unknown, keeps its own
    probs, idx = hook.get_replay_topk(scores, 2, None, None, own)
    assert idx.tolist() == [[0, 2], [0, 3]]
    assert torch.allclose(probs, torch.tensor([[0.1, 0.3], [0.8, 0.4]]))   # the router's scores, gathered
    assert hook.natural.tolist() == [[3, 1], [0, 3]]
    hook.target = torch.zeros(3, 2, dtype=torch.int16)
    with pytest.raises(RuntimeError, match="routes"):
        hook.get_replay_topk(scores, 2, None, None, own)


def test_rollout_routes_lay_responses_out_like_the_batch():
    prompts, resp = [[1, 2, 3], [4]], [[7, 8], [9, 10, 11]]
    batch = Batch.from_sequences(prompts, resp)
    responses = [SimpleNamespace(token_ids=r, routes=torch.tensor(p + r, dtype=torch.int16)[:, None, None])
                 for p, r in zip(prompts, resp)]
    fields = rollout_routes(responses, prompts, batch)
    assert torch.equal(torch.where(batch["prompt_mask"] > 0, fields["rollout_prompt_routes"][..., 0, 0].long(), -1),
                       torch.where(batch["prompt_mask"] > 0, batch["prompt_ids"], -1))
    assert fields["rollout_response_routes"][0, :, 0, 0].tolist() == [7, 8, -1]
    assert rollout_routes([SimpleNamespace(token_ids=[7, 8], routes=None), responses[1]], prompts, batch) == {}
    responses[1].routes = responses[1].routes[:-1]
    with pytest.raises(RuntimeError, match="routes for 3 tokens"):
        rollout_routes(responses, prompts, batch)


def test_routes_to_marks_tokens_no_call_fed_as_unknown():
    r = torch.zeros(3, 2, 2, dtype=torch.int16)
    assert routes_to(None, 5) is None and routes_to(r, 3) is r
    out = routes_to(r, 5)
    assert out.shape == (5, 2, 2) and (out[3:] == -1).all() and (out[:3] == 0).all()
    with pytest.raises(ValueError):
        routes_to(r, 2)


def test_queued_rollouts_keep_their_routes_through_a_checkpoint():
    import io

    from mrl.train.codec import decode_rollout, encode_rollout
    from mrl.train.produce import ShardRollout, StepRollout

    items = [SimpleNamespace(index=0)]
    routes = torch.arange(12, dtype=torch.int16).view(3, 2, 2)
    resp = [Response(prompt_index=0, token_ids=[5, 6], logprobs=[-1.0, -2.0], finish_reason="stop", routes=routes),
            Response(prompt_index=0, token_ids=[7], logprobs=[-1.0], finish_reason="stop")]
    shard = ShardRollout(dp_rank=0, items=items, responses=resp, scores=[1.0, 0.0], stats={}, version=0)
    buf = io.BytesIO()
    torch.save(encode_rollout(StepRollout(step=1, version=0, shards={0: shard}, position={}, produce_s=0.0,
                                          finished_at=0.0)), buf)
    buf.seek(0)
    back = decode_rollout(torch.load(buf, weights_only=True), items).shards[0].responses
    assert torch.equal(back[0].routes, routes) and back[1].routes is None


def test_routing_replay_benchmark_summarises_a_history():
    import importlib.util

    from tests.dist_util import REPO

    spec = importlib.util.spec_from_file_location("routing_replay_bench", REPO / "tools/bench/routing_replay.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    h = {"moe/routing_agreement": {1: 1.0, 2: 0.9}, "moe/routing_agreement_min": {1: 1.0, 2: 0.8},
         "rollout/logprob_abs_diff_mean": {1: 1e-3, 2: 3e-3}, "rollout/logprob_abs_diff_max": {1: 0.1, 2: 0.2},
         "rollout/kl_k3": {1: 0.0, 2: 2e-4}, "reward/mean": {1: 0.1, 2: 0.5}}
    s = bench.summarize(h)
    assert s["agreement_step1"] == 1.0 and s["agreement_mean"] == pytest.approx(0.95) and s["agreement_min"] == 0.8
    assert s["diff_mean"] == pytest.approx(2e-3) and s["diff_max"] == 0.2 and s["reward_last3"] == pytest.approx(0.3)
    text = bench.table([("bfloat16", "r3", s)])
    assert "agree@1" in text.splitlines()[0] and text.splitlines()[2].startswith("bfloat16  r3")


def test_engine_rows_over_all_layers_become_moe_layer_routes():
    """vLLM's routed-experts rows cover every layer and every token it fed (prompt + response - 1);
    mrl keeps the MoE layers, sorts the top-k and marks the unfed last token unknown."""
    from mrl.rollout.hf_routes import from_all_layers, moe_layer_indices

    assert moe_layer_indices({"model_type": "qwen3_moe", "num_hidden_layers": 4, "mlp_only_layers": [1]}) == [0, 2, 3]
    assert moe_layer_indices({"model_type": "qwen2_moe", "num_hidden_layers": 4, "decoder_sparse_step": 2}) == [1, 3]
    assert moe_layer_indices({"model_type": "deepseek_v3", "num_hidden_layers": 4, "first_k_dense_replace": 1}) == [1, 2, 3]
    assert moe_layer_indices({"model_type": "mixtral", "num_hidden_layers": 2}) == [0, 1]
    import numpy as np

    rows = np.array([[[0, 0], [3, 1]], [[0, 0], [2, 0]]], dtype=np.uint8)   # 2 tokens fed, layer 0 dense
    out = from_all_layers(rows, [1], 3)
    assert out.dtype == torch.int16 and out.tolist() == [[[1, 3]], [[0, 2]], [[-1, -1]]]
    with pytest.raises(ValueError):
        from_all_layers(rows, [1], 1)


def test_each_actor_pass_replays_what_the_mode_says():
    from mrl.train.step import actor_pass

    batch = small_batch()
    recorded = batch.add(trainer_prompt_routes=batch["rollout_prompt_routes"],
                         trainer_response_routes=batch["rollout_response_routes"])
    actor = SimpleNamespace(routing=SimpleNamespace(replay_from=None, record=False))
    seen = {}
    for mode, which, b in (("off", "old", batch), ("off", "update", recorded), ("r2", "old", batch),
                           ("r2", "update", batch), ("r2", "update", recorded), ("r3", "old", batch),
                           ("r3", "update", recorded)):
        with actor_pass(actor, mode, which, b):
            seen[(mode, which, "trainer_prompt_routes" in b)] = (actor.routing.replay_from, actor.routing.record)
        assert (actor.routing.replay_from, actor.routing.record) == (None, False)   # reset after the pass
    assert seen == {("off", "old", False): (None, False), ("off", "update", True): (None, False),
                    ("r2", "old", False): (None, True),          # R2 records in the old-log-prob pass
                    ("r2", "update", False): (None, False),      # on-policy: nothing was recorded
                    ("r2", "update", True): ("trainer", False),
                    ("r3", "old", False): ("rollout", False), ("r3", "update", True): ("rollout", False)}
    plain = Batch.from_sequences([[1]], [[2]])
    with pytest.raises(RuntimeError, match="returned no routes"):
        with actor_pass(actor, "r3", "old", plain):
            pass
    with actor_pass(SimpleNamespace(routing=None), "r3", "old", plain):   # a dense actor: nothing to do
        pass


def test_step_metrics_by_hand():
    """moe/* from one rank's counts (on one process the collective is the identity)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from mrl.engine.routing import RouteStats
    from mrl.train.moe import step_metrics

    stats = RouteStats(agree=torch.tensor([9.0, 5.0], dtype=torch.float64),
                       compared=torch.tensor([10.0, 10.0], dtype=torch.float64),
                       load=torch.tensor([[2.0, 2.0, 2.0, 2.0], [4.0, 2.0, 1.0, 1.0]], dtype=torch.float64))
    hooks = SimpleNamespace(first_pass_stats=stats, layers=[1, 2], experts=4, take_train_calls=lambda: 4)
    tracker = get_moe_layer_wise_logging_tracker()
    tracker["load_balancing_loss"] = {"values": torch.tensor([2.0, 2.4])}   # summed over 2 micro-batches x 2 layers
    try:
        m = step_metrics(SimpleNamespace(routing=hooks, device="cpu"))
    finally:
        tracker.pop("load_balancing_loss")
    assert m["moe/routing_agreement"] == pytest.approx(0.7) and m["moe/routing_agreement_min"] == pytest.approx(0.5)
    assert m["moe/expert_load_max_over_mean"] == pytest.approx(1.5) and m["moe/expert_load_max_over_mean_max"] == 2.0
    assert m["moe/router_aux_loss"] == pytest.approx(4.4 / 4)
    assert step_metrics(SimpleNamespace(routing=None)) == {}
