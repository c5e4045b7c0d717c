"""A user agent for the server-mode tests (loaded by `rollout.multi_turn.agent` reference)."""
from mrl.rollout.agent_loop import Trajectory


async def twice(ctx) -> Trajectory:
    """Two engine calls: the second continues the first, with a fixed text appended between them (mask 0)."""
    t = ctx.trajectory
    for k in range(2):
        out = await ctx.generate(list(ctx.prompt_ids) + t.token_ids)
        t.add(out.token_ids, out.logprobs, 1)
        t.finish_reason = out.finish_reason
        if out.finish_reason == "abort" or k:
            return t
        t.add([7, 7], [0.0, 0.0], 0)
    return t


def not_async(ctx):
    return None
