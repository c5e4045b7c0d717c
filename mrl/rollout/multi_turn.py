"""Multi-turn rollouts with tool calls; tool output is context, not policy, so its loss mask is 0.

Loop, per conversation (all conversations of a call advance together, one engine call per turn):
  1. the engine samples an assistant turn (up to the remaining response budget);
  2. tool calls are parsed from the turn's text by the format's parser (`tool_formats.py`:
     hermes, llama3_json, mistral, or the one the chat template writes);
  3. without calls, or when the turn hit the budget, the conversation ends; otherwise the tools
     run (first `max_parallel_calls` calls of the turn, in parallel, with a timeout) and their
     results become tool messages; the chat template's tokens for them and for the next
     assistant header (`turns.TurnTemplate`) are appended with loss mask 0 and log-prob 0;
  4. repeat until `max_assistant_turns` assistant turns or `max_user_turns` tool turns.
The response is everything after the prompt: assistant tokens (mask 1, engine log-probs), exactly
the ids the engine produced and never re-tokenized, and tool tokens (mask 0).
`rollout.max_response_tokens` bounds the whole response.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Protocol, Sequence

from mrl.errors import UserError
from mrl.rollout.engine import RolloutEngine
from mrl.rollout.tool_formats import HermesFormat, resolve_format  # noqa: F401 - HermesFormat re-exported
from mrl.rollout.tools import ToolCall, ToolResult, ToolRunner, tool_counts
from mrl.rollout.turns import TurnTemplate
from mrl.rollout.types import Response, Sampling, prompt_seed, resolve_prompt_seeds, routes_to


class Tokenizer(Protocol):
    chat_template: Optional[str]

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def apply_chat_template(self, conversation: list[dict], **kwargs) -> Any: ...


@dataclass
class _Conversation:
    prompt_index: int
    row: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    done: bool = False
    assistant_turns: int = 0
    tool_turns: int = 0
    results: list[ToolResult] = field(default_factory=list)
    pending: list = field(default_factory=list)  # (call or error text, call id) of the last assistant turn
    last_turn: list[int] = field(default_factory=list)  # ids the engine produced in the last assistant turn
    routes: Any = None   # MoE routes of the last assistant turn's call (prompt + tokens so far)
    images: Any = None   # the prompt's `ImageInputs` (VLMs): every assistant turn's call carries them

    def add(self, ids: Sequence[int], logprobs: Sequence[float], mask: int) -> None:
        self.tokens += ids
        self.logprobs += logprobs
        self.mask += [mask] * len(ids)


def lists_tools(spec) -> bool:
    """Whether a job's prompts list tools through the chat template: multi-turn on, prompts
    chat-rendered, and some tool configured."""
    mt = spec.rollout.multi_turn
    return bool(mt.enable and spec.data.chat_template and (mt.tools or mt.servers or mt.tool_config))


def prompt_tools(spec, schemas: Optional[list[dict]] = None) -> Optional[list[dict]]:
    """The function schemas a job's prompts list through the chat template (`tools=`) when
    `lists_tools(spec)`, else None. `schemas`: those already listed (`JobTools.schemas`); without
    them the tools are connected to list them, then closed (a one-off: a run lists them once, in
    `job_tools`)."""
    if not lists_tools(spec):
        return None
    return schemas if schemas is not None else _listed_once(spec.rollout.multi_turn)


@dataclass
class JobTools:
    """A job's tools on one rank: `runner` (its servers connected) on the ranks that call tools,
    None elsewhere; `schemas`, every tool's schema, on every rank (None: multi-turn off);
    `prompt_schemas`, what the prompts' chat template lists (`prompt_tools`)."""

    runner: Optional[ToolRunner] = None
    schemas: Optional[list[dict]] = None
    prompt_schemas: Optional[list[dict]] = None

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


def job_tools(spec, *, calls_tools: bool) -> JobTools:
    """This rank's `JobTools`, each server connected (and its tools listed) once per rank that calls
    tools (`calls_tools`) and nowhere else. Collective over this role's world when tools are
    configured: rank 0 lists them (with its own runner, or a runner closed at once where it calls no
    tools) and broadcasts the schemas, so the other ranks render prompts and tool turns without
    connecting; a server rank 0 cannot reach is the same one-line `UserError` on every rank."""
    from mrl.platform.collectives import broadcast_object

    mt = spec.rollout.multi_turn
    if not mt.enable:
        return JobTools()
    if not (mt.tools or mt.servers or mt.tool_config):   # nothing to list
        return JobTools(ToolRunner.from_config(mt) if calls_tools else None, [], prompt_tools(spec, []))
    import torch.distributed as dist

    first = not dist.is_initialized() or dist.get_rank() == 0
    runner, listed = None, None
    if first:
        try:
            runner = ToolRunner.from_config(mt) if calls_tools else None
            listed = ("ok", runner.schemas() if runner is not None else _listed_once(mt))
        except UserError as e:
            listed = ("error", str(e))
    status, payload = broadcast_object(listed, "tool schemas")
    if status == "error":
        raise UserError(payload)
    if calls_tools and runner is None:
        runner = ToolRunner.from_config(mt)
    return JobTools(runner, payload, prompt_tools(spec, payload))


def _listed_once(mt) -> list[dict]:
    """The schemas of a `rollout.multi_turn` section's tools, its servers connected, listed and closed."""
    runner = ToolRunner.from_config(mt)
    try:
        return runner.schemas()
    finally:
        runner.close()


def _truncate(ids: list[int], limit: int, side: str) -> list[int]:
    if len(ids) <= limit:
        return ids
    if side == "left":  # keep the end
        return ids[len(ids) - limit:]
    if side == "right":  # keep the start
        return ids[:limit]
    head = (limit + 1) // 2
    return ids[:head] + ids[len(ids) - (limit - head):]


def tool_messages(tokenizer, pending: list, results: list, tool_turns: int, max_tokens: int,
                  side: str) -> tuple[list[dict], list[ToolResult]]:
    """The tool messages of one tool turn and the results they carry: `pending` is the turn's
    (call or error text, call id) list, `results[k]` the `ToolResult` of call k (None for a
    malformed call, which becomes its error text). Each answer is cut to `max_tokens` tokens
    (`side`: where), shared by the lockstep loop and the agent loop (`agent_loop.tool_agent`)."""
    messages, used = [], []
    for k, (call, call_id) in enumerate(pending):
        res = results[k] or ToolResult(str(call), "error", 0.0, "malformed")
        used.append(res)
        ids = _truncate(list(tokenizer.encode(res.text, add_special_tokens=False)), max_tokens, side)
        message = {"role": "tool", "content": tokenizer.decode(ids),
                   "tool_call_id": call_id or f"call{tool_turns % 100:02d}{k:03d}"}  # 9 characters (Mistral)
        if isinstance(call, ToolCall):
            message["name"] = call.name
        messages.append(message)
    return messages, used


class MultiTurnRollout:
    """Tool-calling rollouts over any `RolloutEngine` (configured by `rollout.multi_turn`)."""

    def __init__(self, engine: RolloutEngine, tokenizer: Tokenizer, tools: Optional[ToolRunner], *,
                 max_assistant_turns: Optional[int] = None, max_user_turns: Optional[int] = None,
                 max_parallel_calls: int = 1, max_tool_response_tokens: int = 256,
                 tool_response_truncate_side: str = "middle", format: str = "hermes", group=None, group_src: int = 0,
                 origin: str = "the tokenizer", schemas: Optional[list[dict]] = None):
        """`tools`: the runner, or None on the ranks of an engine group other than `group_src`
        (they never call tools), which take the tools' `schemas` instead."""
        if tools is None and (group is None or schemas is None):
            raise ValueError("MultiTurnRollout: without a ToolRunner, a rank of an engine group (group=) takes "
                             "the tools' schemas= from the group's source rank, which runs them")
        self.engine, self.tokenizer, self.tools = engine, tokenizer, tools
        self.format = resolve_format(format, getattr(tokenizer, "chat_template", None), origin)
        self.turns = TurnTemplate(tokenizer, tools.schemas() if tools is not None else schemas, origin=origin)
        for note in self.turns.notes:
            print(f"mrl multi-turn: {note}", file=sys.stderr)
        self.max_assistant_turns = max_assistant_turns
        self.max_user_turns = max_user_turns
        self.max_parallel_calls = max_parallel_calls
        self.max_tool_response_tokens = max_tool_response_tokens
        self.truncate_side = tool_response_truncate_side
        # With an engine of several ranks (vllm TP), tools run on `group_src` only and the results
        # are broadcast, so every rank of the engine feeds it identical contexts.
        self.group, self.group_src = group, group_src
        self._prompt_seeds: Optional[list[int]] = None   # of the running generate call

    @classmethod
    def from_config(cls, engine: RolloutEngine, tokenizer: Tokenizer, cfg, *, group=None,
                    group_src: int = 0, origin: str = "the tokenizer",
                    tools: Optional[JobTools] = None) -> "MultiTurnRollout":
        """From a `rollout.multi_turn` section; `group`, `group_src` from `engine.engine_group` for vllm TP > 1;
        `origin` names the tokenizer in errors (model.tokenizer's value); `tools`: the job's tools on
        this rank (`job_tools`; its runner is owned from here on), else a runner is built here."""
        if cfg.interaction_config is not None:
            raise UserError("rollout.multi_turn.interaction_config: simulated-user interactions are not supported")
        runner, schemas = (tools.runner, tools.schemas) if tools is not None else (ToolRunner.from_config(cfg), None)
        return cls(engine, tokenizer, runner, schemas=schemas,
                   max_assistant_turns=cfg.max_assistant_turns, max_user_turns=cfg.max_user_turns,
                   max_parallel_calls=cfg.max_parallel_calls, max_tool_response_tokens=cfg.max_tool_response_tokens,
                   tool_response_truncate_side=cfg.tool_response_truncate_side, format=cfg.format,
                   group=group, group_src=group_src, origin=origin)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: Sampling,
                 prompt_seeds: Optional[Sequence[int]] = None, images: Optional[Sequence[Any]] = None) -> list[Response]:
        """`sampling.n` conversations per prompt, prompt-major, as `RolloutEngine.generate`.

        With `prompt_seeds`, each turn of conversation j of prompt i samples from a seed derived
        from `prompt_seeds[i]`, the turn and j: independent of the other prompts of the call.
        `images[i]`: prompt i's `ImageInputs` (VLMs), sent with each of its conversations' turns."""
        images = list(images) if images is not None else [None] * len(prompt_token_ids)
        convs = [_Conversation(i, i * sampling.n + j, list(p), images=images[i])
                 for i, p in enumerate(prompt_token_ids) for j in range(sampling.n)]
        self._prompt_seeds = (None if prompt_seeds is None
                              else resolve_prompt_seeds(sampling, len(prompt_token_ids), prompt_seeds))
        turn = 0
        while True:
            active = [c for c in convs if not c.done]
            if not active:
                break
            self._assistant_turn(active, sampling, turn)
            calling = [c for c in active if not c.done]
            if calling:
                self._tool_turn(calling, sampling.max_tokens)
            turn += 1
        return [Response(c.prompt_index, c.tokens, c.logprobs, c.finish_reason, loss_mask=c.mask,
                         routes=routes_to(c.routes, len(c.prompt) + len(c.tokens)),
                         info={"assistant_turns": c.assistant_turns, "tool_turns": c.tool_turns,
                               **tool_counts(c.results)})
                for c in convs]

    def _assistant_turn(self, active: list[_Conversation], sampling: Sampling, turn: int) -> None:
        by_budget: dict[int, list[_Conversation]] = {}
        for c in active:
            by_budget.setdefault(sampling.max_tokens - len(c.tokens), []).append(c)
        for budget, group in by_budget.items():
            pictures = [c.images for c in group]
            extra = {"images": pictures} if any(x is not None for x in pictures) else {}
            if self._prompt_seeds is not None:
                n = sampling.n
                seeds = [prompt_seed(self._prompt_seeds[c.prompt_index], turn * 1_000_003 + c.row - c.prompt_index * n)
                         for c in group]
                outs = self.engine.generate([c.prompt + c.tokens for c in group],
                                            replace(sampling, n=1, max_tokens=budget), prompt_seeds=seeds, **extra)
            else:
                seed = None if sampling.seed is None else prompt_seed(sampling.seed, turn * 1_000_003 + group[0].row)
                s = replace(sampling, n=1, max_tokens=budget, seed=seed)
                outs = self.engine.generate([c.prompt + c.tokens for c in group], s, **extra)
            for c, out in zip(group, outs):
                c.add(out.token_ids, out.logprobs, 1)
                c.routes = out.routes
                c.assistant_turns += 1
                c.finish_reason = out.finish_reason
                c.last_turn = list(out.token_ids)
                c.pending = ([] if out.finish_reason == "length"
                             else self.format.parse_with_ids(self.tokenizer.decode(out.token_ids)))
                out_of_turns = self.max_assistant_turns is not None and c.assistant_turns >= self.max_assistant_turns
                out_of_tool_turns = self.max_user_turns is not None and c.tool_turns >= self.max_user_turns
                if not c.pending or out_of_turns or out_of_tool_turns or len(c.tokens) >= sampling.max_tokens:
                    c.done = True

    def _run_tools(self, calls: list[ToolCall]) -> list[ToolResult]:
        if self.group is None:
            return self.tools.run(calls)
        import torch.distributed as dist

        from mrl.platform.dist import stage

        box = [self.tools.run(calls) if dist.get_rank() == self.group_src else None]
        with stage("rollout tool results"):
            dist.broadcast_object_list(box, src=self.group_src, group=self.group)
        return box[0]

    def _tool_turn(self, calling: list[_Conversation], max_tokens: int) -> None:
        jobs = [(c, k, call) for c in calling for k, (call, _) in enumerate(c.pending[:self.max_parallel_calls])]
        runnable = [(c, k, call) for c, k, call in jobs if isinstance(call, ToolCall)]
        results = dict(zip(((id(c), k) for c, k, _ in runnable), self._run_tools([call for _, _, call in runnable])))
        for c in calling:
            pending = c.pending[:self.max_parallel_calls]
            got = [results.get((id(c), k)) for k in range(len(pending))]
            messages, used = tool_messages(self.tokenizer, pending, got, c.tool_turns, self.max_tool_response_tokens,
                                           self.truncate_side)
            c.results += used
            obs = self.turns.tool_turn_ids(c.last_turn, messages)
            room = max_tokens - len(c.tokens)
            c.add(obs[:room], [0.0] * min(len(obs), room), 0)
            c.tool_turns += 1
            c.pending = []
            if len(obs) >= room:  # no room left for another assistant turn
                c.finish_reason, c.done = "length", True
