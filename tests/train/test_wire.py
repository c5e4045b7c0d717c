"""The bridge's weight stream (`mrl.train.wire`, separate placement) with an in-process bridge:
trainer rank 0's frames are recorded and replayed to a rollout rank's receiver holding a real
(tiny) hf engine, so a test can flip a byte or drop a bucket on the wire."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from mrl.train.wire import BridgeReceiver, BridgeSender, held_key
from mrl.weights.verify import WeightSyncError, same_bits
from tests.rollout.test_weight_channel import Trainer, _bits, _engine, _shapes

ROLLOUT_RANK = 3   # global rank of the one rollout rank (trainer ranks 0..2)


class Wire:
    """What trainer rank 0 broadcast, in order; the rollout side reads it back."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []

    def frames(self) -> list[tuple[int, int]]:
        """(first tensor index, tensors) of every frame."""
        out, i = [], 0
        while i < len(self.tensors):
            n = 3 if int(self.tensors[i][1]) >= 0 else 2
            out.append((i, n))
            i += n
        return out

    def header(self, frame: tuple[int, int]) -> list:
        return json.loads(self.tensors[frame[0] + 1].numpy().tobytes())

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class FakeBridge:
    """`Bridge.broadcast` and `store` for one side: rank 0 records, the rollout rank replays."""

    def __init__(self, rank: int, store, wire: Wire):
        self.rank, self.store, self.wire = rank, store, wire

    def broadcast(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        if self.rank == 0:
            self.wire.tensors.append(tensor.clone())
            return tensor
        got = self.wire.tensors.pop(0)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, (what, got.shape, tensor.shape)
        return got


class Ready:
    def wait_until_ready(self, version, what):
        pass


def _pair(engine, *, mode="delta", verify_every_steps=0, bucket_mb=0.05, group="0 (rollout rank 0)"):
    store, wire = dist.HashStore(), Wire()
    sender = BridgeSender(FakeBridge(0, store, wire), [ROLLOUT_RANK], mode=mode, bucket_mb=bucket_mb,
                          verify_every_steps=verify_every_steps)
    receiver = BridgeReceiver(FakeBridge(ROLLOUT_RANK, store, wire), engine, group)
    return sender, receiver, wire


def _synced_then_delta_sent():
    """A rollout rank that received version 0 in full, and version 1 (a delta) sent but not yet received."""
    engine = _engine()
    trainer = Trainer(_shapes(engine))
    sender, receiver, wire = _pair(engine)
    sender.send(trainer.stream(), 0, Ready())
    receiver.receive(0)
    trainer.step()
    sender.send(trainer.stream(), 1, Ready())
    return engine, trainer, sender, receiver, wire


def test_delta_across_the_bridge_is_bit_identical_to_full_after_every_step_of_a_20_step_bf16_run():
    full_engine, delta_engine = _engine(0), _engine(1)   # different random starts: the first sync must be full
    trainer = Trainer(_shapes(full_engine))
    full, full_rx, full_wire = _pair(full_engine, mode="full", verify_every_steps=5)
    delta, delta_rx, delta_wire = _pair(delta_engine, verify_every_steps=5)
    for step in range(20):
        full_wire.tensors.clear(), delta_wire.tensors.clear()
        f = full.send(trainer.stream(), step, Ready())
        d = delta.send(trainer.stream(), step, Ready())
        crossed_full, crossed_delta = full_wire.bytes(), delta_wire.bytes()
        assert full_rx.receive(step) == delta_rx.receive(step) == step
        assert not full_wire.tensors and not delta_wire.tensors   # every frame was read
        a, b = _bits(full_engine), _bits(delta_engine)
        for n in a:
            assert same_bits(a[n], b[n]).all(), (step, n)
        assert f.full and d.full == (step == 0)
        if step:
            assert d.tensors_sparse > 0 and 0 < d.bytes_sent < f.bytes_sent == f.bytes_full
            assert crossed_delta < crossed_full / 2   # what crossed: payloads, headers and frame sizes
        assert f.verified == d.verified == delta_rx.last.verified == (step % 5 == 4)
        trainer.step()
    assert delta_rx.held == 19 and delta.bridge.store.get(held_key(ROLLOUT_RANK)) == b"19"


def _tensor_frames(wire: Wire, kind: str) -> list[tuple[int, int]]:
    return [f for f in wire.frames() if wire.header(f)[0] == kind]


def test_a_byte_flipped_on_the_bridge_is_one_line_naming_tensor_version_and_group():
    engine, trainer, sender, receiver, wire = _synced_then_delta_sent()   # a delta: sparse and whole items
    first, _ = _tensor_frames(wire, "bucket")[0]
    wire.tensors[first + 2][1] ^= 0x04     # a byte of the first payload (not alignment padding)
    with pytest.raises(WeightSyncError) as e:
        receiver.receive(1)
    msg = str(e.value)
    assert "\n" not in msg and "(version 1, bucket 0)" in msg and "engine group 0 (rollout rank 0)" in msg
    assert msg.split()[2].startswith("model.") and "checksum" in msg


def test_a_dropped_bucket_on_the_bridge_is_one_line_naming_its_tensors():
    engine = _engine()
    trainer = Trainer(_shapes(engine))
    sender, receiver, wire = _pair(engine, group="2 (rollout rank 5)")
    sender.send(trainer.stream(), 4, Ready())
    first, n = _tensor_frames(wire, "bucket")[1]
    names = [m[0] for m in wire.header((first, n))[3]]
    del wire.tensors[first:first + n]
    with pytest.raises(WeightSyncError) as e:
        receiver.receive(4)
    msg = str(e.value)
    assert "\n" not in msg and "bucket 1 of version 4" in msg and "never arrived at engine group 2 (rollout rank 5)" in msg
    assert f"tensors {names[0]} .. {names[-1]}, {len(names)} in all" in msg


def test_full_syncs_on_first_sync_after_a_trainer_resume_and_after_a_rollout_rank_lost_its_weights():
    engine = _engine()
    trainer = Trainer(_shapes(engine))
    sender, receiver, wire = _pair(engine)
    kinds = []
    for version in range(5):
        if version == 2:
            receiver.forget()          # the rollout rank's engine was rebuilt: it says it holds nothing
        if version == 3:               # the trainer resumed: a new process holds no copy
            sender = BridgeSender(sender.bridge, [ROLLOUT_RANK], mode="delta", bucket_mb=0.05)
        kinds.append(sender.send(trainer.stream(), version, Ready()).full)
        receiver.receive(version)
        trainer.step()
    assert kinds == [True, False, True, True, False]


def test_a_delta_on_a_version_the_rollout_rank_does_not_hold_is_refused():
    engine, trainer, sender, receiver, wire = _synced_then_delta_sent()
    receiver.held = 7      # e.g. a rollout rank that applied something else since
    with pytest.raises(WeightSyncError, match=r"version 1 is a delta on version 0, but engine group .* holds version 7"):
        receiver.receive(1)


def test_the_rollout_rank_checks_the_version_it_waits_for():
    engine = _engine()
    trainer = Trainer(_shapes(engine))
    sender, receiver, wire = _pair(engine)
    sender.send(trainer.stream(), 3, Ready())
    with pytest.raises(WeightSyncError, match="expected policy version 2, the trainer sent version 3"):
        receiver.receive(2)


def test_verification_across_the_bridge_catches_an_engine_tensor_that_drifted():
    engine = _engine()
    trainer = Trainer(_shapes(engine))
    sender, receiver, wire = _pair(engine, verify_every_steps=2, group="1 (rollout rank 1)")
    sender.send(trainer.stream(), 0, Ready())
    receiver.receive(0)                  # sync 1: not verified
    with torch.no_grad():
        engine.model.model.layers[0].self_attn.k_proj.weight.view(-1)[3] += 1
    trainer.step()
    sender.send(trainer.stream(), 1, Ready())   # sync 2: a delta, then the trainer's checksums
    with pytest.raises(WeightSyncError, match=r"k_proj.weight at engine group 1 \(rollout rank 1\) differs .* version 1"):
        receiver.receive(1)


def test_a_rank_without_an_engine_checks_the_buckets_and_reads_the_whole_sync():
    engine = _engine()
    trainer = Trainer(_shapes(engine))
    sender, _, wire = _pair(engine, verify_every_steps=1)
    receiver = BridgeReceiver(FakeBridge(ROLLOUT_RANK, sender.bridge.store, wire), None, "0 (rollout rank 1)")
    for version in range(2):
        sender.send(trainer.stream(), version, Ready())
        assert receiver.receive(version) == version and not wire.tensors
        trainer.step()
    sender.send(trainer.stream(), 2, Ready())
    wire.tensors[4][0] ^= 0x01            # the first bucket's buffer (after the sync frame: sizes, header)
    with pytest.raises(WeightSyncError, match="failed its checksum"):
        receiver.receive(2)


PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class FusedEngine:
    """A vLLM-like engine: whole HF tensors only (no `apply_sparse`), loaded per module as vLLM's
    layerwise reload does, so a sync that carries part of a unit (k without q and v) is refused."""

    accepts_sparse = False

    def __init__(self):
        self.w: dict[str, torch.Tensor] = {}
        self.loads: list[set[str]] = []   # the tensors of each sync

    def load_unit(self, name):
        from mrl.rollout.vllm_readback import load_unit

        return load_unit(name, PACKED)

    def update_weights(self, stream, partial=False):
        got = {name: t.clone() for name, t in stream}
        units = {}
        for name in self.w or got:
            units.setdefault(self.load_unit(name), set()).add(name)
        for name in got:
            if not units[self.load_unit(name)] <= set(got):
                raise RuntimeError(f"unit {self.load_unit(name)} loaded in part: {sorted(set(got))}")
        self.w.update(got)
        self.loads.append(set(got))
        return len(got)

    def held_weights(self, names):
        for name in names:
            yield name, self.w[name]


def test_delta_to_a_fused_engine_over_the_bridge_sends_whole_units_and_equals_a_full_sync():
    """vLLM on separate rollout ranks: the sender learns the engine's load units from the store
    after the first (full) sync and sends every changed unit whole, never index/value pairs."""
    names_shapes = _shapes(_engine())
    trainer = Trainer(names_shapes)
    full_engine, delta_engine = FusedEngine(), FusedEngine()
    full, full_rx, full_wire = _pair(full_engine, mode="full", verify_every_steps=1)
    store, delta_wire = dist.HashStore(), Wire()
    delta = BridgeSender(FakeBridge(0, store, delta_wire), [ROLLOUT_RANK], mode="delta", bucket_mb=0.05,
                         verify_every_steps=1)   # accepts_sparse as for hf: the engine's word decides
    delta_rx = BridgeReceiver(FakeBridge(ROLLOUT_RANK, store, delta_wire), delta_engine, "0 (rollout rank 3)")
    k, o = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    gate = "model.layers.1.mlp.gate_proj.weight"
    qkv = {k.replace("k_proj", p) for p in ("q_proj", "k_proj", "v_proj")}
    gate_up = {gate, gate.replace("gate_proj", "up_proj")}
    changes = [({k}, qkv), ({o}, {o}), ({gate}, gate_up), (None, {n for n, _ in names_shapes}), (set(), set())]
    for step in range(len(changes) + 1):
        f = full.send(trainer.stream(), step, Ready())
        d = delta.send(trainer.stream(), step, Ready())
        full_rx.receive(step), delta_rx.receive(step)
        assert not full_wire.tensors and not delta_wire.tensors
        assert full_rx.last.verified and delta_rx.last.verified
        for n in full_engine.w:
            assert same_bits(full_engine.w[n], delta_engine.w[n]).all(), (step, n)
        assert d.full == (step == 0) and d.tensors_sparse == 0
        if step == 0:
            published = json.loads(store.get("weights/units/3"))
            assert published["sparse"] is False and sorted(qkv) in [sorted(u) for u in published["units"]]
        else:   # the tensors of every unit one of whose tensors changed, whole
            assert delta_engine.loads[-1] == changes[step - 1][1], step
            assert d.bytes_sent == sum(delta_engine.w[n].numel() * 2 for n in changes[step - 1][1])
        if step < len(changes):
            trainer.step(only=changes[step][0])


def test_a_sparse_item_at_an_engine_that_loads_whole_tensors_is_one_line():
    engine = FusedEngine()
    trainer = Trainer(_shapes(_engine()))
    sender, receiver, wire = _pair(engine)
    sender.send(trainer.stream(), 0, Ready())
    receiver.receive(0)
    sender._read_units = lambda: None   # as if the sender never learned that the engine takes no sparse updates
    sender.units_known = True
    trainer.step(only={"model.layers.0.self_attn.o_proj.weight"})
    sender.send(trainer.stream(), 1, Ready())
    with pytest.raises(WeightSyncError, match=r"^weight sync: model.layers.0.self_attn.o_proj.weight \(version 1, "
                                              r"bucket 0\) arrived as index/value pairs at engine group 0 "
                                              r"\(rollout rank 0\), whose FusedEngine engine loads whole tensors only$"):
        receiver.receive(1)


def test_units_published_by_several_rollout_ranks_merge_and_any_whole_only_engine_turns_sparse_off():
    from mrl.train.wire import merged_units

    units, sparse = merged_units([{"sparse": True, "units": [["q", "k", "v"]]},
                                  None,                                        # a rank holding no engine
                                  {"sparse": False, "units": [["v", "o"], ["g", "u"]]}])
    unit = lambda name: units.get(name, name)   # as the sender uses it
    assert not sparse
    assert len({unit(n) for n in "qkvo"}) == 1 and unit("g") == unit("u") != unit("q")
    assert unit("x") == "x"   # a tensor no rank names is its own unit
    assert merged_units([{"sparse": True, "units": []}]) == ({}, True)
