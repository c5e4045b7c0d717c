"""The algorithm modules of mrl.algos depend on nothing else in mrl (only torch and the stdlib).

`mrl/algos/config.py` (the job-spec section for these options) is the exception: it belongs to
the config layer and is not imported by the algorithm modules."""
import ast
import sys
from pathlib import Path

import mrl.algos

ALGOS = Path(mrl.algos.__file__).parent


def test_algos_imports_only_torch_stdlib_and_itself():
    allowed_roots = {"torch", "__future__", "typing", "math", "collections", "dataclasses", "enum", "functools"}
    for path in sorted(p for p in ALGOS.glob("*.py") if p.name != "config.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level > 0:
                    assert node.level == 1 and node.module != "config", f"{path.name}: imports {node.module}"
                    continue
                roots = [node.module.split(".")[0]]
            elif isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            else:
                continue
            for root in roots:
                assert root in allowed_roots or root in sys.stdlib_module_names, f"{path.name} imports {root}"
                assert root != "mrl", f"{path.name} imports mrl"


def test_public_surface():
    from mrl.algos import advantages, correction, dapo, kl, losses
    for mod, names in [(advantages, ["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax"]),
                       (losses, ["ppo", "gspo", "cispo", "sapo", "aggregate", "value"]),
                       (kl, ["estimate"]), (correction, ["weights"]),
                       (dapo, ["overlong_penalty", "keep_groups"])]:
        for name in names:
            assert callable(getattr(mod, name)), f"{mod.__name__}.{name}"
