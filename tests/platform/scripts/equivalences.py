"""The platform's layout checks in one 2-rank launch, one after another (each brings the platform
up and down): TP2 = TP1, PP2 = PP1, MoE EP2 = EP1, the optimizer step across layouts, and a
checkpoint saved at TP2 loaded at TP1 (into the empty directory argv[1]). Each check asserts its
own comparisons and prints its `MAXDIFF` lines, as when its script runs alone."""
import sys

import _common as C
import ckpt_roundtrip
import ep_equivalence
import optim_equivalence
import pp_equivalence
import tp_equivalence


def main(ckpt_dir: str) -> None:
    for check in (tp_equivalence, pp_equivalence, ep_equivalence, optim_equivalence):
        check.main()
    ckpt_roundtrip.main(ckpt_dir)


if __name__ == "__main__":
    C.main_guard(lambda: main(sys.argv[1]))
