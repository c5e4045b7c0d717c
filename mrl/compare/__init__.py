"""`mrl compare`: MLflow runs side by side.

    mrl compare runs/a runs/b                       # run directories (their mlflow.db)
    mrl compare --tracking-uri URI RUN_ID NAME EXP  # ids, run names or experiment names
    mrl compare runs/a runs/b --metrics reward,kl --out plots/

Prints the differences between the runs' resolved specs (and other params), the final and best
value of each chosen metric, and writes one PNG per metric with every run overlaid.

Modules: `select` (arguments -> runs in one or more stores), `data` (params and metric
histories), `metrics` (metric groups, which way is better, final/best), `plot` (matplotlib PNGs),
`report` (rich tables and the whole command).
"""
from mrl.compare.report import Comparison, compare

__all__ = ["Comparison", "compare"]
