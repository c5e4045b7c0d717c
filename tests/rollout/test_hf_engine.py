"""hf engine: seeded determinism, weight updates land, log-probs equal a teacher-forced forward."""
from __future__ import annotations

import math

import pytest
import torch

from mrl.rollout.audit import hf_logits_fn, logprob_audit, teacher_forced_logprobs
from mrl.rollout.hf import HFEngine
from mrl.rollout.types import Sampling

from .conftest import TINY_LLAMA

PROMPTS = [[1, 5, 6, 7, 8], [1, 9], [1, 300, 301]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFEngine.from_pretrained(tiny_model_dir, dtype="float32", seed=0)


def _fingerprint(responses):
    return [(r.prompt_index, r.token_ids, r.finish_reason) for r in responses]


def test_generate_is_deterministic_under_a_seed(engine):
    s = Sampling(n=2, temperature=1.0, max_tokens=12, seed=1234)
    a, b = engine.generate(PROMPTS, s), engine.generate(PROMPTS, s)
    assert _fingerprint(a) == _fingerprint(b)
    assert [r.logprobs for r in a] == [r.logprobs for r in b]
    assert len(a) == 6 and [r.prompt_index for r in a] == [0, 0, 1, 1, 2, 2]
    assert a[0].token_ids != a[1].token_ids  # two samples of one prompt differ
    # per-response seeds: a prompt's responses do not depend on its batch neighbours
    first_two = engine.generate(PROMPTS[:2], s)
    assert _fingerprint(first_two) == _fingerprint(a[:4])
    c = engine.generate(PROMPTS, Sampling(n=2, temperature=1.0, max_tokens=12, seed=99))
    assert _fingerprint(c) != _fingerprint(a)


def test_two_engines_with_the_same_seed_agree(tiny_model_dir):
    s = Sampling(n=2, temperature=0.8, top_p=0.9, max_tokens=8)
    e1 = HFEngine.from_pretrained(tiny_model_dir, seed=7)
    e2 = HFEngine.from_pretrained(tiny_model_dir, seed=7, max_num_seqs=2)  # different batching
    assert _fingerprint(e1.generate(PROMPTS, s)) == _fingerprint(e2.generate(PROMPTS, s))


def test_stop_tokens_and_lengths(engine):
    r = engine.generate([[1, 5]], Sampling(n=1, temperature=0.0, max_tokens=6))[0]
    assert r.finish_reason == "length" and len(r.token_ids) == 6
    first = r.token_ids[0]
    stopped = engine.generate([[1, 5]], Sampling(n=1, temperature=0.0, max_tokens=6, stop_token_ids=(first,)))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"


def test_update_weights_zero_lm_head_gives_uniform_logprobs(tiny_model_dir):
    eng = HFEngine.from_pretrained(tiny_model_dir, seed=0)
    head = eng.model.lm_head.weight
    assert eng.update_weights([("lm_head.weight", torch.zeros_like(head))], partial=True) == 1
    assert head.abs().sum() == 0  # copied into the existing parameter
    for s in (Sampling(n=2, temperature=1.0, max_tokens=5, seed=0),
              Sampling(n=1, temperature=0.7, max_tokens=5, logprobs_mode="raw_logprobs", seed=0)):
        for r in eng.generate(PROMPTS, s):
            assert r.logprobs == pytest.approx([-math.log(TINY_LLAMA["vocab_size"])] * 5, abs=1e-5)


def test_update_weights_from_a_full_stream_reproduces_the_source(tiny_model_dir, tmp_path):
    from .conftest import save_tiny_model

    other_dir = save_tiny_model(tmp_path / "other", seed=1)
    src = HFEngine.from_pretrained(other_dir, seed=3)
    dst = HFEngine.from_pretrained(tiny_model_dir, seed=3)
    s = Sampling(n=2, temperature=1.0, max_tokens=8, seed=5)
    assert _fingerprint(src.generate(PROMPTS, s)) != _fingerprint(dst.generate(PROMPTS, s))
    stream = ((k, v.detach().clone()) for k, v in src.model.state_dict().items())
    dst.update_weights(stream)
    a, b = src.generate(PROMPTS, s), dst.generate(PROMPTS, s)
    assert _fingerprint(a) == _fingerprint(b)
    with pytest.raises(KeyError, match="no_such"):
        dst.update_weights([("model.no_such.weight", torch.zeros(1))])


def test_a_sync_that_loads_nothing_or_misses_a_tensor_fails(tiny_model_dir):
    eng = HFEngine.from_pretrained(tiny_model_dir, seed=0)
    with pytest.raises(RuntimeError, match=r"loaded nothing into \d+ parameter"):
        eng.update_weights([])
    state = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
    del state["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(RuntimeError, match="model.layers.1.mlp.down_proj.weight"):
        eng.update_weights(state.items())


def test_tied_embeddings_are_complete_from_the_embedding_alone(tmp_path):
    from .conftest import TINY_LLAMA, save_tiny_model

    eng = HFEngine.from_pretrained(save_tiny_model(tmp_path / "tied", {**TINY_LLAMA, "tie_word_embeddings": True}))
    embed = eng.model.model.embed_tokens.weight
    assert eng.update_weights([(k, v.detach().clone()) for k, v in eng.model.state_dict().items()
                               if k != "lm_head.weight"]) == len(eng.model.state_dict()) - 1
    assert eng.model.lm_head.weight is embed


def test_prompt_seeds_make_a_prompt_independent_of_its_batch(engine):
    from mrl.rollout.types import prompt_seed

    s = Sampling(n=2, temperature=1.0, max_tokens=8, seed=21)
    whole = engine.generate(PROMPTS, s)
    # the last prompt alone, with the seed it had in the whole call, samples the same responses
    last = len(PROMPTS) - 1
    alone = engine.generate(PROMPTS[last:], s, prompt_seeds=[prompt_seed(21, last)])
    assert [r.token_ids for r in alone] == [r.token_ids for r in whole[2 * last:]]
    for a, w in zip(alone, whole[2 * last:]):   # the batch's padding changes the float sums only
        assert a.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    with pytest.raises(ValueError, match="prompt seeds"):
        engine.generate(PROMPTS, s, prompt_seeds=[1])


@pytest.mark.parametrize("sampling", [
    Sampling(n=2, temperature=1.0, max_tokens=16, seed=11),
    Sampling(n=2, temperature=0.7, top_p=0.8, top_k=50, max_tokens=16, seed=11),
    Sampling(n=1, temperature=0.0, max_tokens=16),
    Sampling(n=2, temperature=0.9, repetition_penalty=1.3, min_p=0.01, max_tokens=16, seed=11),
    Sampling(n=2, temperature=0.7, max_tokens=16, seed=11, logprobs_mode="raw_logprobs"),
], ids=["t1", "topk-topp", "greedy", "penalty-minp", "raw"])
def test_engine_logprobs_match_teacher_forced_forward(engine, sampling):
    responses = engine.generate(PROMPTS, sampling)
    trainer, rollout, mask = teacher_forced_logprobs(hf_logits_fn(engine.model), PROMPTS, responses, sampling)
    audit = logprob_audit(rollout, trainer, mask)
    assert audit["rollout/audit_tokens"] == sum(len(r.token_ids) for r in responses)
    assert audit["rollout/logprob_abs_diff_max"] <= 1e-4, audit
    assert abs(audit["rollout/kl_k3"]) <= 1e-8


def test_builds_from_a_config_dict_and_sleeps():
    eng = HFEngine.from_config(TINY_LLAMA, seed=0)
    eng.sleep(1)
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate([[1, 2]], Sampling())
    eng.wake(["weights"])
    eng.update_weights([("model.norm.weight", torch.ones(TINY_LLAMA["hidden_size"]))], partial=True)
    eng.wake(["kv_cache"])
    assert len(eng.generate([[1, 2]], Sampling(max_tokens=3))[0].token_ids) <= 3


def test_build_engine_from_job_sections(tiny_model_dir):
    from mrl.models.config import ModelConfig
    from mrl.rollout.config import RolloutConfig
    from mrl.rollout.factory import build_engine

    eng = build_engine(RolloutConfig(engine="hf"), ModelConfig(path="builtin:tiny-qwen2", dtype="float32"),
                       seed=0, device="cpu", max_model_len=64)
    assert eng.model.config.model_type == "qwen2" and eng.model.config.vocab_size == 512
    eng = build_engine(RolloutConfig(engine="hf", load_format="auto"), ModelConfig(path=tiny_model_dir, dtype="float32"),
                       seed=0, device="cpu", max_model_len=64)
    ref = HFEngine.from_pretrained(tiny_model_dir)
    assert torch.equal(eng.model.lm_head.weight, ref.model.lm_head.weight)  # loaded from disk


def test_sequence_logprobs_are_the_teacher_forced_forward(engine):
    seqs = [[1, 5, 6, 7, 8], [1, 9, 4]]
    got = engine.sequence_logprobs(seqs)
    for seq, lps in zip(seqs, got):
        ids = torch.tensor([seq])
        logits = engine.model(input_ids=ids).logits[0, :-1].float()
        want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        assert lps == pytest.approx(want.tolist(), abs=1e-6)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "kimi_k2", "glm4_moe", "mixtral"])
def test_moe_checkpoint_stream_fills_the_fused_experts(tmp_path, arch):
    """The weight stream names each expert apart (`experts.3.gate_proj.weight`, Mixtral's `w1`),
    as checkpoints do; transformers holds them fused (`experts.gate_up_proj [E, 2I, H]`). A
    stream of the saved checkpoint makes a randomly initialised engine the saved model."""
    import json

    from safetensors.torch import load_file

    from tests.weights.archs import make_hf_model, probe_tokens

    src = make_hf_model(arch, tmp_path)
    eng = HFEngine.from_config(json.loads((tmp_path / "config.json").read_text()), seed=0)
    tokens = probe_tokens(src.config.vocab_size)
    with torch.no_grad():
        want = src(tokens).logits
        assert not torch.equal(eng.model(tokens).logits, want)
        stream = load_file(tmp_path / "model.safetensors")
        assert any(".experts.0." in k for k in stream)
        assert eng.update_weights(stream.items()) == len(stream)
        assert torch.equal(eng.model(tokens).logits, want)
    with pytest.raises(RuntimeError, match="gate_up_proj"):   # an expert short: the fused tensor is not complete
        eng.update_weights([(k, v) for k, v in stream.items() if "experts" not in k or ".experts.gate_up" in k])


def test_a_kimi_k2_directory_is_served_as_deepseek_v3(tmp_path):
    """A Kimi-K2 checkpoint says model_type kimi_k2 (transformers has no such type; its remote code
    is DeepSeek-V3's): the engine the job builds loads it as transformers' DeepSeek-V3, same logits."""
    from mrl.models.config import ModelConfig
    from mrl.rollout.config import RolloutConfig
    from mrl.rollout.factory import build_engine
    from tests.weights.archs import make_hf_model, probe_tokens

    src = make_hf_model("kimi_k2", tmp_path)
    eng = build_engine(RolloutConfig(engine="hf"), ModelConfig(path=str(tmp_path), dtype="float32"), seed=0,
                       device="cpu", max_model_len=64)
    assert eng.model.config.model_type == "deepseek_v3"
    tokens = probe_tokens(src.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(eng.model(tokens).logits, src(tokens).logits)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "glm4_moe"])
def test_moe_responses_carry_the_experts_the_engine_used(tmp_path, arch):
    """Each response's `routes` ([prompt + response tokens, MoE layers, top-k]) are the routers'
    own choices (DeepSeek-V3: group-limited, bias-corrected), equal to a single forward over the
    whole sequence, for rows of different prompt lengths that stop at different steps."""
    from mrl.rollout.hf_routes import RouteCapture
    from tests.weights.archs import make_hf_model

    model = make_hf_model(arch, tmp_path)
    eng = HFEngine(model, seed=0)
    assert eng.returns_routes
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    out = eng.generate(prompts, Sampling(n=2, max_tokens=7, seed=4, stop_token_ids=tuple(range(0, 250, 5))))
    assert len({len(r.token_ids) for r in out}) > 1   # rows finish at different steps
    moe_layers = sum(1 for _ in RouteCapture(model).routers)
    for i, r in enumerate(out):
        seq = prompts[i // 2] + r.token_ids
        with RouteCapture(model) as cap, torch.no_grad():
            model(input_ids=torch.tensor([seq]))
            want = cap.take(1, len(seq))[0]
        assert r.routes.shape == (len(seq), moe_layers, model.config.num_experts_per_tok)
        assert torch.equal(r.routes, want), i


def test_dense_responses_carry_no_routes(engine):
    assert not engine.returns_routes
    assert all(r.routes is None for r in engine.generate([[1, 2, 3]], Sampling(n=2, max_tokens=3, seed=1)))


def test_a_prompts_responses_share_one_prefill_and_sample_what_they_would_alone(tiny_model_dir):
    """With n responses per prompt the prefill runs each distinct prompt once (the model sees 3
    rows, not 12) and the responses are those of a prefill per row: same tokens, log-probs equal
    up to float summation order."""
    shared = HFEngine.from_pretrained(tiny_model_dir, dtype="float32", seed=0)
    per_row = HFEngine.from_pretrained(tiny_model_dir, dtype="float32", seed=0, share_prefill=False)
    rows = []
    hook = shared.model.register_forward_pre_hook(
        lambda mod, args, kw: rows.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    s = Sampling(n=4, temperature=1.0, max_tokens=10, seed=5)
    a = shared.generate(PROMPTS, s)
    hook.remove()
    b = per_row.generate(PROMPTS, s)
    assert rows[0] == (3, 5) and all(r == (12, 1) for r in rows[1:])
    assert _fingerprint(a) == _fingerprint(b)
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    shared.stage_seconds = {}
    shared.generate(PROMPTS, s)
    assert set(shared.stage_seconds) == {"prefill", "decode", "sampling", "logprobs", "bookkeeping"}
    assert all(v >= 0 for v in shared.stage_seconds.values())


@pytest.mark.parametrize("share", [True, False])
def test_decoding_into_a_cache_allocated_once_samples_what_the_dynamic_cache_does(tiny_model_dir, share):
    """`static_cache` (the default): every decode call gets the same cache whose layers write into
    buffers sized once for the prompt width plus max_tokens (5 + 10) and attend over the positions
    written so far; the responses are the dynamic cache's: same tokens, log-probs equal up to
    float summation order."""
    from transformers.cache_utils import DynamicLayer

    from mrl.rollout.hf_cache import InPlaceLayer

    static = HFEngine.from_pretrained(tiny_model_dir, dtype="float32", seed=0, share_prefill=share)
    dynamic = HFEngine.from_pretrained(tiny_model_dir, dtype="float32", seed=0, share_prefill=share,
                                       static_cache=False)
    calls = {id(e): [] for e in (static, dynamic)}
    for e in (static, dynamic):
        e.model.register_forward_pre_hook(
            lambda mod, args, kw, seen=calls[id(e)]: seen.append((kw.get("past_key_values"),
                                                                  kw["input_ids"].shape)), with_kwargs=True)
    s = Sampling(n=4, temperature=1.0, max_tokens=10, seed=5, ignore_eos=True)
    a = static.generate(PROMPTS, s)
    decoding = [c for c, _ in calls[id(static)][1:]]
    assert len(decoding) == 9 and all(c is decoding[0] for c in decoding)
    layer = decoding[0].layers[0]
    assert type(layer) is InPlaceLayer and layer.capacity == 5 + 10
    assert layer.keys.shape[:3] == (12, TINY_LLAMA["num_key_value_heads"], 5 + 9)   # written: prompt + 9 fed
    assert layer.keys.data_ptr() == layer._keys.data_ptr()   # a view of the buffer, not a copy
    b = dynamic.generate(PROMPTS, s)
    assert all(type(c.layers[0]) is DynamicLayer for c, _ in calls[id(dynamic)][1:])
    assert _fingerprint(a) == _fingerprint(b)
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def test_a_sliding_window_model_keeps_the_dynamic_cache():
    """Sliding-window layers are not plain full attention: `in_place_from_prefill` declines (None)
    and the engine decodes with the dynamic cache, as before."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from mrl.rollout.hf_cache import in_place_from_prefill

    cfg = dict(model_type="mistral", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, sliding_window=4, max_position_embeddings=64)
    engine = HFEngine.from_config(cfg, seed=0)
    out = engine.model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
    assert in_place_from_prefill(out.past_key_values, None, 8) is None
    seen = []
    engine.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("past_key_values")), with_kwargs=True)
    responses = engine.generate([[1, 2, 3, 4, 5, 6]], Sampling(n=2, temperature=1.0, max_tokens=6, seed=1, ignore_eos=True))
    assert [len(r.token_ids) for r in responses] == [6, 6]
    assert all(type(c.layers[0]) is DynamicSlidingWindowLayer for c in seen[1:])


def test_an_in_place_layer_refuses_a_position_past_its_buffers():
    from mrl.rollout.hf_cache import InPlaceLayer

    layer = InPlaceLayer(torch.zeros(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 4)
    k, v = layer.update(torch.full((1, 2, 1, 4), 7.0), torch.full((1, 2, 1, 4), 8.0))
    assert k[0, 0, :, 0].tolist() == [0, 0, 0, 7] and v[0, 1, :, 0].tolist() == [1, 1, 1, 8]
    assert layer.get_seq_length() == 4 and layer.get_mask_sizes(1) == (5, 0)
    with pytest.raises(RuntimeError, match="4 positions cannot take position 5"):
        layer.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))


def test_sample_rows_draws_each_token_as_often_as_its_probability_and_never_a_zero_one():
    """4000 rows of p = (0.5, 0, 0.2, 0.3, 0), each with its own generator: counts within 4 standard
    deviations of 4000 p, the zero tokens never; a row's draw depends on its generator only."""
    from mrl.rollout.logprobs import sample_rows

    p = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0]).repeat(4000, 1) * 3   # unnormalised rows
    tok = sample_rows(p, [torch.Generator().manual_seed(i) for i in range(4000)])
    counts = torch.bincount(tok, minlength=5).tolist()
    assert counts[1] == counts[4] == 0
    for k, q in ((0, 0.5), (2, 0.2), (3, 0.3)):
        assert abs(counts[k] - 4000 * q) < 4 * (4000 * q * (1 - q)) ** 0.5, counts
    alone = [int(sample_rows(p[i:i + 1], [torch.Generator().manual_seed(i)])) for i in (0, 17, 3999)]
    assert alone == [int(tok[0]), int(tok[17]), int(tok[3999])]
    one_hot = torch.tensor([[0.0, 0.0, 1.0]])
    assert [int(sample_rows(one_hot, [torch.Generator().manual_seed(s)])) for s in range(20)] == [2] * 20


def _inverse_cdf(probs, generators):
    """The sampler the hf engine had before the race: the inverse CDF at one float64 uniform per row."""
    cdf = probs.double().cumsum(-1)
    u = torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in generators])
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def test_sample_rows_is_not_moved_by_last_bit_changes_of_the_logits():
    """2000 rows of a 8192-token distribution, sampled from logits and from the same logits changed
    by 2e-5 at most (what another batch's padding does to SmolLM2's logits: up to 4.4e-5), each row
    with the same generator seed both times: the race draws the same token in every row. The change
    is large enough to matter: the inverse CDF at one uniform per row, the sampler before, draws
    other tokens in some rows (its cumulative sums move by the change summed over the vocabulary)."""
    from mrl.rollout.logprobs import sample_rows

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2000, 8192, generator=g) * 2
    nudged = logits + (torch.rand(logits.shape, generator=g) - 0.5) * 4e-5
    p, q = torch.softmax(logits, -1), torch.softmax(nudged, -1)
    seeds = range(2000)
    race_p = sample_rows(p, [torch.Generator().manual_seed(s) for s in seeds])
    race_q = sample_rows(q, [torch.Generator().manual_seed(s) for s in seeds])
    assert torch.equal(race_p, race_q)
    cdf_p = _inverse_cdf(p, [torch.Generator().manual_seed(s) for s in seeds])
    cdf_q = _inverse_cdf(q, [torch.Generator().manual_seed(s) for s in seeds])
    assert int((cdf_p != cdf_q).sum()) >= 1


def test_a_request_draws_the_same_tokens_alone_and_in_batches_of_other_paddings(tmp_path):
    """Six prompts of 3 to 40 tokens, 4 responses of 24 tokens each, on a tiny model with a
    4096-token vocabulary: each prompt generated alone (no padding), in the whole batch (left-padded
    to 40) and in a batch of the three longest, with its own seed every time, draws the same tokens
    (576 draws per arrangement); log-probs agree up to float summation order."""
    from mrl.rollout.types import prompt_seed

    from .conftest import save_tiny_model

    eng = HFEngine.from_pretrained(save_tiny_model(tmp_path / "v4k", {**TINY_LLAMA, "vocab_size": 4096}), seed=0,
                                   batched_sampler=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (3, 40, 7, 25, 12, 33)]
    s = Sampling(n=4, temperature=1.0, max_tokens=24, ignore_eos=True, seed=17)
    whole = eng.generate(prompts, s)
    alone = [r for i, p in enumerate(prompts) for r in eng.generate([p], s, prompt_seeds=[prompt_seed(17, i)])]
    longest = [1, 5, 3]
    some = eng.generate([prompts[i] for i in longest], s, prompt_seeds=[prompt_seed(17, i) for i in longest])
    assert [r.token_ids for r in alone] == [r.token_ids for r in whole]
    assert [r.token_ids for r in some] == [r.token_ids for i in longest for r in whole[4 * i:4 * i + 4]]
    for a, w in zip(alone, whole):
        assert a.logprobs == pytest.approx(w.logprobs, abs=1e-5)
