"""Checkpoint fault battery on 2 ranks (TP=2): damaged latest checkpoints, `resume = "must"`, a
crafted RNG file, and a checkpoint saved without optimizer state (usage: ckpt_faults.py DIR).

Steps 1 and 2 are saved with different weights. Each case copies the root, damages step 2 and
resumes: the resume must pick step 1 (weights equal to step 1's exactly) with one warning line
naming the file. Every case prints `FAULT <name> handled|lost <detail>` on rank 0; the pytest side
checks them all."""
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine" / "scripts"))
import _engine_common as E  # noqa: E402
from _engine_common import C  # noqa: E402

from mrl import checkpoint  # noqa: E402
from mrl.checkpoint import manifest  # noqa: E402
from mrl.errors import UserError  # noqa: E402
from mrl.engine.objectives import PolicyObjective  # noqa: E402

OBJ = PolicyObjective(loss="ppo", eps_low=0.2, eps_high=0.28, clip_c=3.0)
MARKER = "pwned.txt"


def rank0(fn):
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def say(name: str, ok: bool, detail: str) -> None:
    flags = torch.tensor([float(ok)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # handled only if handled on every rank
    if dist.get_rank() == 0:
        print(f"FAULT {name} {'handled' if flags.item() == 1.0 else 'lost'} {detail}", flush=True)


def params_of(eng) -> dict:
    return {n: p.detach().clone() for n, p in eng.chunks[0].module.named_parameters()}


def same(eng, want: dict) -> bool:
    return all(torch.equal(p, want[n]) for n, p in eng.chunks[0].module.named_parameters())


def shard(step_dir: Path) -> Path:
    return sorted(step_dir.glob("*.distcp"))[0]


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def flip_signs(path: Path) -> None:
    """Flip the sign bit of 64 fp32 values in the middle of a shard (same size)."""
    data = bytearray(path.read_bytes())
    mid = (len(data) // 2) & ~3
    for i in range(64):
        data[mid + 4 * i + 3] ^= 0x80
    path.write_bytes(bytes(data))


def empty_dir(step_dir: Path) -> None:
    shutil.rmtree(step_dir)
    step_dir.mkdir()


DAMAGE = {
    "truncated_distcp": (lambda d: truncate(shard(d), shard(d).stat().st_size // 2), "truncated"),
    "empty_distcp": (lambda d: truncate(shard(d), 0), "empty"),
    "truncated_common_pt": (lambda d: truncate(d / "common.pt", (d / "common.pt").stat().st_size // 2), "common.pt"),
    "missing_dot_metadata": (lambda d: (d / ".metadata").unlink(), ".metadata is missing"),
    "broken_metadata_json": (lambda d: (d / "metadata.json").write_text("{broken"), "metadata.json"),
    "empty_step_dir": (empty_dir, "no manifest.json"),
    "flipped_sign_bits": (lambda d: flip_signs(shard(d)), "checksum"),
    "broken_manifest": (lambda d: (d / "manifest.json").write_text("{"), "manifest.json"),
    # the optimizer's own per-rank files (mrl.checkpoint.optim_state)
    "flipped_optim_shard": (lambda d: flip_signs(d / "optim" / "rank_00000.bin"), "checksum"),
    "missing_optim_index": (lambda d: (d / "optim" / "rank_00001.json").unlink(), "optim/rank_00001.json is missing"),
}


class Evil:
    """Unpickling this runs code (writes MARKER): what a crafted checkpoint would do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def batch():
    b = E.synthetic_batch(seed=7)
    return b.add(old_logprobs=torch.full(b["response_ids"].shape, -4.0))


def main(base):
    base = Path(base)
    C.up(tensor=2)
    eng = E.actor_engine(None, distributed=False)
    eng.train_mini_batch(batch(), OBJ, micro_batch_tokens=64)   # optimizer state to save
    root = base / "ckpt"
    C.perturb_(eng.chunks[0].module, seed=1)
    w1 = params_of(eng)
    checkpoint.save(root, 1, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler, extra={"s": 1})
    C.perturb_(eng.chunks[0].module, seed=2)
    checkpoint.save(root, 2, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler, extra={"s": 2})

    for name, (damage, expect) in DAMAGE.items():
        copy = base / name
        rank0(lambda: (shutil.copytree(root, copy), damage(copy / "step_00000002")))
        lines = []
        found = checkpoint.find_resumable(copy, warn=lines.append)
        got = checkpoint.load(found, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler, verified=True)
        ok = (found.name == "step_00000001" and got.extra == {"s": 1} and same(eng, w1)
              and (dist.get_rank() != 0 or (len(lines) == 1 and expect in lines[0] and "\n" not in lines[0]))
              and (copy / "step_00000002.damaged").is_dir())
        say(name, ok, lines[0] if lines else f"resumed from {found.name}")
        # a second resume does not trip over it again
        again = []
        found = checkpoint.find_resumable(copy, warn=again.append)
        say(f"{name}_resume_again", found.name == "step_00000001" and not again, "silent second resume")

    # resume = "must" refuses a damaged latest checkpoint
    copy = base / "must"
    rank0(lambda: (shutil.copytree(root, copy), truncate(shard(copy / "step_00000002"), 10)))
    try:
        checkpoint.find_resumable(copy, must=True)
        say("must_refuses_damaged_latest", False, "resumed")
    except UserError as e:
        say("must_refuses_damaged_latest", "damaged" in str(e) and "\n" not in str(e), str(e))

    # a crafted RNG file (with a manifest re-written to match it) runs no code
    copy = base / "crafted"
    marker = base / MARKER

    def craft():
        shutil.copytree(root, copy)
        d = copy / "step_00000002"
        for f in (d / "rng").iterdir():
            with open(f, "wb") as fh:
                pickle.dump({"layout": {}, "rng": Evil(str(marker))}, fh)
        body = json.loads((d / "manifest.json").read_text())
        for rel in body["files"]:
            body["files"][rel] = manifest.file_entry(d / rel)
        (d / "manifest.json").write_text(json.dumps(body))
    rank0(craft)
    try:
        checkpoint.load(copy, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler)
        say("crafted_rng_file", False, "loaded")
    except UserError as e:
        say("crafted_rng_file", not marker.exists() and "not plain tensor data" in str(e), str(e)[:160])

    # a crafted .metadata (torch's reader unpickles it) is refused before torch reads it
    copy = base / "crafted_metadata"

    def craft_metadata():
        shutil.copytree(root, copy)
        d = copy / "step_00000002"
        with open(d / ".metadata", "wb") as fh:
            pickle.dump(Evil(str(marker)), fh)
        body = json.loads((d / "manifest.json").read_text())
        body["files"][".metadata"] = manifest.file_entry(d / ".metadata")
        (d / "manifest.json").write_text(json.dumps(body))
    rank0(craft_metadata)
    try:
        checkpoint.load(copy, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler)
        say("crafted_dcp_metadata", False, "loaded")
    except UserError as e:
        say("crafted_dcp_metadata", not marker.exists() and "builtins.exec" in str(e), str(e)[:160])

    # checkpoint.save_optimizer = false: the checkpoint resumes with a fresh optimizer
    checkpoint.save(root, 3, chunks=eng.chunks, optimizer=None, scheduler=eng.scheduler, extra={"s": 3})
    w3 = params_of(eng)
    C.down()
    C.up(tensor=2, seed=77)
    eng = E.actor_engine(None, distributed=False)
    got = checkpoint.load(root, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler)
    loaded_w3 = same(eng, w3)
    res = eng.train_mini_batch(batch(), OBJ, micro_batch_tokens=64)
    ok = got.step == 3 and not got.optimizer_restored and loaded_w3 and not same(eng, w3) and res["loss"] == res["loss"]
    say("save_optimizer_false_resumes", ok, f"step {got.step}, optimizer fresh, one update after: loss {res['loss']:.4f}")
    C.down()


if __name__ == "__main__":
    C.main_guard(lambda: main(sys.argv[1]))
