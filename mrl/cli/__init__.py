"""The `mrl` command: `main` parses the command line (`parser.py`, one module per command or small
family) and turns errors into exit codes.

Exit codes: 0 success; 2 a user error (bad spec, data, reward function or command line), printed
as one line per problem with no traceback; 1 an internal error, printed with its traceback, or a
collective that timed out, printed as one line naming the stage.
"""
from __future__ import annotations

import sys
import traceback

from mrl.cli.parser import build_parser
from mrl.errors import CollectiveTimeout, UserError

REPORT_GRACE_S = 3.0   # how long a failing rank waits to learn whether a lower rank failed too


def _error_store():
    """The launcher's key-value store, reachable without a working process group: the one mrl's
    platform set up, else torchrun's agent store; None when neither is there."""
    import datetime
    import os

    from mrl.platform import dist as mrl_dist

    store = getattr(mrl_dist._STATE, "base_store", None)
    if store is not None:
        return store
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("MASTER_ADDR"):
        import torch.distributed as dist

        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=REPORT_GRACE_S), multi_tenant=True)
    return None


def _first_to_report() -> bool:
    """Whether this rank prints a user error: always in a one-rank run; under torchrun/srun only the
    lowest failing rank does (each failing rank marks itself in the launcher's store, then stays
    quiet if a lower rank is marked within REPORT_GRACE_S). Without a store every rank prints."""
    import os
    import time

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world <= 1:
        return True
    try:
        store = _error_store()
        if store is None:
            return True
        store.set(f"mrl/user_error/{rank}", "1")
        lower = [f"mrl/user_error/{r}" for r in range(rank)]
        deadline = time.monotonic() + REPORT_GRACE_S
        while lower:
            if any(store.check([k]) for k in lower):
                return False
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return True
    except Exception:   # the store is gone (its host rank exited): better twice than never
        return True


def main(argv: list[str] | None = None) -> int:
    from mrl.platform.quiet import quiet_known_warnings

    quiet_known_warnings()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command in ("eval", "generate") and all("=" in a and not a.startswith("-") for a in extra):
        args.items, extra = [*args.items, *extra], []   # overrides after the options
    if extra:   # only `mrl convert` passes verl's own flags on (a pasted `python3 -m verl.trainer.main_ppo ...`)
        if args.command != "convert":
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.items = [*args.items, *extra]
    try:
        return args.func(args)
    except UserError as e:
        if _first_to_report():
            for line in e.problems:
                print(f"error: {line}", file=sys.stderr)
        return 2
    except CollectiveTimeout as e:  # a hang turned into an error: the message names the stage
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception:  # an mrl bug: show everything
        traceback.print_exc()
        return 1
