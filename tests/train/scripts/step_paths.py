"""The path of step 1 through `mrl/train/` (`tools/step_path.py`) for several override sets of the
quickstart, in this one process (the first builds and imports; the others reuse them).

    python step_paths.py OUT_DIR 'key=value ...' ['key=value ...' ...]

Prints one `PATH <index> <json [[site, place], ...]>` line per override set.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))


def main() -> None:
    import step_path

    out = Path(sys.argv[1])
    for i, overrides in enumerate(sys.argv[2:]):
        trace = step_path.step_path(overrides=tuple(overrides.split()), out=str(out / f"run{i}"))
        print(f"PATH {i} {json.dumps(trace.entries)}", flush=True)


if __name__ == "__main__":
    main()
