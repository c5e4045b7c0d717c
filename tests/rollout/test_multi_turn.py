"""Multi-turn rollouts: loss masks around tool output, tool timeouts and failures, calculator tool."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from mrl.errors import UserError
from mrl.models.tokenizer import byte_tokenizer
from mrl.rollout.engine import RolloutEngine
from mrl.rollout.multi_turn import HermesFormat, MultiTurnRollout
from mrl.rollout.tools import ToolCall, ToolRunner
from mrl.rollout.types import Response, Sampling

HERE = Path(__file__).parent
TOOLS = str(HERE / "tools_for_tests.py")
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "jobs" / "tools"))
from calculator import calculator  # noqa: E402


# one token per UTF-8 byte, <|im_start|>/<|im_end|> special, Hermes tool turns in its ChatML template
TOK = byte_tokenizer()


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call><|im_end|>'


class ScriptedEngine(RolloutEngine):
    """A policy that answers turn k of every conversation with script[k]; log-prob of each token -0.5."""

    def __init__(self, script):
        self.script, self.contexts = script, []

    def generate(self, prompt_token_ids, sampling):
        out = []
        for i, ctx in enumerate(prompt_token_ids):
            self.contexts.append(list(ctx))
            turn = TOK.decode(ctx).count("</tool_response><|im_end|>")  # tool turns so far
            ids = TOK.encode(self.script[min(turn, len(self.script) - 1)])
            cut = ids[:sampling.max_tokens]
            out.append(Response(i, cut, [-0.5] * len(cut), "length" if len(cut) < len(ids) else "stop"))
        return out

    def sequence_logprobs(self, token_ids):
        return [[-0.5] * (len(t) - 1) for t in token_ids]

    def update_weights(self, weights, *, partial=False):
        return 0

    def sleep(self, level=None):
        pass

    def wake(self, tags=None):
        pass

    def shutdown(self):
        pass


def rollout(script, refs, **kw):
    timeout = kw.pop("timeout_s", 5.0)
    return MultiTurnRollout(ScriptedEngine(script), TOK, ToolRunner(refs, timeout), **kw)


def spans(resp):
    """(mask value, decoded text) runs of a response."""
    runs, start = [], 0
    for k in range(1, len(resp.loss_mask) + 1):
        if k == len(resp.loss_mask) or resp.loss_mask[k] != resp.loss_mask[start]:
            runs.append((resp.loss_mask[start], TOK.decode(resp.token_ids[start:k])))
            start = k
    return runs


def test_tool_output_is_masked_in_the_middle_of_the_response():
    script = [call("echo", text="hi"), "The answer is hi.<|im_end|>"]
    mt = rollout(script, [f"{TOOLS}:echo"], max_assistant_turns=4)
    prompt = TOK.encode("<|im_start|>user\nsay hi<|im_end|>\n<|im_start|>assistant\n")
    [r] = mt.generate([prompt], Sampling(n=1, max_tokens=400))
    assert spans(r) == [
        (1, script[0]),
        (0, "\n<|im_start|>user\n<tool_response>\necho:hi\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
        (1, script[1]),
    ]
    assert [lp for lp, m in zip(r.logprobs, r.loss_mask) if m == 0] == [0.0] * r.loss_mask.count(0)
    assert all(lp == -0.5 for lp, m in zip(r.logprobs, r.loss_mask) if m == 1)
    assert r.finish_reason == "stop"
    assert r.info == {"assistant_turns": 2, "tool_turns": 1, "tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0,
                      "tool_server_errors": 0, "tool_truncated": 0, "tool_server_restarts": 0}
    # the second turn was generated from prompt + first turn + tool output
    assert mt.engine.contexts[1] == prompt + r.token_ids[:len(mt.engine.contexts[1]) - len(prompt)]


def test_turn_caps_and_budget():
    looping = [call("echo", text="again")]
    r = rollout(looping, [f"{TOOLS}:echo"], max_assistant_turns=3).generate([[65]], Sampling(max_tokens=2000))[0]
    assert r.info["assistant_turns"] == 3 and r.info["tool_turns"] == 2 and r.loss_mask[-1] == 1
    r = rollout(looping, [f"{TOOLS}:echo"], max_user_turns=1).generate([[65]], Sampling(max_tokens=2000))[0]
    assert r.info["assistant_turns"] == 2 and r.info["tool_turns"] == 1
    # the whole response (assistant + tool tokens) stays within max_tokens
    r = rollout(looping, [f"{TOOLS}:echo"]).generate([[65]], Sampling(max_tokens=150))[0]
    assert len(r.token_ids) == 150 and r.finish_reason == "length"


def test_tool_timeout_exception_crash_and_unknown_tool_become_messages():
    script = [call("sleepy", seconds=30) + call("broken", x=1) + call("crash") + call("nope") + call("structured", a=1, b=2),
              "done<|im_end|>"]
    refs = [f"{TOOLS}:{f}" for f in ("sleepy", "broken", "crash", "structured")]
    t0 = time.monotonic()
    r = rollout(script, refs, max_parallel_calls=5, timeout_s=1.0).generate([[65]], Sampling(max_tokens=2000))[0]
    assert time.monotonic() - t0 < 10  # the hanging tool was killed, calls ran in parallel
    tool_text = "".join(text for m, text in spans(r) if m == 0)
    assert "error: sleepy timed out after 1 s" in tool_text
    assert "error: broken: RuntimeError: bad input 1" in tool_text
    assert "error: crash: tool process exited with code 3" in tool_text
    assert "error: unknown tool 'nope'" in tool_text
    assert '{"sum": 3}' in tool_text
    assert r.info["tool_calls"] == 5 and r.info["tool_timeouts"] == 1 and r.info["tool_errors"] == 3
    assert spans(r)[-1] == (1, "done<|im_end|>")


def test_max_parallel_calls_and_malformed_calls():
    script = ["<tool_call>{not json}</tool_call>" + call("echo", text="b"), "ok"]
    r = rollout(script, [f"{TOOLS}:echo"], max_parallel_calls=1).generate([[65]], Sampling(max_tokens=2000))[0]
    tool_text = "".join(text for m, text in spans(r) if m == 0)
    assert "malformed tool call" in tool_text and "echo:b" not in tool_text


def test_tool_response_truncation():
    script = [call("echo", text="0123456789" * 10), "ok"]
    for side, kept in (("right", "echo:0123"), ("left", "456789"), ("middle", "echo:6789")):
        r = rollout(script, [f"{TOOLS}:echo"], max_tool_response_tokens=10,
                    tool_response_truncate_side=side).generate([[65]], Sampling(max_tokens=2000))[0]
        inner = "".join(t for m, t in spans(r) if m == 0).split("<tool_response>\n")[1].split("\n</tool_response>")[0]
        assert len(inner) == 10 and inner.replace("echo:", "").strip() and kept.replace("echo:", "") in inner, (side, inner)


def test_bad_tool_references_are_user_errors():
    with pytest.raises(UserError, match="rollout.multi_turn.tools"):
        ToolRunner(["no_colon"])
    with pytest.raises(UserError, match="not found"):
        ToolRunner(["missing/file.py:f"])


def test_hermes_parser():
    calls = HermesFormat().parse('x <tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call> y '
                                 '<tool_call>{"name": 3}</tool_call>')
    assert calls[0] == ToolCall("f", {"a": 1}) and calls[1].startswith("error: malformed")


def test_calculator_tool():
    assert calculator("2 * (3 + 4) / 7") == "2"
    assert calculator("1/4 + 0.5") == "0.75"
    assert calculator("-2 ** 10") == "-1024"
    for bad in ("__import__('os').system('true')", "x + 1", "9 ** 9 ** 9", "1 / 0", "[1, 2]"):
        with pytest.raises((ValueError, ZeroDivisionError, SyntaxError)):
            calculator(bad)
    result = ToolRunner([str(REPO / "jobs/tools/calculator.py") + ":calculator"]).run(
        [ToolCall("calculator", {"expression": "6 * 7"}), ToolCall("calculator", {"expression": "1/0"})])
    assert [(x.text, x.status) for x in result] == [("42", "ok"), ("error: calculator: ZeroDivisionError: division by zero", "error")]


def test_real_engine_multi_turn_logprobs_match_a_teacher_forced_forward(tiny_model_dir):
    """hf engine in the loop: a forced first turn calls a tool; the model's own turns keep exact log-probs."""
    from mrl.rollout.audit import hf_logits_fn, logprob_audit, teacher_forced_logprobs
    from mrl.rollout.hf import HFEngine

    real = HFEngine.from_pretrained(tiny_model_dir, seed=0)

    class FirstTurnScripted(ScriptedEngine):
        def generate(self, prompts, sampling):
            if TOK.decode(prompts[0]).count("<tool_response>") == 0:
                return super().generate(prompts, sampling)
            return real.generate(prompts, sampling)

    mt = MultiTurnRollout(FirstTurnScripted([call("echo", text="x")]), TOK, ToolRunner([f"{TOOLS}:echo"]),
                          max_assistant_turns=2)
    prompt = TOK.encode("q:")
    s = Sampling(n=2, temperature=1.0, max_tokens=200, seed=3)
    responses = mt.generate([prompt], s)
    for r in responses:
        assert [m for m, _ in spans(r)] == [1, 0, 1] and r.info["assistant_turns"] == 2
    trainer, rollout_lp, mask = teacher_forced_logprobs(hf_logits_fn(real.model), [prompt], responses, s)
    model_turn = mask.clone()
    first = len(TOK.encode(call("echo", text="x")))
    model_turn[:, :first] = 0  # the scripted turn's -0.5 log-probs are not the model's
    audit = logprob_audit(rollout_lp, trainer, model_turn)
    assert audit["rollout/audit_tokens"] > 0 and audit["rollout/logprob_abs_diff_max"] <= 1e-4, audit


@pytest.mark.slow
def test_tool_results_are_shared_across_an_engines_ranks():
    from tests.dist_util import run_torchrun

    proc = run_torchrun("tests/rollout/scripts/tool_broadcast.py", nproc=2, timeout=120)
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout
