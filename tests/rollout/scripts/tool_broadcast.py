"""Two ranks of one engine: tools run on the group's first rank, every rank sees its results."""
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from mrl.rollout.engine import engine_group  # noqa: E402
from mrl.rollout.multi_turn import MultiTurnRollout  # noqa: E402
from mrl.rollout.tools import ToolRunner  # noqa: E402
from mrl.rollout.types import Sampling  # noqa: E402
from tests.rollout.test_multi_turn import TOK, TOOLS, ScriptedEngine, call  # noqa: E402

if __name__ == "__main__":
    dist.init_process_group("gloo")
    group, src = engine_group(2)
    mt = MultiTurnRollout(ScriptedEngine([call("which_rank"), "ok"]), TOK, ToolRunner([f"{TOOLS}:which_rank"]),
                          group=group, group_src=src)
    [r] = mt.generate([[65]], Sampling(max_tokens=500))
    tool_text = TOK.decode([t for t, m in zip(r.token_ids, r.loss_mask) if m == 0])
    assert "rank 0" in tool_text and "rank 1" not in tool_text, tool_text
    out = [None, None]
    dist.all_gather_object(out, r.token_ids)
    assert out[0] == out[1]
    print(f"rank {dist.get_rank()} ok", flush=True)
    dist.destroy_process_group()
