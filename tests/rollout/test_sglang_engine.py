"""Contract tests of the sglang engine (mrl/rollout/sglang_*.py) against a loopback stand-in server.

SGLang itself cannot run here (its CPU backend needs Intel AMX; its CUDA wheels are too big for the
GPU machine), so `servers/sglang_contract.py` serves SGLang 0.5.23's endpoints with the request and
response shapes of its source, each cited there; the engine launches it exactly as it launches
SGLang (`python -m sglang.launch_server ...`, the `sglang_shim` package first on the child's
PYTHONPATH). docs/sglang.md says what this does not prove.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import time
from pathlib import Path

import httpx
import pytest
import torch

from mrl.errors import UserError
from mrl.rollout.async_engine import GenRequest
from mrl.rollout.config import RolloutConfig, SGLangConfig, WeightSyncConfig
from mrl.rollout.sglang_engine import SGLangEngine, SGLangError
from mrl.rollout.sglang_sync import launch
from mrl.rollout.types import Sampling, prompt_seed
from tests.rollout.servers import sglang_contract

REPO = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).parent / "servers" / "sglang_shim"


@contextlib.contextmanager
def shim_env(**extra):
    """The child finds the shim's `sglang` package first (and this repo's tests package)."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", *extra)}
    os.environ["PYTHONPATH"] = os.pathsep.join([str(SHIM), str(REPO)])
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def rollout(**kw) -> RolloutConfig:
    sglang = kw.pop("sglang", {})
    kw = {"tensor_parallel": 1, "sleep_level": 1, "generate_timeout_s": 60, **kw}
    return RolloutConfig(engine="sglang", load_format="dummy", weight_sync=WeightSyncConfig(bucket_mb=1),
                         sglang=SGLangConfig(**{"launch_timeout_s": 60, **sglang}), **kw)


def start(tmp_path, cfg=None, **env):
    with shim_env(**env):
        return launch(cfg or rollout(), str(tmp_path / "model"), seed=7, dtype="bfloat16", device="cpu",
                      max_model_len=256, log_dir=str(tmp_path / "run"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    eng = start(tmp_path_factory.mktemp("sglang"))
    yield eng
    eng.shutdown()


def state(eng) -> dict:
    return httpx.get(f"{eng.engine.url}/_contract/state", timeout=10).json()


def calls(eng, path: str) -> list[dict]:
    return [c["body"] for c in state(eng)["calls"] if c["path"] == path]


def expected(prompt, sampling: Sampling, seed) -> tuple[list[int], list[float]]:
    """What the toy model generates for `prompt` (the server's own code, run here on the same table)."""
    model = sglang_contract.Model(sglang_contract.parse_args(["--model-path", "x", "--random-seed", "7"]))
    from mrl.rollout.sglang_engine import generate_body

    out = sglang_contract.generate(model, generate_body(GenRequest("x", tuple(prompt), sampling, seed)))
    return out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]


def test_launch_passes_the_job_settings(served):
    args = state(served)["args"]
    # rollout.* -> ServerArgs fields; skip_tokenizer_init (ids in and out) and deterministic inference (seeds) always
    assert args["tp_size"] == 1 and args["random_seed"] == 7 and args["dtype"] == "bfloat16"
    assert args["context_length"] == 256 and args["load_format"] == "dummy" and args["max_running_requests"] == 1024
    assert args["skip_tokenizer_init"] and args["enable_deterministic_inference"]
    assert args["enable_memory_saver"] and args["enable_weights_cpu_backup"]   # sleep_level 1 keeps a CPU copy
    log = (served.engine.server.log_path).read_text()
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB = 0" in log   # processed (tempered) log-probs
    assert served.engine.server.log_path.parent.name == "run"


def test_generate_round_trip_with_logprobs(served):
    sampling = Sampling(temperature=0.7, max_tokens=12, ignore_eos=True)
    result = asyncio.run(served.engine.generate(GenRequest("rt-1", (5, 9, 11), sampling, seed=123)))
    ids, lps = expected([5, 9, 11], sampling, 123)
    assert result.token_ids == ids and len(ids) == 12
    assert result.logprobs == pytest.approx(lps, abs=0) and result.finish_reason == "length"
    body = calls(served, "/generate")[-1]
    assert body["rid"] == "rt-1" and body["input_ids"] == [5, 9, 11] and body["return_logprob"] is True


def test_a_stop_token_ends_the_response_and_stays_in_it(served):
    greedy = Sampling(temperature=0, max_tokens=8, ignore_eos=True)
    ids, _ = expected([3, 4], greedy, None)
    stop = ids[2]
    first = ids.index(stop)   # the first time the greedy path samples it
    result = asyncio.run(served.engine.generate(
        GenRequest("stop-1", (3, 4), dataclasses.replace(greedy, stop_token_ids=(stop,)))))
    assert result.finish_reason == "stop" and result.token_ids == ids[:first + 1]   # no_stop_trim keeps it
    assert len(result.logprobs) == first + 1


def test_seeded_sampling_params_reach_the_server(served):
    sampling = Sampling(n=2, temperature=0.9, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, max_tokens=6,
                        stop_token_ids=(60,), ignore_eos=False, seed=11)
    before = len(calls(served, "/generate"))
    first = served.generate([[1, 2, 3], [4, 5]], sampling)
    again = served.generate([[1, 2, 3], [4, 5]], sampling)
    sent = calls(served, "/generate")[before:before + 4]
    seeds = sorted(b["sampling_params"]["sampling_seed"] for b in sent)
    assert seeds == sorted(prompt_seed(prompt_seed(11, i), j) for i in range(2) for j in range(2))
    sp = sent[0]["sampling_params"]
    assert {k: sp[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens",
                                "stop_token_ids", "ignore_eos", "no_stop_trim")} == \
        {"temperature": 0.9, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_new_tokens": 6,
         "stop_token_ids": [60], "ignore_eos": False, "no_stop_trim": True}
    assert [r.prompt_index for r in first] == [0, 0, 1, 1]   # prompt-major, n each
    assert [r.token_ids for r in first] == [r.token_ids for r in again]   # same seeds, same samples
    assert first[0].token_ids == expected([1, 2, 3], dataclasses.replace(sampling, n=1), prompt_seed(prompt_seed(11, 0), 0))[0]
    assert first[0].token_ids != first[1].token_ids or first[0].logprobs != first[1].logprobs


def test_an_unknown_sampling_field_is_the_servers_400(served):
    async def bad():
        return await served.engine._post("/generate", {"input_ids": [1], "sampling_params": {"seed": 3}}, "/generate")

    with pytest.raises(SGLangError, match=r"sglang engine at .*HTTP 400.*unknown field `seed`"):
        asyncio.run(bad())


def _until(predicate, what: str, limit: int = 400):
    for _ in range(limit):
        if predicate():
            return
        time.sleep(0.025)
    raise AssertionError(f"never saw {what}")


def test_abort_returns_the_partial_tokens(served):
    httpx.post(f"{served.engine.url}/_contract/config", json={"token_s": 0.02}, timeout=10)
    try:
        async def run():
            long = Sampling(temperature=1.0, max_tokens=2000, ignore_eos=True)
            task = asyncio.create_task(served.engine.generate(GenRequest("ab-1", (7,), long, seed=1)))
            await asyncio.to_thread(_until, lambda: state(served)["running"].get("ab-1", 0) >= 3, "3 tokens")
            await served.engine.abort(["ab-1"])
            return await task

        result = asyncio.run(run())
    finally:
        httpx.post(f"{served.engine.url}/_contract/config", json={"token_s": 0}, timeout=10)
    assert result.finish_reason == "abort" and 3 <= len(result.token_ids) < 2000
    assert len(result.logprobs) == len(result.token_ids)
    assert calls(served, "/abort_request")[-1] == {"rid": "ab-1", "abort_all": False}


def test_pause_holds_requests_until_resume_and_can_abort_them(served):
    httpx.post(f"{served.engine.url}/_contract/config", json={"token_s": 0.01}, timeout=10)
    try:
        async def run():
            s = Sampling(temperature=1.0, max_tokens=400, ignore_eos=True)   # ~4 s of tokens
            held = asyncio.create_task(served.engine.generate(GenRequest("p-1", (7,), s, seed=2)))
            await asyncio.to_thread(_until, lambda: "p-1" in state(served)["running"], "p-1 running")
            await served.engine.pause()
            now = state(served)
            assert now["paused"] and "p-1" in now["running"]   # held, not ended
            await served.engine.resume()
            kept = await held
            cut = asyncio.create_task(served.engine.generate(GenRequest("p-2", (7,), s, seed=2)))
            await asyncio.to_thread(_until, lambda: "p-2" in state(served)["running"], "p-2 running")
            await served.engine.pause(abort_running=True)
            aborted = await cut
            await served.engine.resume()
            return kept, aborted

        kept, aborted = asyncio.run(run())
    finally:
        httpx.post(f"{served.engine.url}/_contract/config", json={"token_s": 0}, timeout=10)
    assert kept.finish_reason == "length" and len(kept.token_ids) == 400
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) < 400
    modes = [b["mode"] for b in calls(served, "/pause_generation")][-2:]
    assert modes == ["retract", "abort"] and calls(served, "/continue_generation")[-1] == {"torch_empty_cache": True}


def _weights(dtype):
    g = torch.Generator().manual_seed(3)
    w = {"model.embed_tokens.weight": torch.randn(64, 32, generator=g).to(dtype),
         "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g).to(dtype),
         "model.norm.weight": torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-30, 3.0]).to(dtype),
         "lm_head.weight": torch.randn(64, 32, generator=g).to(dtype)}
    return w


def _dumped(eng, tmp_path) -> dict:
    path = tmp_path / "dump.pt"
    httpx.post(f"{eng.engine.url}/_contract/dump", json={"path": str(path)}, timeout=30)
    return torch.load(path)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_weights_from_tensor_delivers_the_exact_tensors(served, tmp_path, dtype):
    weights = _weights(dtype)
    served.engine.bucket_mb = 8192 / 2**20   # 8 KiB buckets: several requests
    before = len(state(served)["calls"])
    assert served.update_weights(iter(weights.items())) == len(weights)
    got = _dumped(served, tmp_path)
    for name, t in weights.items():
        assert got[name].dtype == dtype and torch.equal(_bits(got[name]), _bits(t)), name
    sent = [c for c in state(served)["calls"][before:] if c["path"] in ("/update_weights_from_tensor", "/flush_cache")]
    assert len(sent) >= 3 and sent[-1]["path"] == "/flush_cache"   # one flush, after the last bucket
    updates = [c["body"] for c in sent[:-1]]
    assert all(b["flush_cache"] is False and b["load_format"] is None and len(b["serialized_named_tensors"]) == 1
               for b in updates)
    assert [b.get("weight_version") for b in updates] == [None] * (len(updates) - 1) + [str(served.engine.version)]
    assert state(served)["weight_version"] == str(served.engine.version)


def test_update_weights_from_distributed_broadcasts_in_order(tmp_path):
    eng = start(tmp_path, rollout(sglang={"weight_transport": "distributed"}))
    proc = eng.engine.server.proc
    try:
        assert eng.engine.transport == "distributed"
        eng.engine.group_backend = "gloo"
        eng.engine.bucket_mb = 8192 / 2**20
        order = []
        for dtype in (torch.float32, torch.bfloat16):
            before = len([c for c in state(eng)["calls"] if c["path"] == "/update_weights_from_distributed"])
            weights = _weights(dtype)
            eng.update_weights(iter(weights.items()))
            eng.update_weights(iter(list(weights.items())[:2]), partial=True)   # a delta: some tensors only
            order += list(weights) + list(weights)[:2]
            st = state(eng)
            sent = [c["body"] for c in st["calls"] if c["path"] == "/update_weights_from_distributed"]
            assert [n for b in sent for n in b["names"]] == order == st["received_order"]
            meta = {n: (d, sh) for b in sent[before:] for n, d, sh in zip(b["names"], b["dtypes"], b["shapes"])}
            assert meta == {n: (str(dtype).removeprefix("torch."), list(t.shape)) for n, t in weights.items()}
            got = _dumped(eng, tmp_path)
            for name, t in weights.items():
                assert got[name].dtype == dtype and torch.equal(_bits(got[name]), _bits(t)), name
        init = [c["body"] for c in st["calls"] if c["path"] == "/init_weights_update_group"]
        assert len(init) == 1 and init[0]["rank_offset"] == 1 and init[0]["world_size"] == 2 and init[0]["backend"] == "gloo"
        assert all(b["group_name"] == init[0]["group_name"] and b["flush_cache"] is False for b in sent)
        assert [b.get("weight_version") for b in sent if b.get("weight_version")] == ["1", "2", "3", "4"]
    finally:
        eng.shutdown()
    assert proc.poll() is not None   # shutdown stops the server


def test_sleep_and_wake_call_the_memory_endpoints(served):
    before = len(state(served)["calls"])
    served.sleep(1)
    assert set(state(served)["released"]) == {"kv_cache", "weights"}
    served.wake(tags=["weights"])
    assert state(served)["released"] == ["kv_cache"]
    served.wake(tags=["kv_cache"])
    served.wake()   # nothing left asleep: no call
    with pytest.raises(SGLangError, match="sleep level 2 asked of a server launched for level 1"):
        served.sleep(2)
    mem = [(c["path"], c["body"]) for c in state(served)["calls"][before:]]
    assert mem == [("/release_memory_occupation", {"tags": ["kv_cache", "weights"]}),
                   ("/resume_memory_occupation", {"tags": ["weights"]}),
                   ("/resume_memory_occupation", {"tags": ["kv_cache"]})]


def test_sequence_logprobs_are_the_prompts_own(served):
    seqs = [[1, 5, 9, 2], [4, 4]]
    model = sglang_contract.Model(sglang_contract.parse_args(["--model-path", "x", "--random-seed", "7"]))
    want = [[model.logprobs(s[t - 1], 1.0)[s[t]].item() for t in range(1, len(s))] for s in seqs]
    assert served.sequence_logprobs(seqs) == want
    body = calls(served, "/generate")[-1]
    assert body["logprob_start_len"] == 0 and body["sampling_params"]["max_new_tokens"] == 0


def test_a_server_that_never_becomes_healthy_is_one_line_at_the_deadline(tmp_path):
    with pytest.raises(UserError) as e:
        start(tmp_path, rollout(sglang={"launch_timeout_s": 3}), MRL_FAKE_SGLANG="unhealthy")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("rollout.sglang.launch_timeout_s:") and "not healthy after 3 s" in msg
    assert str(tmp_path / "run" / "sglang-0.log") in msg


def test_a_server_that_dies_mid_request_is_an_error_naming_the_engine(tmp_path):
    cfg = rollout(logprobs_mode="raw_logprobs", enable_prefix_caching=False,
                  sglang={"server_args": {"trust_remote_code": True, "base_gpu_id": 0}})
    eng = start(tmp_path, cfg, MRL_FAKE_SGLANG="die_on_generate")
    try:
        # the launch line: raw log-probs by environment, rollout.sglang.server_args passed through
        text = eng.engine.server.log_path.read_text()
        args = json.loads(text.split("launch args: ", 1)[1].splitlines()[0])
        assert args["trust_remote_code"] and args["disable_radix_cache"] and "SGLANG_RETURN_ORIGINAL_LOGPROB = 1" in text
        with pytest.raises(SGLangError) as e:
            eng.generate([[1, 2]], Sampling(max_tokens=4, logprobs_mode="raw_logprobs"))
        assert re.search(r"^sglang engine at http://127\.0\.0\.1:\d+: /generate \S+ failed: the sglang server "
                         r"\(pid \d+\) exited with status 3; log .*sglang-0\.log", str(e.value))
        assert "\n" not in str(e.value)
    finally:
        eng.shutdown()


def test_the_sglang_path_refuses_what_it_does_not_honour():
    from mrl.rollout.sglang_sync import sglang_problems

    assert sglang_problems(rollout()) == []
    keys = [k for k, _ in sglang_problems(rollout(top_p=0.9, pipeline_parallel=2, engine_kwargs={"x": 1}))]
    assert keys == ["rollout.logprobs_mode", "rollout.pipeline_parallel", "rollout.engine_kwargs"]
    assert sglang_problems(rollout(top_p=0.9, logprobs_mode="raw_logprobs")) == []


def test_mrl_validate_accepts_the_sglang_engine(tmp_path):
    import subprocess
    import sys

    job = REPO / "jobs" / "quickstart_cpu.toml"
    run = lambda *o: subprocess.run([sys.executable, "-m", "mrl", "validate", str(job), "rollout.engine=sglang", *o],
                                    cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    ok = run()
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = run("rollout.top_p=0.9")
    assert bad.returncode == 2 and "rollout.logprobs_mode" in bad.stdout + bad.stderr
    assert "Traceback" not in bad.stdout + bad.stderr


def test_the_server_dies_with_the_trainer(tmp_path):
    """A trainer killed outright (no atexit) takes its server along (PR_SET_PDEATHSIG)."""
    import signal
    import subprocess
    import sys

    import psutil

    script = f"""
import sys, time
from tests.rollout.test_sglang_engine import start, rollout
from pathlib import Path
eng = start(Path({str(tmp_path)!r}))
print(eng.engine.server.proc.pid, flush=True)
time.sleep(600)
"""
    trainer = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        pid = int(trainer.stdout.readline())
        assert psutil.pid_exists(pid)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
        _until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
               "the server gone")
    finally:
        if trainer.poll() is None:
            trainer.kill()


def test_the_full_sync_names_are_the_checkpoints(tiny_model_dir):
    from safetensors import safe_open

    from mrl.rollout.sglang_sync import checkpoint_parameter_names
    from tests.rollout.conftest import TINY_LLAMA

    with safe_open(str(Path(tiny_model_dir) / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert checkpoint_parameter_names(TINY_LLAMA) == saved and "lm_head.weight" in saved
    tied = checkpoint_parameter_names({**TINY_LLAMA, "tie_word_embeddings": True})
    assert tied == saved - {"lm_head.weight"}


def test_a_full_sync_that_misses_a_parameter_is_refused(served):
    weights = _weights(torch.float32)
    served.engine.expected_names = set(weights)
    try:
        served.update_weights(iter(list(weights.items())[:3]), partial=True)   # a delta may send some
        with pytest.raises(SGLangError, match=r"sglang engine at .*sent nothing for 1 parameter\(s\): lm_head.weight"):
            served.update_weights(iter(list(weights.items())[:3]))
    finally:
        served.engine.expected_names = None


def test_a_request_for_log_probs_the_server_does_not_report_is_refused(served):
    truncated = Sampling(temperature=1.0, top_k=5, max_tokens=3)
    with pytest.raises(SGLangError, match="truncated distribution"):
        asyncio.run(served.engine.generate(GenRequest("lp-1", (1,), truncated)))
    raw = Sampling(max_tokens=3, logprobs_mode="raw_logprobs")
    with pytest.raises(SGLangError, match="launched to report processed_logprobs"):
        served.generate([[1]], raw)


def test_colocated_servers_stay_on_their_groups_gpus():
    from mrl.rollout.sglang_sync import colocated_problems

    assert colocated_problems(rollout(tensor_parallel=2), 2) == []
    assert colocated_problems(rollout(tensor_parallel=2, placement="separate", ranks=2), 1) == []
    (key, message), = colocated_problems(rollout(tensor_parallel=4), 2)
    assert key == "rollout.tensor_parallel" and "above parallel.tensor 2" in message


@pytest.mark.slow
def test_mrl_train_runs_its_steps_on_the_contract_server(tmp_path):
    """The trainer's wiring, colocated (one rank) and separate (a trainer rank and a rollout rank
    under torchrun, the distributed transport): factory, launch, run-dir log, full-sync names of a
    real export, delta syncs, sleep and wake around each colocated sync, batches as requests. The toy
    server's tokens are not the model's: nothing here says the run learns."""
    import subprocess
    import sys

    from tests.dist_util import run_torchrun

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SHIM), str(REPO)])}
    common = ["jobs/quickstart_cpu.toml", "rollout.engine=sglang", "parallel.tensor=1", "trainer.total_steps=2",
              "checkpoint.every_steps=0", "rollout.weight_sync.verify_every_steps=1", "rollout.weight_sync.mode=delta"]
    colocated = subprocess.run([sys.executable, "-m", "mrl", "train", *common, "platform.ranks_per_node=1",
                                f"job.output_dir={tmp_path / 'colocated'}"],
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert colocated.returncode == 0, colocated.stdout[-2000:] + colocated.stderr[-2000:]
    separate = run_torchrun("-m mrl train", *common, "rollout.placement=separate", "rollout.ranks=1",
                            f"job.output_dir={tmp_path / 'separate'}", nproc=2, timeout=600,
                            env={"PYTHONPATH": env["PYTHONPATH"]})
    for proc, run, log in ((colocated, "colocated", "sglang-0.log"), (separate, "separate", "sglang-1.log")):
        out = proc.stdout + proc.stderr
        assert "step 2/2" in out and "cannot be read back from the SGLangRolloutEngine" in out, run
        posts = re.findall(r'"POST (/\w+)', (tmp_path / run / "quickstart-cpu" / log).read_text())
        control = [p for p in posts if p != "/generate"]
        update = "/update_weights_from_tensor" if run == "colocated" else "/update_weights_from_distributed"
        syncs = [i for i, p in enumerate(control) if p == update]
        assert len(syncs) >= 2 and all(control[i + 1] == "/flush_cache" for i in syncs), (run, control)
        assert posts.count("/generate") == 2 * 8 * 8, run   # 2 steps x 8 prompts x 8 responses
    assert control.count("/init_weights_update_group") == 1   # separate: one group, joined once


def test_serializing_leaves_the_trainers_tensors_alone():
    from mrl.rollout.sglang_weights import serialize_named_tensors

    t = torch.arange(6, dtype=torch.float32)
    payload, held = serialize_named_tensors([("w", t)])
    assert not t.is_shared() and held[0][1].is_shared() and torch.equal(held[0][1], t)
    import base64
    import io

    (name, back), = sglang_contract.SafeUnpickler(io.BytesIO(base64.b64decode(payload))).load()
    assert name == "w" and torch.equal(back, t)
