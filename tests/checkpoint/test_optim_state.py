"""The optimizer's per-rank checkpoint format (`mrl.checkpoint.optim_state`), one rank in-process:
exact resume with megatron's distributed optimizer in fp32 and bf16 (and from a checkpoint of
the older torch_dist format), fp32 weights written once, a damaged or crafted optimizer file
found before anything is loaded, and the reassembly by ranges at another layout by hand."""
from __future__ import annotations

import json

import pytest
import torch

HF = dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
          rope_theta=10000.0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def platform():
    from mrl import platform as plat
    from mrl.platform.config import ParallelConfig, PlatformConfig

    ctx = plat.setup(PlatformConfig(device="cpu", ranks_per_node=1, cpu_threads=1),
                     ParallelConfig(distributed_optimizer=True), seed=11)
    yield ctx
    plat.teardown()


def _engine(dtype: str, seed: int):
    from mrl.engine.engine import Engine
    from mrl.models.megatron import build_gpt, transformer_config
    from mrl.optim import build_optimizer, build_scheduler, wrap_ddp
    from mrl.optim.config import OptimConfig, ScheduleConfig
    from mrl.platform.config import ParallelConfig

    torch.manual_seed(seed)
    parallel = ParallelConfig(distributed_optimizer=True)
    model = build_gpt(HF, transformer_config(HF, dtype=dtype, parallel=parallel, device="cpu"))
    ddp = wrap_ddp([model], distributed_optimizer=True)
    optim = OptimConfig(lr=1e-2, weight_decay=0.01)
    opt = build_optimizer(ddp, optim, distributed_optimizer=True)
    sched = build_scheduler(opt, optim, ScheduleConfig(warmup_steps=1), 10)
    return model, Engine(ddp, optimizer=opt, scheduler=sched, name="actor")


def _batch(seed: int):
    from mrl.batch import Batch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 96, (4,), generator=g).tolist() for _ in range(2)]
    responses = [torch.randint(0, 96, (6,), generator=g).tolist() for _ in range(4)]
    return Batch.from_sequences([prompts[i // 2] for i in range(4)], responses, pad_id=0)


def _nll(logits, mb, totals):
    from mrl.engine.objectives import response_logprobs

    logp, _ = response_logprobs(logits, mb, entropy=False, vocab_size=HF["vocab_size"])
    return -logp.sum() / totals.tokens, {}


def _weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resume_is_exact_and_fp32_weights_are_written_once(platform, tmp_path, dtype):
    from mrl.checkpoint import optim_state, state

    model, eng = _engine(dtype, seed=1)
    eng.train_mini_batch(_batch(1), _nll, micro_batch_tokens=10_000)
    state.save(tmp_path / "new", 1, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler,
               extra={"e": 1})
    state.save(tmp_path / "old", 1, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler,
               extra={"e": 1}, optimizer_format="torch_dist")
    want = eng.train_mini_batch(_batch(2), _nll, micro_batch_tokens=10_000)
    after = _weights(model)

    ckpt = tmp_path / "new" / "step_00000001"
    n = sum(p.numel() for p in model.parameters())
    # Adam's two moments per parameter; the fp32 master weights only where they are not the model's
    states = {"exp_avg", "exp_avg_sq"} | ({"param"} if dtype == "bfloat16" else set())
    assert optim_state.saved_states(ckpt) == states
    assert (ckpt / "optim" / "rank_00000.bin").stat().st_size == len(states) * 4 * n
    assert not optim_state.present(tmp_path / "old" / "step_00000001")

    for root in ("new", "old"):   # the new format, and a checkpoint of the older one (compat)
        model2, eng2 = _engine(dtype, seed=2)
        got = state.load(tmp_path / root, chunks=eng2.chunks, optimizer=eng2.optimizer, scheduler=eng2.scheduler)
        assert got.step == 1 and got.extra == {"e": 1} and got.optimizer_restored
        res = eng2.train_mini_batch(_batch(2), _nll, micro_batch_tokens=10_000)
        assert (res["loss"], res["grad_norm"], res["lr"]) == (want["loss"], want["grad_norm"], want["lr"]), root
        for name, p in model2.named_parameters():
            assert torch.equal(p.detach(), after[name]), (root, name)


def test_a_damaged_or_crafted_optimizer_file_is_refused(platform, tmp_path):
    from mrl.checkpoint import state
    from mrl.errors import UserError

    model, eng = _engine("float32", seed=1)
    eng.train_mini_batch(_batch(1), _nll, micro_batch_tokens=10_000)
    ckpt = state.save(tmp_path / "ck", 1, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler)
    assert state.verify(ckpt) is None
    data = ckpt / "optim" / "rank_00000.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x80
    data.write_bytes(bytes(raw))
    assert state.verify(ckpt) == "optim/rank_00000.bin does not match its checksum (its bytes changed after the save)"
    with pytest.raises(UserError, match="is damaged: optim/rank_00000.bin does not match"):
        state.load(ckpt, chunks=eng.chunks, optimizer=eng.optimizer)

    # a crafted index (the manifest check bypassed, as by someone who rewrote the manifest too):
    # nothing reads outside the data file or builds anything but the listed dtypes
    index = ckpt / "optim" / "rank_00000.json"
    body = json.loads(index.read_text())
    for field, value in (("at", data.stat().st_size), ("dtype", "torch.storage"), ("range", [0, 10**12]),
                         ("offset", [-1, 0])):
        bad = dict(body, pieces=[dict(body["pieces"][0], **{field: value}), *body["pieces"][1:]])
        index.write_text(json.dumps(bad))
        with pytest.raises(UserError, match=r"optim/rank_00000.json is not an mrl optimizer index") as e:
            state.load(ckpt, chunks=eng.chunks, optimizer=eng.optimizer, verified=True)
        assert "\n" not in str(e.value)
    index.write_text(json.dumps(dict(body, pieces=body["pieces"] * 2)))   # every element covered twice
    with pytest.raises(UserError, match="covered more than once"):
        state.load(ckpt, chunks=eng.chunks, optimizer=eng.optimizer, verified=True)


def _saved(tmp_path, pieces):
    """Write (offset, shape, range, values) pieces of one tensor as a rank file; their `_Piece`s."""
    from mrl.checkpoint import optim_state as o

    plan = [({"state": "exp_avg", "key": "w", "global_shape": [4, 6], "offset": list(off), "shape": list(shape),
              "range": list(rng), "dtype": "float32", "at": 0, "scalars": {"step": 3}}, vals) for off, shape, rng, vals in pieces]
    at = 0
    for entry, vals in plan:
        entry["at"] = at
        at += vals.numel() * 4
    o.write(tmp_path, plan, 0)
    return o._index(tmp_path)[("exp_avg", "w")]


def test_reassembly_by_ranges_at_another_layout(tmp_path):
    """A 4x6 tensor saved at TP2 (row halves, boxes at rows 0 and 2) by DP2 (each box's elements
    [0, 5) and [5, 12) on two ranks) is read back at TP1 x DP2 (the whole box, elements [7, 24))
    and at TP2 x DP1 (a box's elements [0, 12)): the values are those of the tensor."""
    from mrl.checkpoint import optim_state as o
    from mrl.errors import UserError

    full = torch.arange(24, dtype=torch.float32).view(4, 6) * 0.5
    top, bottom = full[:2].reshape(-1), full[2:].reshape(-1)
    pieces = _saved(tmp_path, [((0, 0), (2, 6), (0, 5), top[:5]), ((0, 0), (2, 6), (5, 12), top[5:]),
                               ((2, 0), (2, 6), (0, 5), bottom[:5]), ((2, 0), (2, 6), (5, 12), bottom[5:])])
    reader = o._Reader()
    whole = o._Box("w", (4, 6), (0, 0), (4, 6), 0, True, True, False)
    dst = torch.full((17,), -1.0)
    assert o._fill(dst, 7, 24, whole, pieces, reader, "w") == {"step": 3.0}
    assert torch.equal(dst, full.reshape(-1)[7:24])
    lower = o._Box("w", (4, 6), (2, 0), (2, 6), 0, True, True, False)
    dst = torch.full((12,), -1.0)
    o._fill(dst, 0, 12, lower, pieces, reader, "w")
    assert torch.equal(dst, bottom)
    with pytest.raises(UserError, match="only 5 of 12 elements"):
        o._fill(torch.zeros(12), 0, 12, lower, pieces[2:3], reader, "w")
    o._SLAB, saved_slab = 6, o._SLAB     # one row per slab: the slab walk gives the same values
    try:
        dst = torch.full((24,), -1.0)
        o._fill(dst, 0, 24, whole, pieces, reader, "w")
        assert torch.equal(dst, full.reshape(-1))
    finally:
        o._SLAB = saved_slab
        reader.close()
