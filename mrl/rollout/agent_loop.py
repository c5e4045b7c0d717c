"""Server-mode rollouts: one coroutine per trajectory (the agent loop), over a `Router`.

Each trajectory is its own task running an agent, `async def agent(ctx) -> Trajectory`: it
calls `await ctx.generate(ids, sampling)` for each turn (token ids in, token ids and log-probs
out; the router keeps the trajectory on one engine), runs tools with `await ctx.tools.run(calls)`
(in threads, while every other trajectory keeps generating), and appends to `ctx.trajectory`:
sampled tokens with loss mask 1 and their log-probs, everything else (tool turns) with mask 0 and
log-prob 0. `tool_agent` is the built-in agent, the lockstep loop's rules (`multi_turn.py`) one
conversation at a time; `single_turn` generates once. A job names its own agent in
`rollout.multi_turn.agent` ("path/file.py:function", docs/multi_turn.md).

Budgets (`AgentRunner.run`): with `needed`, once that many groups have finished (and been
accepted by `accept`, dynamic sampling's filter, which judges each group as it finishes; `more`
starts a group in place of each refused one) every other trajectory is aborted, from the
coroutine of the trajectory that completed the need: a request in the engine returns what it has
(`finish_reason = "abort"`), an agent waiting for its tools is cancelled (its trajectory stays as
it was before the call, with `info["pending_tools"]`), and a trajectory not yet started stays
empty. Aborted trajectories are
partial rollouts: the caller carries them to a later step, where `resume` continues them (the
same agent, from `ctx.trajectory` as it was left).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import math
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Optional, Sequence

from mrl.errors import UserError
from mrl.rollout.async_engine import GenRequest, GenResult
from mrl.rollout.router import Router
from mrl.rollout.types import Sampling, prompt_seed


@dataclass
class Trajectory:
    """One trajectory's response so far: `token_ids` after the prompt, each with its `logprobs`
    entry and `loss_mask` (1 sampled, 0 not), `finish_reason` ("stop", "length" or "abort"),
    `info` (turn counters, tool counts; the built-in agent's resume state)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    info: dict = field(default_factory=dict)

    def add(self, ids: Sequence[int], logprobs: Sequence[float], mask: int) -> None:
        if len(ids) != len(logprobs):
            raise ValueError("a trajectory segment needs one log-prob per token")
        self.token_ids += list(ids)
        self.logprobs += list(logprobs)
        self.loss_mask += [mask] * len(ids)


class AsyncTools:
    """The job's tools for agents: `schemas()`, and `await run(calls)` in a thread of a pool, so a
    slow tool holds only the trajectory that called it."""

    def __init__(self, runner, threads: int = 64):
        self.runner = runner
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="mrl-agent-tools")

    def schemas(self) -> list[dict]:
        return self.runner.schemas()

    async def run(self, calls):
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.runner.run, list(calls))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class AgentContext:
    """What an agent gets: the prompt, the sampling (`max_tokens`: the whole response's budget),
    the tools (None without), the multi-turn settings and chat-template helpers the built-in agent
    uses, and the live `trajectory` (a resumed one holds what earlier steps generated)."""

    key: str
    prompt_ids: list[int]
    sampling: Sampling
    trajectory: Trajectory
    router: Router
    seed: Optional[int] = None
    tools: Optional[AsyncTools] = None
    tokenizer: Any = None
    turns: Any = None          # mrl.rollout.turns.TurnTemplate
    format: Any = None         # mrl.rollout.tool_formats.ToolFormat
    multi_turn: Any = None     # the rollout.multi_turn section
    phase: str = "idle"        # "generate" or "tools" while the agent waits for one
    images: Any = None         # the prompt's images (VLMs): every request of the trajectory carries them

    @property
    def remaining(self) -> int:
        """Tokens the response may still grow by."""
        return self.sampling.max_tokens - len(self.trajectory.token_ids)

    async def generate(self, ids: Sequence[int], sampling: Optional[Sampling] = None) -> GenResult:
        """Continue `ids` (the whole context: prompt and trajectory so far) by one engine request.
        Each call of a trajectory samples from its own seed (the trajectory's and its call count)."""
        sampling = sampling or replace(self.sampling, max_tokens=max(self.remaining, 1))
        calls = self.trajectory.info.get("engine_calls", 0)
        self.trajectory.info["engine_calls"] = calls + 1
        seed = None if self.seed is None else prompt_seed(self.seed, calls) % 2**31
        request = GenRequest(f"{self.key}-{calls}", tuple(ids), replace(sampling, n=1, seed=None), seed=seed,
                             images=self.images)
        self.phase = "generate"
        try:
            return await self.router.generate(self.key, request)
        finally:
            self.phase = "idle"

    async def run_tools(self, calls):
        self.phase = "tools"
        try:
            return await self.tools.run(calls)
        finally:
            self.phase = "idle"


Agent = Callable[[AgentContext], Awaitable[Trajectory]]


async def single_turn(ctx: AgentContext) -> Trajectory:
    """One assistant turn (a resumed trajectory continues it)."""
    t = ctx.trajectory
    out = await ctx.generate(list(ctx.prompt_ids) + t.token_ids)
    t.add(out.token_ids, out.logprobs, 1)
    t.finish_reason = out.finish_reason
    return t


async def tool_agent(ctx: AgentContext) -> Trajectory:
    """The built-in tool loop: generate, parse the turn's tool calls, run them, append the chat
    template's tool turn (mask 0), generate again; the lockstep loop's rules (`multi_turn.py`,
    `rollout.multi_turn` keys) for one conversation."""
    from mrl.rollout.multi_turn import tool_messages
    from mrl.rollout.tools import tool_counts

    t, mt = ctx.trajectory, ctx.multi_turn
    info = t.info
    for key in ("assistant_turns", "tool_turns", "turn_start"):
        info.setdefault(key, 0)
    results = info.setdefault("tool_results", [])

    def finish(reason: str) -> Trajectory:
        t.finish_reason = reason
        info.update(tool_counts(_decoded(results)))
        return t

    while True:
        if not info.get("pending_tools"):
            if ctx.remaining <= 0:
                return finish("length")
            out = await ctx.generate(list(ctx.prompt_ids) + t.token_ids)
            t.add(out.token_ids, out.logprobs, 1)
            if out.finish_reason == "abort":
                return finish("abort")
            info["assistant_turns"] += 1
            if out.finish_reason == "length":
                return finish("length")
            turn = t.token_ids[info["turn_start"]:]
            pending = ctx.format.parse_with_ids(ctx.tokenizer.decode(turn))
            out_of_turns = mt.max_assistant_turns is not None and info["assistant_turns"] >= mt.max_assistant_turns
            out_of_tool_turns = mt.max_user_turns is not None and info["tool_turns"] >= mt.max_user_turns
            if not pending or out_of_turns or out_of_tool_turns or ctx.remaining <= 0:
                return finish("stop")
            info["pending_tools"] = True
        turn = t.token_ids[info["turn_start"]:]
        pending = ctx.format.parse_with_ids(ctx.tokenizer.decode(turn))[:mt.max_parallel_calls]
        from mrl.rollout.tools import ToolCall

        runnable = [k for k, (call, _) in enumerate(pending) if isinstance(call, ToolCall)]
        ran = await ctx.run_tools([pending[k][0] for k in runnable]) if runnable else []
        got: list = [None] * len(pending)
        for k, res in zip(runnable, ran):
            got[k] = res
        messages, used = tool_messages(ctx.tokenizer, pending, got, info["tool_turns"], mt.max_tool_response_tokens,
                                       mt.tool_response_truncate_side)
        results += [r.status + ":" + r.error + (":cut" if r.truncated else "") + (":restarted" if r.restarted else "")
                    for r in used]
        obs = ctx.turns.tool_turn_ids(turn, messages)
        room = ctx.remaining
        t.add(obs[:room], [0.0] * min(len(obs), room), 0)
        info["tool_turns"] += 1
        info["pending_tools"] = False
        info["turn_start"] = len(t.token_ids)
        if len(obs) >= room:
            return finish("length")


def _decoded(results: list[str]):
    """`ToolResult`-like views of the compact result records a trajectory keeps (plain strings, so
    a carried trajectory checkpoints as plain values)."""
    from mrl.rollout.tools import ToolResult

    out = []
    for r in results:
        status, error, *flags = r.split(":")
        out.append(ToolResult("", status, 0.0, error, truncated="cut" in flags, restarted="restarted" in flags))
    return out


def load_agent(ref: Optional[str]) -> Optional[Agent]:
    """The agent a job names (`rollout.multi_turn.agent`), or None (the built-in one)."""
    if ref is None:
        return None
    from mrl.reward.function import load_function

    fn = load_function(ref, "rollout.multi_turn.agent")
    fn = getattr(fn, "__wrapped__", fn)   # load_function wraps coroutine functions for synchronous callers
    if not asyncio.iscoroutinefunction(fn):
        raise UserError(f"rollout.multi_turn.agent: {ref} is not an `async def` function taking the agent context")
    return fn


@dataclass
class TrajectorySpec:
    """One trajectory to run: `key` unique in the call (its request ids and router stickiness),
    `group` its prompt's index, `resume` what an earlier step generated (None: a new one)."""

    key: str
    group: int
    prompt_ids: list[int]
    seed: Optional[int] = None
    resume: Optional[Trajectory] = None
    images: Any = None   # the prompt's `mrl.data.images.ImageInputs` (VLMs): sent with every turn's request


@dataclass
class RunResult:
    trajectories: list[Trajectory]   # in the order of the specs (then of the specs `more` added)
    finished_groups: list[int]       # groups finished and accepted (none aborted), in the order they finished
    aborted: int                     # trajectories that ended aborted (by the budget, or an engine's abort)
    engine_busy: float               # the router's busy fraction over the call
    seconds: float
    rejected_groups: list[int] = field(default_factory=list)   # finished, refused by `accept`, in order
    specs: list[TrajectorySpec] = field(default_factory=list)  # every spec run: the call's, then `more`'s


#: `accept(group, trajectories)`: whether a finished group counts (dynamic sampling's filter)
Accept = Callable[[int, list[Trajectory]], bool]
#: `more()`: the specs of one more group to start when a group was refused (empty: none left)
More = Callable[[], list[TrajectorySpec]]


class AgentRunner:
    """Runs trajectories as tasks over a router (see the module docstring)."""

    def __init__(self, router: Router, agent: Optional[Agent] = None, *, tools: Optional[AsyncTools] = None,
                 tokenizer=None, turns=None, format=None, multi_turn=None):
        self.router, self.tools = router, tools
        self.agent = agent or (tool_agent if multi_turn is not None and multi_turn.enable else single_turn)
        self.tokenizer, self.turns, self.format, self.multi_turn = tokenizer, turns, format, multi_turn

    def context(self, spec: TrajectorySpec, sampling: Sampling) -> AgentContext:
        traj = spec.resume if spec.resume is not None else Trajectory()
        return AgentContext(spec.key, list(spec.prompt_ids), sampling, traj, self.router, seed=spec.seed,
                            tools=self.tools, tokenizer=self.tokenizer, turns=self.turns, format=self.format,
                            multi_turn=self.multi_turn, images=spec.images)

    async def run(self, specs: Sequence[TrajectorySpec], sampling: Sampling, needed: Optional[int] = None,
                  accept: Optional[Accept] = None, more: Optional[More] = None) -> RunResult:
        """Run every trajectory of `specs`; with `needed`, abort the rest once `needed` groups
        (every trajectory of a group finished, none aborted) have finished and been accepted.

        `accept(group, trajectories)` judges each group as it finishes (dynamic sampling), in this
        loop's thread, so the order of events does not depend on the judge's timing; a refused
        group does not count, and `more()` gives a group to start in its place at once (the
        groups are taken as they finish, not in rounds)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.router.reset_clock()
        specs = list(specs)
        contexts = [self.context(s, sampling) for s in specs]
        by_group: dict[int, list[int]] = {}
        left: dict[int, int] = {}
        finished: list[int] = []
        rejected: list[int] = []
        enough = asyncio.Event()
        if needed is not None and needed <= 0:   # nothing needed: every trajectory stays as it is
            for c in contexts:
                c.trajectory.finish_reason = "abort"
                self.router.release(c.key)
            return RunResult([c.trajectory for c in contexts], [], len(contexts), self.router.busy_fraction(),
                             loop.time() - started, specs=specs)
        tasks: list = []

        def start(new: Sequence[TrajectorySpec]) -> None:
            for s in new:
                i = len(tasks)
                if i >= len(specs):
                    specs.append(s)
                    contexts.append(self.context(s, sampling))
                by_group.setdefault(s.group, []).append(i)
                left[s.group] = left.get(s.group, 0) + 1
                tasks.append(asyncio.ensure_future(one(i, contexts[i])))

        async def cut(me: Optional[int]) -> None:
            """Abort every trajectory still running (all but `me`, the one that just finished)."""
            late = [i for i, task in enumerate(tasks) if not task.done() and i != me]
            await self.router.abort([contexts[i].key for i in late])
            for i in late:
                if contexts[i].phase != "generate":   # waiting for tools (or not started): stop it here
                    tasks[i].cancel()

        async def one(i: int, ctx: AgentContext) -> Trajectory:
            out = await self.agent(ctx)
            if not isinstance(out, Trajectory):
                raise TypeError(f"the agent returned {type(out).__name__}, not a Trajectory")
            g = specs[i].group
            if out.finish_reason != "abort":
                left[g] -= 1
                if left[g] == 0:
                    group = [out if k == i else contexts[k].trajectory for k in by_group[g]]
                    if accept is not None and not accept(g, group):
                        rejected.append(g)
                        if more is not None and not enough.is_set():
                            start(more())
                    else:
                        finished.append(g)
                        if needed is not None and len(finished) == needed:
                            # abort the rest now, from the finishing trajectory itself: the engines
                            # stop them where they are, not a few scheduler steps later
                            enough.set()
                            await cut(i)
            return out

        start(specs)
        try:
            while True:
                pending = [t for t in tasks if not t.done()]
                if not pending:
                    break
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    if not task.cancelled() and task.exception() is not None:
                        raise task.exception()
            out = []
            for i, task in enumerate(tasks):
                if task.cancelled():
                    contexts[i].trajectory.finish_reason = "abort"
                    out.append(contexts[i].trajectory)
                else:
                    out.append(task.result())
            aborted = sum(t.finish_reason == "abort" for t in out)
            return RunResult(out, finished, aborted, self.router.busy_fraction(), loop.time() - started,
                             rejected_groups=rejected, specs=specs)
        finally:
            for task in tasks:
                task.cancel()
            for c in contexts:
                self.router.release(c.key)


def groups_to_submit(needed: int, over_sample_rate: float) -> int:
    """Groups submitted for `needed` (verl's over_sample_rate): ceil((1 + rate) x needed)."""
    return math.ceil(needed * (1 + over_sample_rate) - 1e-9)
