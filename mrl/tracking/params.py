"""A resolved job spec as flat MLflow params: dotted keys -> strings."""
from __future__ import annotations

import json
from typing import Any

from mrl.schema.dump import to_dict

MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value


def flatten(tree: dict, prefix: str = "", limit: int | None = MAX_PARAM_CHARS) -> dict[str, str]:
    """{"a": {"b": 1}, "c": [1, 2]} -> {"a.b": "1", "c": "[1, 2]"}; lists (and tables inside them) as JSON.

    Values longer than `limit` (MLflow's param length) are cut with "..."; `limit=None` keeps them whole.
    """
    out: dict[str, str] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + ".", limit=None))
        elif isinstance(value, (list, tuple, dict)):
            out[dotted] = json.dumps(value, default=str)
        else:
            out[dotted] = str(value).lower() if isinstance(value, bool) else str(value)
    if limit is None:
        return out
    return {k: v if len(v) <= limit else v[:limit - 3] + "..." for k, v in out.items()}


def spec_params(spec: Any) -> dict[str, str]:
    """Every set key of a resolved spec (see `mrl show`) as a dotted param."""
    return flatten(to_dict(spec))
