"""The engine's equivalence checks in one 2-rank launch, one after another (each brings the
platform up and down): gradients independent of micro-batch split, DP, TP and PP
(`engine_equivalence`); the critic's value head (`critic_equivalence`); packed RoPE with heads
split over TP2 (`rope_tp_equivalence`); update epochs and mini-batches equal steps by hand
(`update_equivalence`); MoE EP2 = EP1 (`moe_equivalence`); the LM head at the response positions
only equals it over the whole row at DP2, TP2, PP2 and CP2 (`head_rows_equivalence`). Each asserts its own comparisons and
prints its `MAXDIFF` lines, as when its script runs alone."""
import critic_equivalence
import engine_equivalence
import head_rows_equivalence
import moe_equivalence
import rope_tp_equivalence
import update_equivalence
from _engine_common import C


def main() -> None:
    for check in (engine_equivalence, critic_equivalence, rope_tp_equivalence, update_equivalence, moe_equivalence,
                  head_rows_equivalence):
        check.main()


if __name__ == "__main__":
    C.main_guard(main)
