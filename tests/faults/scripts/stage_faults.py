"""A rank stopped at a collective: the survivor's error names the stage (usage: stage_faults.py DIR).

For each case rank 1 stays away (sleeps past the 4 s collective timeout) while rank 0 runs the
stage alone; rank 0 must raise `CollectiveTimeout` naming the stage within the timeout (plus
slack), not gloo's bare "Timed out waiting" traceback. Both ranks then bring up a fresh process
group for the next case. Prints `FAULT <case> handled|lost <message>` on rank 0."""
import os
import sys
import time
from pathlib import Path

import torch

from mrl.errors import CollectiveTimeout
from mrl.models import tiny_model as tm
from mrl.platform import setup, teardown
from mrl.platform.config import ParallelConfig, PlatformConfig

TIMEOUT_S = 4.0
SPEC = tm.TinyGPTSpec(num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=1,
                      ffn_hidden_size=16, vocab_size=32, seq_length=4)


def up(timeout_s: float = TIMEOUT_S):
    return setup(PlatformConfig(device="cpu", nodes=1, ranks_per_node=2, collective_timeout_s=timeout_s),
                 ParallelConfig(tensor=2), seed=1)


def case_checkpoint_save(base: Path):
    from mrl import checkpoint

    checkpoint.save(base / "save", 1, chunks=[tm.build_tiny_gpt(SPEC)])


def case_checkpoint_load(base: Path):
    from mrl import checkpoint

    checkpoint.find_resumable(base / "intact")


def case_metrics_all_gather(base: Path):
    from mrl.train.metrics import reduce_over_ranks

    reduce_over_ranks({"reward/mean": 1.0}, dp=1)


def case_rollout_generation(base: Path):
    from mrl.platform.dist import wait_for_peers

    wait_for_peers("rollout generation")


def case_reward_scoring(base: Path):
    from mrl.platform.dist import wait_for_peers

    wait_for_peers("reward scoring")


CASES = {"checkpoint_save": ("checkpoint save", case_checkpoint_save),
         "checkpoint_load": ("checkpoint load", case_checkpoint_load),
         "metrics_all_gather": ("metrics all-gather", case_metrics_all_gather),
         "rollout_generation": ("rollout generation", case_rollout_generation),
         "reward_scoring": ("reward scoring", case_reward_scoring)}


def main(base):
    from mrl import checkpoint
    from mrl.platform.dist import create_wait_group

    base = Path(base)
    ctx = up(120.0)   # a real save (a busy machine may need more than the cases' 4 s)
    checkpoint.save(base / "intact", 1, chunks=[tm.build_tiny_gpt(SPEC)])   # for the load case
    teardown()
    for name, (stage_name, run) in CASES.items():
        ctx = up()
        create_wait_group(TIMEOUT_S + 2.0)   # a leader's bounded work: 2 s here
        if ctx.rank == 1:
            time.sleep(TIMEOUT_S + 6.0)    # stopped: never joins this case's collective
        else:
            t0 = time.monotonic()
            try:
                run(base)
                ok, line = False, "no error"
            except CollectiveTimeout as e:
                line = str(e).splitlines()[0]
                ok = f"stage '{stage_name}'" in line and time.monotonic() - t0 < TIMEOUT_S + 5.0
            except Exception as e:  # noqa: BLE001 - reported as lost
                ok, line = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"FAULT stopped_rank_in_{name} {'handled' if ok else 'lost'} {line[:220]}", flush=True)
            time.sleep(max(0.0, TIMEOUT_S + 6.5 - (time.monotonic() - t0)))   # let rank 1 come back
        teardown()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
