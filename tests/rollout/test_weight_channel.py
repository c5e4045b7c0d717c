"""Checksummed full / delta weight syncs into a real (tiny) hf engine, with a fake trainer.

The "trainer" keeps fp32 master weights and exports them in bf16 each step after an Adam-sized
update (lr 1e-6 relative: most bf16 elements keep their bits, as in real RL fine-tuning)."""
from __future__ import annotations

import pytest
import torch

from mrl.models.facts import BUILTIN_PRESETS
from mrl.rollout.hf import HFEngine
from mrl.rollout.weight_channel import ColocatedChannel
from mrl.weights.delta import Bucket, End, SyncStats, WeightSender
from mrl.weights.verify import WeightSyncError, checksum, matches, same_bits


def _engine(seed=0):
    torch.manual_seed(seed)
    return HFEngine.from_config(BUILTIN_PRESETS["tiny-llama"], dtype="bfloat16")


class Trainer:
    def __init__(self, names_shapes, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.master = {n: torch.randn(s, generator=g) * 0.05 for n, s in names_shapes}
        self.g = g

    def step(self, lr=1e-4, only=None):
        for n, w in self.master.items():
            if only is None or n in only:
                w.add_(torch.randn(w.shape, generator=self.g).sign() * lr * w.abs())

    def stream(self):
        return ((n, w.to(torch.bfloat16)) for n, w in self.master.items())


def _shapes(engine):
    return [(n, tuple(p.shape)) for n, p in engine.model.named_parameters()]


def _bits(engine):
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def test_delta_sync_is_bit_identical_to_full_sync_after_every_step_of_a_20_step_bf16_run():
    full_engine, delta_engine = _engine(0), _engine(1)   # different random starts: the first sync must be full
    trainer = Trainer(_shapes(full_engine))
    full = ColocatedChannel(full_engine, mode="full", bucket_mb=0.05, verify_every_steps=5)
    delta = ColocatedChannel(delta_engine, mode="delta", bucket_mb=0.05, verify_every_steps=5)
    kinds = []
    for step in range(20):
        full.push(trainer.stream(), step, lost=step == 0)
        delta.push(trainer.stream(), step, lost=step == 0)
        a, b = _bits(full_engine), _bits(delta_engine)
        for n in a:
            assert same_bits(a[n], b[n]).all(), (step, n)
        kinds.append((delta.last.full, delta.last.tensors_sparse > 0))
        if step:
            assert 0 < delta.last.bytes_sent < full.last.bytes_sent
            assert 0 < delta.last.elements_changed < delta.last.elements
        trainer.step()
    assert kinds[0] == (True, False) and all(k == (False, True) for k in kinds[1:])
    assert full.last.verified and delta.last.verified   # sync 20 was a full verification
    assert full.last.bytes_sent == full.last.bytes_full


def test_unchanged_tensors_are_not_sent_and_changed_ones_only_are():
    # LoRA: the merged tensors of untouched projections export the same bytes; only moved ones go
    engine = _engine()
    trainer = Trainer(_shapes(engine))
    ch = ColocatedChannel(engine, mode="delta", verify_every_steps=1)
    ch.push(trainer.stream(), 0, lost=True)
    moved = {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"}
    trainer.step(only=moved)
    sent = []
    ch.transit = lambda msgs: (sent.extend(it.name for it in m.items) or m if isinstance(m, Bucket) else m for m in msgs)
    ch.push(trainer.stream(), 1)
    assert set(sent) == moved and not ch.last.full
    ch.push(trainer.stream(), 2)    # nothing moved: nothing sent, still verified
    assert ch.last.tensors_sent == 0 and ch.last.verified


def test_lost_weights_and_a_new_sender_force_a_full_sync():
    engine = _engine()
    trainer = Trainer(_shapes(engine))
    ch = ColocatedChannel(engine, mode="delta")
    ch.push(trainer.stream(), 0, lost=True)
    trainer.step()
    ch.push(trainer.stream(), 1)
    assert not ch.last.full
    ch.push(trainer.stream(), 1, lost=True)     # sleep level 2 dropped the engine's weights
    assert ch.last.full and ch.last.tensors_sent == ch.last.tensors
    resumed = ColocatedChannel(engine, mode="delta")   # a resumed run: a new process holds nothing
    resumed.push(trainer.stream(), 1)
    assert resumed.last.full


def test_a_delta_larger_than_the_tensor_goes_whole():
    sender = WeightSender(mode="delta", sparse_fraction=1.0)
    t = torch.zeros(100, dtype=torch.bfloat16)
    list(sender.encode([("w", t)], 0))
    msgs = list(sender.encode([("w", torch.arange(100, dtype=torch.bfloat16))], 1))   # 99 of 100 changed
    item = msgs[0].items[0]
    assert not item.sparse and item.values.shape == (100,)
    msgs = list(sender.encode([("w", torch.arange(100, dtype=torch.bfloat16).index_fill(0, torch.tensor([5]), 0))], 2))
    item = msgs[0].items[0]
    assert item.sparse and item.indices.tolist() == [5] and item.nbytes == 4 + 2


def _flip_one_byte(target_bucket):
    def transit(msgs):
        for m in msgs:
            if isinstance(m, Bucket) and m.index == target_bucket:
                v = m.items[0].values.clone()
                v.view(-1).view(torch.uint8)[3] ^= 0x10
                m.items[0].values = v
            yield m
    return transit


def test_a_byte_flipped_in_transit_is_one_line_naming_tensor_version_and_group():
    engine = _engine()
    trainer = Trainer(_shapes(engine))
    ch = ColocatedChannel(engine, mode="full", bucket_mb=0.05, group="rank 3", transit=_flip_one_byte(2))
    with pytest.raises(WeightSyncError) as e:
        ch.push(trainer.stream(), 7, lost=True)
    msg = str(e.value)
    assert "\n" not in msg and "version 7" in msg and "rank 3" in msg and "checksum" in msg
    assert msg.split()[2].startswith("model.")   # "weight sync: <tensor> (version 7, bucket 2) ..."


def test_a_dropped_bucket_is_one_line_naming_its_tensors():
    engine = _engine()
    trainer = Trainer(_shapes(engine))
    drop = lambda msgs: (m for m in msgs if not (isinstance(m, Bucket) and m.index == 1))
    ch = ColocatedChannel(engine, mode="delta", bucket_mb=0.05, group="rank 0", transit=drop)
    with pytest.raises(WeightSyncError) as e:
        ch.push(trainer.stream(), 4, lost=True)
    msg = str(e.value)
    assert "\n" not in msg and "bucket 1 of version 4" in msg and "never arrived" in msg and "model." in msg


def test_a_sync_without_its_end_and_a_stale_version_are_caught():
    engine = _engine()
    trainer = Trainer(_shapes(engine))
    ch = ColocatedChannel(engine, bucket_mb=0.05, transit=lambda msgs: (m for m in msgs if not isinstance(m, End)))
    with pytest.raises(WeightSyncError, match="without its end marker"):
        ch.push(trainer.stream(), 1, lost=True)

    def stale(msgs):
        for m in msgs:
            if isinstance(m, Bucket) and m.index == 1:
                m.version = 0
            yield m
    ch = ColocatedChannel(engine, bucket_mb=0.05, transit=stale)
    with pytest.raises(WeightSyncError, match="carries version 0, engine group 0 expected version 1"):
        ch.push(trainer.stream(), 1, lost=True)


def test_full_verification_catches_an_engine_tensor_that_drifted():
    engine = _engine()
    trainer = Trainer(_shapes(engine))
    ch = ColocatedChannel(engine, mode="delta", verify_every_steps=2, group="rank 1")
    ch.push(trainer.stream(), 0, lost=True)    # sync 1: not a verification sync
    with torch.no_grad():
        engine.model.model.layers[1].mlp.up_proj.weight.view(-1)[0] += 1
    with pytest.raises(WeightSyncError, match=r"model.layers.1.mlp.up_proj.weight at engine group rank 1 differs .* version 0"):
        ch.push(trainer.stream(), 0)   # sync 2: nothing changed, nothing sent, verified


@pytest.mark.parametrize("algorithm", ["xxh3", "wsum32"])
def test_checksum_sees_every_single_byte_flip_and_word_swaps(algorithm):
    t = torch.randn(33, dtype=torch.bfloat16)   # 66 bytes: not a multiple of 4
    base = checksum(t, algorithm=algorithm)
    assert base[0] == algorithm and base[2] == 66
    raw = t.view(torch.uint8)
    for i in range(raw.numel()):
        for bit in (0x01, 0x80):
            u = raw.clone()
            u[i] ^= bit
            assert checksum(u.view(torch.bfloat16), algorithm=algorithm) != base
    w = torch.arange(8, dtype=torch.int32)
    for i in range(7):   # every pair of neighbours swapped, and the first with the last
        order = list(range(8))
        order[i], order[i + 1] = order[i + 1], order[i]
        assert checksum(w, algorithm=algorithm) != checksum(w[order], algorithm=algorithm)
    assert checksum(w, algorithm=algorithm) != checksum(w[[7, 1, 2, 3, 4, 5, 6, 0]], algorithm=algorithm)
    assert checksum(t.clone(), algorithm=algorithm) == base
    assert checksum(w[:7], algorithm=algorithm) != checksum(w, algorithm=algorithm)   # a truncated payload


def test_the_checksum_is_xxh3_in_host_memory_and_a_payload_is_its_parts_bytes_in_order():
    import xxhash

    t = torch.randn(10, dtype=torch.float32)
    idx = torch.arange(3, dtype=torch.int32)
    assert checksum(t) == ("xxh3", xxhash.xxh3_128_intdigest(t.numpy().tobytes()), 40)
    both = xxhash.xxh3_128_intdigest(t.numpy().tobytes() + idx.numpy().tobytes())
    assert checksum(t, idx) == ("xxh3", both, 52)
    for algorithm in ("xxh3", "wsum32"):
        assert checksum(t, idx, algorithm=algorithm) != checksum(idx, t, algorithm=algorithm)
        assert matches(checksum(t, idx, algorithm=algorithm), t, idx)
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        checksum(t, algorithm="md5")


def _wsum32_by_hand(raw: bytes) -> int:
    """S + 2**32 W of the bytes as little-endian uint32 words (zero-padded), in Python ints."""
    raw += bytes(-len(raw) % 4)
    words = [int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4)]
    return sum(words) % 2**32 + 2**32 * (sum((i + 1) * w for i, w in enumerate(words)) % 2**32)


@pytest.mark.parametrize("nbytes", [0, 1, 6, 4 * 4095, 4 * 4096, 4 * 4096 + 7, 4 * (3 * 4096 + 17) + 2])
def test_wsum32_is_the_position_weighted_word_sum(nbytes):
    from mrl.weights.verify import wsum32

    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert wsum32(raw) == _wsum32_by_hand(bytes(raw.numpy()))
    if nbytes > 1:   # a view at an odd storage offset (not word aligned) reads the same bytes
        assert wsum32(raw[1:]) == _wsum32_by_hand(bytes(raw[1:].numpy()))


def test_the_wsum32_triton_kernel_gives_the_same_sums_in_the_interpreter(tmp_path):
    """The CUDA kernel's arithmetic, run by Triton's CPU interpreter (TRITON_INTERPRET=1 must be set
    before Triton is imported, so in a child process): blocks, a ragged last block, int32 wrap-around;
    the batched kernel (a bucket's tensors in one launch) equals the per-tensor sums and sees a
    flipped byte and swapped words in the tensor they hit only."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    script = tmp_path / "wsum32_interp.py"
    script.write_text(
        "import torch\n"
        "from mrl.weights.verify import _MASK32, _words, wsum32\n"
        "from mrl.weights.wsum32_triton import wsum32_partials\n"
        "g = torch.Generator().manual_seed(1)\n"
        "for n in (4, 20, 4 * 1024 + 12, 4 * 3 * 1024):\n"
        "    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)\n"
        "    s, w = (wsum32_partials(_words(raw), 1024).to(torch.int64) & _MASK32).sum(0).tolist()\n"
        "    assert (s & _MASK32) | ((w & _MASK32) << 32) == wsum32(raw), n\n"
        # the batched kernel: tensors of one bucket in one launch, each addressed from the lowest
        "from mrl.weights.verify import _wsum32_many\n"
        "big = torch.randint(0, 256, (4 * 3 * 1024 + 9,), dtype=torch.uint8, generator=g)\n"
        "raws = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (4, 6, 4 * 1024 + 12, 4 * 2048)]\n"
        "raws += [big[1:], big[4:4 * 1024 + 4]]   # a view off word alignment (copied), an aligned one\n"
        "sums = _wsum32_many(raws, 1024)\n"
        "assert sums == [wsum32(r) for r in raws], sums\n"
        "flipped = [r.clone() for r in raws]\n"
        "flipped[2][4 * 1024 + 5] ^= 1   # a byte in the ragged last block of the third tensor\n"
        "swapped = [r.clone() for r in raws]\n"
        "w = swapped[3].view(torch.int32)\n"
        "w[[1023, 1024]] = w[[1024, 1023]].clone()   # neighbour words across a block boundary\n"
        "for bad, k in ((flipped, 2), (swapped, 3)):\n"
        "    got = _wsum32_many(bad, 1024)\n"
        "    assert [i for i in range(len(raws)) if got[i] != sums[i]] == [k], (k, got, sums)\n"
        "print('ok')\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_batched_kernels_block_table_by_hand():
    """Tensors at byte addresses 1000, 40 and 72 with 5, 0 and 2 words, 2-word blocks: the base is
    the lowest address (40); offsets in words from it; the empty tensor has no block."""
    from mrl.weights.verify import block_table

    base, table = block_table([1000, 40, 72], [5, 0, 2], 2)
    assert base == 1
    assert table.tolist() == [[240, 0, 2, 0], [242, 2, 2, 0], [244, 4, 1, 0], [8, 0, 2, 2]]
    with pytest.raises(ValueError, match="4-byte aligned"):
        block_table([40, 42], [1, 1], 2)


def test_checksum_many_is_checksum_of_each_payload_and_first_mismatch_names_the_first_bad_one():
    from mrl.weights.verify import checksum_many, first_mismatch

    g = torch.Generator().manual_seed(0)
    t = torch.randn(33, generator=g).to(torch.bfloat16)
    idx = torch.arange(5, dtype=torch.int32)
    payloads = [(t,), (t[:5], idx), (torch.empty(0),), (torch.randn(4097, generator=g),)]
    for algorithm in (None, "xxh3", "wsum32"):
        assert checksum_many(payloads, algorithm=algorithm) == [checksum(*p, algorithm=algorithm) for p in payloads]
    expected = [checksum(*p, algorithm=a) for p, a in zip(payloads, ("wsum32", "xxh3", "wsum32", "xxh3"))]
    assert first_mismatch(expected, payloads) is None
    flipped = t.clone()
    flipped.view(torch.uint8)[3] ^= 4
    assert first_mismatch(expected, [payloads[0], payloads[1], payloads[2], (payloads[3][0] + 1,)]) == 3
    assert first_mismatch(expected, [(flipped,)] + payloads[1:3] + [(payloads[3][0] + 1,)]) == 0
    assert first_mismatch([expected[0], None], payloads[:2]) == 1


def test_delta_is_accepted_with_either_engine_colocated_or_on_separate_rollout_ranks():
    from mrl.rollout.config import RolloutConfig, WeightSyncConfig
    from mrl.rollout.layout import rollout_layout_problems

    delta = WeightSyncConfig(mode="delta")
    for engine in ("hf", "vllm"):
        assert rollout_layout_problems(RolloutConfig(engine=engine, weight_sync=delta), 2) == []
        assert rollout_layout_problems(RolloutConfig(engine=engine, placement="separate", ranks=1,
                                                     weight_sync=delta), 3) == []


@pytest.mark.parametrize("level,second_full", [(1, False), (2, True)])
def test_the_train_loop_syncs_full_after_a_level_2_sleep_and_delta_otherwise(level, second_full):
    from types import SimpleNamespace

    from mrl.train.parts import Generation, Learner
    from mrl.train.colocated import release_engine
    from mrl.train.engine_sync import sync_weights

    engine = _engine()
    trainer = Trainer(_shapes(engine))
    learner = Learner(actor=SimpleNamespace(steps=0), exporter=SimpleNamespace(stream=lambda targets: trainer.stream()))
    gen = Generation(engine=engine, channel=ColocatedChannel(engine, mode="delta"))
    sync_weights(gen, learner, 0)
    assert gen.channel.last.full
    release_engine(gen, level)
    trainer.step()
    learner.actor.steps += 1
    sync_weights(gen, learner, 1)
    assert gen.channel.last.full is second_full and gen.channel.last.version == 1


def test_buckets_survive_the_byte_wire_and_a_flipped_wire_byte_is_caught():
    from mrl.weights.delta import pack, unpack

    engine = _engine()
    trainer = Trainer(_shapes(engine))
    sender = WeightSender(mode="delta", bucket_bytes=50_000)
    list(sender.encode(trainer.stream(), 0))
    trainer.step()
    wire = [pack(m) for m in sender.encode(trainer.stream(), 1)]
    back = [unpack(h, f) for h, f in wire]
    assert isinstance(back[-1], End) and any(it.sparse for b in back[:-1] for it in b.items)
    assert all(matches(it.checksum, *it.payloads) for b in back[:-1] for it in b.items)
    wire[0][1][7] ^= 0x01    # one byte of the first buffer, as a broken link would
    bad = unpack(*wire[0])
    assert not all(matches(it.checksum, *it.payloads) for it in bad.items)


@pytest.mark.parametrize("algorithm", ["wsum32", "xxh3"])
@pytest.mark.parametrize("dtype,numel", [(torch.bfloat16, 1000), (torch.bfloat16, 33), (torch.float32, 257),
                                         (torch.float64, 40), (torch.uint8, 4096 * 4 + 3)])
def test_checksum_update_equals_a_rehash(dtype, numel, algorithm):
    from mrl.weights.verify import checksum_update

    g = torch.Generator().manual_seed(numel)
    old = (torch.randn(numel, generator=g) * 100).to(dtype)
    for k in (1, 2, 7, numel // 3):
        idx = torch.randperm(numel, generator=g)[:k].sort().values
        new = old.clone()
        new[idx] = (torch.randn(k, generator=g) * 100).to(dtype)
        before = checksum(old, algorithm=algorithm)
        assert checksum_update(before, old, new, idx) == checksum(new, algorithm=algorithm), (dtype, numel, k)
        old = new


def test_the_delta_sender_keeps_the_checksums_of_what_the_engine_holds():
    engine = _engine()
    trainer = Trainer(_shapes(engine))
    sender = WeightSender(mode="delta", bucket_bytes=50_000)
    sparse = []
    for version in range(6):
        stats = SyncStats(version=version, full=False)
        list(sender.encode(trainer.stream(), version, stats))
        sparse.append(stats.tensors_sparse > 0)
        assert sender.expected() == {n: checksum(t) for n, t in sender.held.items()}
        trainer.step(lr=1e-4 if version % 2 else 3e-2)   # sparse and whole changes in turn
    assert sparse == [False, False, True, False, True, False]



def test_a_colocated_sync_hashes_each_payload_once_unless_something_sits_in_between(monkeypatch):
    """Without a transit the receiver gets the sender's own tensors and does not rehash them
    (versions, positions and lost buckets are still checked); with one, every payload is rehashed."""
    import mrl.rollout.weight_channel as wc

    calls = []
    real = wc.first_mismatch
    monkeypatch.setattr(wc, "first_mismatch", lambda expected, payloads: calls.extend(expected) or real(expected, payloads))
    engine = _engine()
    trainer = Trainer(_shapes(engine))
    ColocatedChannel(engine, mode="full", bucket_mb=0.05).push(trainer.stream(), 0, lost=True)
    assert calls == []
    ch = ColocatedChannel(engine, mode="full", bucket_mb=0.05, transit=lambda msgs: msgs)
    ch.push(trainer.stream(), 0, lost=True)
    assert len(calls) == ch.last.tensors_sent > 0


def test_the_checksum_bench_runs_on_a_small_model():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "bench" / "checksum.py"
    spec = importlib.util.spec_from_file_location("checksum_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    small = dict(bench.SMOLLM2, num_hidden_layers=1, vocab_size=512, hidden_size=64, intermediate_size=128)
    r = bench.run("bfloat16", 1, cfg=small)
    assert set(r["cases"]) >= {"before", "xxh3", "wsum32 (torch)"}
    assert r["plan_7b"]["full_bytes"] > 14e9
    text = bench.report(r)
    assert "xxh3" in text and "GB/s" in text and "7B shape" in text
    # the CUDA rows' report (per tensor beside batched per bucket), from figures given by hand
    r["cases"]["before (cuda)"] = dict(r["cases"]["before"])
    r["cases"]["wsum32 (cuda)"] = dict(r["cases"]["before"], seconds=0.02, launches=272, tensors=272)
    r["cases"]["wsum32 batched (cuda)"] = dict(r["cases"]["before"], seconds=0.004, launches=1, tensors=272)
    assert "per tensor / batched per bucket: 5.0x (74 us per tensor vs 4.00 ms per bucket)" in bench.report(r)
    ts = [torch.zeros(n) for n in (3, 2, 4, 1)]   # 12, 8, 16 and 4 bytes in buckets of 24 bytes
    assert [[t.numel() for t in b] for b in bench.buckets(ts, 24)] == [[3, 2], [4, 1]]


def test_the_wire_carries_an_xxh3_of_the_host_bytes_that_cross_for_a_device_checksum():
    """A GPU sender's wsum32 checksums are replaced in the header by the xxh3 of the host bytes
    `pack` sends, which the receiver checks at host speed; a flipped wire byte is still caught."""
    from mrl.weights.delta import Item, pack, unpack

    t = torch.randn(10, 3)
    idx = torch.tensor([1, 4], dtype=torch.int32)
    items = [Item("w", (10, 3), t, checksum=checksum(t, algorithm="wsum32")),
             Item("s", (10, 3), t.reshape(-1)[idx.long()], indices=idx,
                  checksum=checksum(t.reshape(-1)[idx.long()], idx, algorithm="wsum32"))]
    header, flat = pack(Bucket(0, 0, items))
    back = unpack(header, flat)
    assert [it.checksum[0] for it in back.items] == ["xxh3", "xxh3"]
    assert all(matches(it.checksum, *it.payloads) for it in back.items)
    flat[3] ^= 0x40
    assert not matches(unpack(header, flat).items[0].checksum, *unpack(header, flat).items[0].payloads)
