"""`ServerRollout`: the generator of `rollout.mode = "server"` on a generating leader, as the trainer
sees it (a `RolloutEngine`, so weight channels, evaluation and the producer use it unchanged).

It owns the leader's server engines (`VLLMAsyncEngine`s, or any `AsyncEngine`), their event loop
thread (`LoopThread`), a `Router` over them and an `AgentRunner`. The trainer's thread calls
- `generate(prompts, sampling)`: every trajectory (`sampling.n` per prompt) run to its end by the
  agent, each its own coroutine, returned as `Response`s (prompt-major, as `RolloutEngine`);
- `run_groups(specs, sampling, needed, accept, more)`: the producer's call with a budget: groups
  finished in the order they finished (judged as they finish by `accept`, refused ones replaced
  by `more`), the rest aborted (`agent_loop.AgentRunner.run`);
- `update_weights(stream)`: pause generation -> load the verified stream -> resume, on every
  engine (the stream is replayed per engine from one host copy when there are several).

`engines` are the engines this process holds (weights, sleep, wake); `route_to(remotes)` adds
other leaders' engines (`remote.RemoteEngine`) to the router of `run_groups` only (`rollout.router
= "driver"`): their trajectories run here, their weights are loaded by their own leaders;
`generate` (validation, ReMax's baseline) keeps to this process's engines. `serve(host)` puts
this leader's engine behind the channel for a driver elsewhere (`remote.EngineServer`).
"""
from __future__ import annotations

from typing import Optional, Sequence

from mrl.errors import UserError
from mrl.rollout.agent_loop import AgentRunner, RunResult, TrajectorySpec
from mrl.rollout.engine import RolloutEngine, WeightStream
from mrl.rollout.router import Router
from mrl.rollout.types import Response, Sampling, resolve_prompt_seeds


class ServerRollout(RolloutEngine):
    def __init__(self, engines: Sequence, loop, runner: AgentRunner, *, timeout_s: Optional[float] = None):
        self.engines, self.loop, self.runner = list(engines), loop, runner
        self.router: Router = runner.router
        self.local = runner              # over this process's engines only (`generate`)
        self.timeout_s = timeout_s
        self.last: Optional[RunResult] = None   # the last call's result (its counts for the metrics)
        self.calls = 0
        self.remotes: list = []          # other leaders' engines this router also routes over
        self.server = None               # this leader's channel (`serve`)

    # --- across processes ------------------------------------------------------------------------
    def serve(self, token: str, *, host: str = "127.0.0.1", advertise: Optional[str] = None) -> str:
        """Serve this leader's engine over the channel on its loop; the URL a driver reaches it at."""
        from mrl.rollout.remote import EngineServer

        if len(self.engines) != 1:
            raise ValueError(f"a leader serves one engine, this one holds {len(self.engines)}")
        self.server = EngineServer(self.engines[0], token)
        return self.loop.run(self.server.start(host, 0, advertise))

    def route_to(self, remotes: Sequence) -> None:
        """Route `run_groups` trajectories over these engines of other leaders too (after the local
        ones). `generate` (validation, ReMax's greedy baseline) stays on this process's engines: the
        other leaders validate their own share, with weights they may still be loading."""
        import copy

        if self.runner is self.local:
            self.runner = copy.copy(self.local)
            self.runner.router = self.router = Router(list(self.engines))
        for remote in remotes:
            self.router.add(remote)
            self.remotes.append(remote)

    # --- generation ------------------------------------------------------------------------------
    def run_groups(self, specs: Sequence[TrajectorySpec], sampling: Sampling,
                   needed: Optional[int] = None, accept=None, more=None) -> RunResult:
        return self.run_many([(specs, sampling, needed, accept, more)])[0]

    def run_many(self, calls: Sequence[tuple], *, local: bool = False) -> list[RunResult]:
        """Several `run_groups` calls (their arguments) at once over the router, each with its own
        budget: the shards of one producer round (`mrl.train.server_round.server_rounds`). `local`:
        over this process's engines only."""
        import asyncio
        import concurrent.futures

        runner = self.local if local else self.runner

        async def every():
            return await asyncio.gather(*(runner.run(*call) for call in calls))

        future = asyncio.run_coroutine_threadsafe(every(), self.loop.loop)
        try:
            results = future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()   # the runners' tasks are cancelled, their requests aborted
            count = sum(len(call[0]) for call in calls)
            raise UserError(f"rollout: {count} trajectories ran longer than rollout.generate_timeout_s = "
                            f"{self.timeout_s:g} s; raise it or lower rollout.max_response_tokens") from None
        self.last = results[-1]
        return results

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: Sampling,
                 prompt_seeds: Optional[Sequence[int]] = None, images: Optional[Sequence] = None) -> list[Response]:
        """`images[i]`: prompt i's `ImageInputs` or None (VLMs), carried by each of its trajectories."""
        from mrl.rollout.types import prompt_seed

        seeds = resolve_prompt_seeds(sampling, len(prompt_token_ids), prompt_seeds)
        images = list(images) if images is not None else [None] * len(prompt_token_ids)
        n = sampling.n
        self.calls += 1   # request ids stay unique across calls
        specs = [TrajectorySpec(f"c{self.calls}p{i}r{j}", i, list(p), seed=None if seeds[i] is None else prompt_seed(seeds[i], j),
                                images=images[i])
                 for i, p in enumerate(prompt_token_ids) for j in range(n)]
        one = Sampling(**{**sampling.__dict__, "n": 1})
        result = self.run_many([(specs, one)], local=True)[0]
        return [to_response(spec.group, t) for spec, t in zip(specs, result.trajectories)]

    def sequence_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        return self.engines[0].sequence_logprobs(token_ids)

    # --- weights and memory ------------------------------------------------------------------------
    def update_weights(self, weights: WeightStream, *, partial: bool = False) -> int:
        """Pause -> update -> resume on every engine (requests in flight wait, `mode="keep"`)."""
        stream = weights if len(self.engines) == 1 else list(weights)
        sent = 0
        for engine in self.engines:
            self.loop.run(engine.pause())
            try:
                sent = engine.update_weights(iter(stream), partial=partial)
            finally:
                self.loop.run(engine.resume())
        return sent

    @property
    def accepts_sparse(self) -> bool:
        """Index/value updates are applied while the stream is consumed, inside the pause (one engine)."""
        return len(self.engines) == 1 and getattr(self.engines[0], "accepts_sparse", False)

    def apply_sparse(self, name, indices, values) -> None:
        self.engines[0].apply_sparse(name, indices, values)

    def load_unit(self, name: str) -> str:
        return self.engines[0].load_unit(name)

    def held_weights(self, names: Sequence[str]):
        return self.engines[0].held_weights(names)

    def sleep(self, level: Optional[int] = None) -> None:
        for engine in self.engines:
            engine.sleep(level)

    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        for engine in self.engines:
            engine.wake(tags)

    def shutdown(self) -> None:
        for remote in self.remotes:
            self.loop.run(remote.close(), timeout=30)
        if self.server is not None:
            import sys

            log = self.server.log
            print(f"mrl router: this leader's engine served {len(log.received)} requests for the driver "
                  f"({len(log.aborted)} aborted)", file=sys.stderr, flush=True)
            self.loop.run(self.server.stop(), timeout=30)
        for engine in self.engines:
            engine.shutdown()
        if self.runner.tools is not None:
            self.runner.tools.close()
        self.loop.close()


def to_response(prompt_index: int, t) -> Response:
    """A finished trajectory as a `Response` (an aborted one has no response yet)."""
    if t.finish_reason not in ("stop", "length"):
        raise ValueError(f"trajectory ended with {t.finish_reason!r}: not a finished response")
    return Response(prompt_index, list(t.token_ids), list(t.logprobs), t.finish_reason, loss_mask=list(t.loss_mask),
                    info=response_info(t.info))


def response_info(info: dict) -> dict:
    """What of a trajectory's `info` a `Response` carries: turn and tool counts (the agent's
    resume state stays with the trajectory)."""
    return {k: v for k, v in info.items()
            if k in ("assistant_turns", "tool_turns") or (k.startswith("tool_") and k != "tool_results")}


def build_server_rollout(spec, tokenizer, *, device, tools=None, model_path: Optional[str] = None) -> ServerRollout:
    """The leader's `ServerRollout` for a job (`rollout.mode = "server"`): one vLLM AsyncLLM on this
    rank's device (and the next `tensor_parallel - 1` on a GPU), or with `rollout.engine = "hf"` one
    `HFAsyncEngine` (`hf_async.py`) on it, the agent of
    `rollout.multi_turn.agent` or the built-in one, the job's tools (`tools`: `JobTools`)."""
    from mrl.rollout.agent_loop import AsyncTools, load_agent
    from mrl.rollout.factory import build_engine, engine_gpus, engine_model_path
    from mrl.rollout.vllm_async import LoopThread

    r = spec.rollout
    loop = LoopThread()
    try:
        if r.engine == "hf":
            from mrl.rollout.hf_async import HFAsyncEngine

            engine = HFAsyncEngine(build_engine(r, spec.model, seed=spec.job.seed, device=device,
                                                max_model_len=r.max_model_len,
                                                trainer_tensor_parallel=spec.parallel.tensor),
                                   max_num_seqs=r.max_num_seqs, max_num_batched_tokens=r.max_num_batched_tokens)
        else:
            from mrl.rollout.vllm_async import VLLMAsyncEngine

            path = model_path or engine_model_path(r, spec.model)
            gpus = engine_gpus(device, r.tensor_parallel, "rollout")
            seed = r.seed if r.seed is not None else spec.job.seed
            engine = VLLMAsyncEngine.from_config(r, path, loop=loop, seed=seed, dtype=r.dtype or spec.model.dtype,
                                                 max_model_len=r.max_model_len, gpus=gpus, on_cpu=gpus is None)
    except BaseException:
        loop.close()
        raise
    mt = r.multi_turn
    kw = {}
    if mt.enable:
        from mrl.rollout.tool_formats import resolve_format
        from mrl.rollout.tools import ToolRunner
        from mrl.rollout.turns import TurnTemplate

        runner = tools.runner if tools is not None and tools.runner is not None else ToolRunner.from_config(mt)
        origin = spec.model.tokenizer or spec.model.path
        kw = dict(tools=AsyncTools(runner), tokenizer=tokenizer, multi_turn=mt,
                  turns=TurnTemplate(tokenizer, runner.schemas(), origin=origin),
                  format=resolve_format(mt.format, getattr(tokenizer, "chat_template", None), origin))
    agents = AgentRunner(Router([engine]), load_agent(mt.agent), **kw)
    return ServerRollout([engine], loop, agents, timeout_s=r.generate_timeout_s)
