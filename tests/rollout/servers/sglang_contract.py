"""A loopback stand-in for an SGLang 0.5.23 server, for the contract tests of the sglang engine.

Every endpoint, request field and response shape below is taken from SGLang 0.5.23's source (the
wheel `sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl`); each is cited where it is served. It
generates from a toy bigram "model" (a seeded random logit table), so the engine's parsing, seeds,
abort, pause, weight transports and memory calls are exercised end to end over real HTTP, in a
process of its own, started the way the engine starts SGLang (`python -m sglang.launch_server`,
through the shim package in `sglang_shim/`).

Behaviour switches (environment): MRL_FAKE_SGLANG = "unhealthy" (never healthy), "die_on_generate"
(exits inside the first /generate); MRL_FAKE_SGLANG_TOKEN_S: seconds per generated token.
The `/_contract/*` routes are not SGLang's: the tests read the server's state through them.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import pickle
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import torch

VOCAB = 64
EOS = 2

# sglang/api/v1/api_types.py: SamplingParams ("JSON object (unknown keys rejected)"): its fields
SAMPLING_FIELDS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
                   "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
                   "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                   "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
                   "custom_params", "beam_width", "watermark", "choice")

# sglang/srt/utils/common.py: SafeUnpickler.ALLOWED_GLOBALS, the entries a tensor payload can use
# (the full list also holds other containers and dtypes; anything outside it is refused there too)
SAFE_GLOBALS = {("builtins", n) for n in ("bool", "bytearray", "bytes", "dict", "float", "int", "list", "str", "tuple")} | {
    ("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("torch", "Size"), ("torch", "device"),
    ("torch", "dtype"), ("torch", "float32"), ("torch", "bfloat16"), ("torch", "float16"), ("torch", "Tensor"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"),
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"), ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("multiprocessing.resource_sharer", "DupFd"),
}


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in SAFE_GLOBALS:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def parse_args(argv):
    """The flags the engine passes, as 0.5.23 spells them (`sglang/srt/arg_groups/fields/*.py`: a
    field x_y is --x-y, a bool is store_true: `arg_groups/arg_utils.py`); any other flag is an
    argparse error, as in SGLang."""
    p = argparse.ArgumentParser(prog="sglang.launch_server")
    p.add_argument("--model-path", required=True)                    # fields/model.py
    p.add_argument("--host", default="127.0.0.1")                    # fields/serving.py
    p.add_argument("--port", type=int, default=30000)                # fields/serving.py
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)   # fields/parallel.py
    p.add_argument("--dtype", default="auto")                        # fields/model.py
    p.add_argument("--random-seed", type=int)                        # fields/device.py
    p.add_argument("--mem-fraction-static", type=float)              # fields/schedule.py
    p.add_argument("--context-length", type=int)                     # fields/model.py
    p.add_argument("--max-running-requests", type=int)               # fields/schedule.py
    p.add_argument("--chunked-prefill-size", type=int)               # fields/schedule.py
    p.add_argument("--load-format", default="auto")                  # fields/model.py
    p.add_argument("--base-gpu-id", type=int, default=0)             # fields/parallel.py
    for flag in ("--skip-tokenizer-init", "--enable-deterministic-inference", "--enable-memory-saver",
                 "--enable-weights-cpu-backup", "--disable-cuda-graph", "--disable-radix-cache",
                 "--trust-remote-code"):                             # fields/serving.py, exec_.py, model.py, ...
        p.add_argument(flag, action="store_true")
    return p.parse_args(argv)


class Model:
    """The toy engine state: a bigram logit table, loaded weights, memory, pause, running requests."""

    def __init__(self, args):
        self.args = args
        g = torch.Generator().manual_seed(args.random_seed or 0)
        self.table = torch.randn(VOCAB, VOCAB, generator=g) * 3
        self.params: dict[str, torch.Tensor] = {}
        self.weight_version = "default"   # model_info: weight_version
        self.released: set[str] = set()
        self.calls: list[dict] = []
        self.lock = threading.Condition()
        self.paused = False
        self.running: dict[str, dict] = {}   # rid -> {"abort": bool}
        self.group = None
        self.token_s = float(os.environ.get("MRL_FAKE_SGLANG_TOKEN_S", "0"))
        self.received_order: list[str] = []

    def logprobs(self, last: int, temperature: float) -> torch.Tensor:
        return torch.log_softmax(self.table[last] / temperature, -1)


def contract_error(body) -> str | None:
    """`sglang/srt/entrypoints/api_contract.py: generate_contract_error` -> api_types.decode_GenerateRequest:
    the checks of the fields the engine sends (unknown top-level keys are ignored; unknown sampling
    keys rejected with serde's text)."""
    if not isinstance(body, dict):
        return "invalid type: expected struct GenerateRequest"
    ids = body.get("input_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        return "invalid type: expected a sequence of i64"
    sp = body.get("sampling_params")
    if sp is not None:
        if not isinstance(sp, dict):
            return f"invalid type: {type(sp).__name__}, expected struct SamplingParams"
        for key in sp:
            if key not in SAMPLING_FIELDS:
                return f"unknown field `{key}`, expected one of " + ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
        seed = sp.get("sampling_seed")
        if seed is not None and not (isinstance(seed, int) and -(2**63) <= seed <= 2**63 - 1):
            return "sampling_seed must be an integer in [-2**63, 2**63 - 1]"   # sampling_params.py: verify
    for key in ("return_logprob", "stream"):
        if key in body and body[key] is not None and not isinstance(body[key], bool):
            return f"invalid type: expected a boolean for `{key}`"
    return None


def generate(model: Model, body: dict) -> dict:
    """`/generate` (`http_server.py: generate_request` -> `tokenizer_manager.generate_request`): the
    non-streaming answer of one request, `{"output_ids", "meta_info"}` (skip_tokenizer_init: a
    `BatchTokenIDOutput`, no text; `tokenizer_manager.py: _handle_batch_output`)."""
    sp = dict(body.get("sampling_params") or {})
    rid = body.get("rid") or f"auto-{time.monotonic_ns()}"
    ids = list(body["input_ids"])
    max_new = sp.get("max_new_tokens", 128)
    temperature = sp.get("temperature", 1.0)
    greedy = temperature < 1e-6                          # sampling_params.py: temperature 0 -> top_k 1
    seed = sp.get("sampling_seed")
    gen = torch.Generator().manual_seed(seed if seed is not None else 42)   # sampling_batch_info.py: default 42
    stops = set(sp.get("stop_token_ids") or []) | ({EOS} if not sp.get("ignore_eos") else set())
    meta = {"id": rid, "prompt_tokens": len(ids), "cached_tokens": 0}
    if body.get("return_logprob") and body.get("logprob_start_len", -1) == 0:
        raw = [model.logprobs(ids[k - 1], 1.0)[ids[k]].item() for k in range(1, len(ids))]
        meta["input_token_logprobs"] = [[None, ids[0], None]] + [[lp, t, None] for lp, t in zip(raw, ids[1:])]
    out, lps, finish = [], [], None
    state = {"abort": False, "tokens": 0}
    with model.lock:
        model.running[rid] = state
    try:
        while len(out) < max_new:
            with model.lock:
                while model.paused and not state["abort"]:
                    model.lock.wait(0.05)
            if state["abort"]:
                # tokenizer_manager.py: _handle_abort_req: finish_reason {"type": "abort", "message"}, tokens so far
                finish = {"type": "abort", "message": "Abort before prefill" if not out else "Abort in running batch"}
                break
            last = (ids + out)[-1]
            lp = model.logprobs(last, 1.0 if greedy else temperature)
            tok = int(lp.argmax()) if greedy else int(torch.multinomial(lp.exp(), 1, generator=gen))
            out.append(tok)
            lps.append(lp[tok].item())
            state["tokens"] = len(out)
            if model.token_s:
                time.sleep(model.token_s)
            if tok in stops:
                finish = {"type": "stop", "matched": tok}
                break
        if finish is None:
            finish = {"type": "length", "length": max_new}
    finally:
        with model.lock:
            model.running.pop(rid, None)
    sampled = list(out)
    if finish["type"] == "stop" and not sp.get("no_stop_trim"):
        out = out[:-1]   # detokenizer_manager.py: trim_matched_stop drops a matched stop id from output_ids
    meta.update(finish_reason=finish, completion_tokens=len(sampled), weight_version=model.weight_version)
    if body.get("return_logprob"):
        # tokenizer_manager.py: add_logprob_to_meta_info: [logprob, token_id, text] per sampled token
        # (text None without a tokenizer)
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, sampled)]
    return {"output_ids": out, "meta_info": meta}


def join_group(body: dict):
    """`weight_updater.py: init_weights_update_group` -> `common.py: init_custom_process_group` as
    worker tp_rank 0 (rank = rank_offset + tp_rank)."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    rank = body["rank_offset"] + 0
    timeout = timedelta(seconds=60)
    store, rank, world = next(c10d.rendezvous(f"tcp://{body['master_address']}:{body['master_port']}", rank,
                                              body["world_size"], timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(body["group_name"], store)
    pg, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend(body["backend"]), store,
                                           group_name=body["group_name"], timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


class Handler(BaseHTTPRequestHandler):
    model: Model = None
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        print("http:", fmt % args, flush=True)

    def _send(self, code: int, payload=None, text: str | None = None):
        data = text.encode() if text is not None else (b"" if payload is ... else json.dumps(payload).encode())
        self.send_response(code)
        self.send_header("content-type", "text/plain" if text is not None else "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        m = self.model
        path = urlparse(self.path).path
        if path in ("/health", "/health_generate"):
            # http_server.py: health_generate: 200 once a one-token generation went through, else 503
            self._send(503 if os.environ.get("MRL_FAKE_SGLANG") == "unhealthy" else 200, ...)
        elif path == "/server_info":   # http_server.py: server_info: the server args and "version"
            self._send(200, {**vars(m.args), "version": "0.5.23"})
        elif path == "/model_info":    # http_server.py: model_info (api_types.GetModelInfoResponse)
            self._send(200, {"model_path": m.args.model_path, "is_generation": True, "weight_version": m.weight_version})
        elif path == "/_contract/state":
            self._send(200, {"calls": m.calls, "params": sorted(m.params), "released": sorted(m.released),
                             "paused": m.paused, "running": {rid: st["tokens"] for rid, st in list(m.running.items())}, "weight_version": m.weight_version,
                             "received_order": m.received_order, "args": vars(m.args)})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        m = self.model
        path = urlparse(self.path).path
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        m.calls.append({"path": path, "body": _summary(path, body)})
        if path == "/generate":
            if os.environ.get("MRL_FAKE_SGLANG") == "die_on_generate":
                os._exit(3)
            error = contract_error(body)
            if error is not None:   # http_server.py: generate_request: 400 {"error": ...}
                return self._send(400, {"error": error})
            return self._send(200, generate(m, body))
        if path == "/abort_request":   # http_server.py: abort_request (io_struct.AbortReq: rid, abort_all); 200, no body
            with m.lock:
                targets = list(m.running) if body.get("abort_all") else [body.get("rid", "")]
                for rid in targets:
                    if rid in m.running:
                        m.running[rid]["abort"] = True
                m.lock.notify_all()
            return self._send(200, ...)
        if path == "/pause_generation":   # io_struct.PauseGenerationReqInput.mode; http_server.py: {"message", "status"}
            with m.lock:
                m.paused = True
                if body.get("mode", "abort") == "abort":   # tokenizer_manager.py: pause_generation: abort all
                    for state in m.running.values():
                        state["abort"] = True
                m.lock.notify_all()
            return self._send(200, {"message": "Generation paused successfully.", "status": "ok"})
        if path == "/continue_generation":   # io_struct.ContinueGenerationReqInput (torch_empty_cache)
            with m.lock:
                m.paused = False
                m.lock.notify_all()
            return self._send(200, {"message": "Generation continued successfully.", "status": "ok"})
        if path == "/flush_cache":
            # http_server.py: flush_cache: text; 400 unless idle, waiting requests ignored while paused
            # (scheduler.py: flush_cache: is_fully_idle(ignore_waiting=self._engine_paused))
            if m.running and not m.paused:
                return self._send(400, text="Flush cache failed.\n")
            return self._send(200, text="Cache flushed.\nPlease check backend logs for more details.\n")
        if path == "/update_weights_from_tensor":
            return self._send(*self._update_from_tensor(body))
        if path == "/init_weights_update_group":   # io_struct.InitWeightsUpdateGroupReqInput
            m.group = join_group(body)
            return self._send(200, {"success": True, "message": "Succeeded to initialize custom process group."})
        if path == "/update_weights_from_distributed":
            return self._send(*self._update_from_distributed(body))
        if path == "/destroy_weights_update_group":   # io_struct.DestroyWeightsUpdateGroupReqInput (group_name)
            import torch.distributed as dist

            dist.destroy_process_group(m.group)
            m.group = None
            return self._send(200, {"success": True, "message": "Succeeded to destroy custom process group."})
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            # io_struct.ReleaseMemoryOccupationReqInput / ResumeMemoryOccupationReqInput (tags: "weights",
            # "kv_cache"; None: all, constants.py); the handlers return None: 200 with a JSON null
            tags = set((body or {}).get("tags") or ("weights", "kv_cache", "cuda_graph"))
            if path.startswith("/release"):
                m.released |= tags
                if "weights" in tags and not m.args.enable_weights_cpu_backup:
                    m.params = {k: torch.zeros_like(v) for k, v in m.params.items()}   # discarded
            else:
                m.released -= tags
            return self._send(200, None)
        if path == "/_contract/config":
            m.token_s = float(body.get("token_s", m.token_s))
            return self._send(200, {"ok": True})
        if path == "/_contract/dump":
            torch.save(m.params, body["path"])
            return self._send(200, {"ok": True})
        return self._send(404, {"detail": "Not Found"})

    def _update_from_tensor(self, body):
        """`http_server.py: update_weights_from_tensor` (io_struct.UpdateWeightsFromTensorReqInput: one
        base64 payload per TP rank, `MultiprocessingSerializer` -> `SafeUnpickler`; each rank loads its own,
        `weight_updater.py: update_weights_from_tensor`, load_format None: `model.load_weights`)."""
        m = self.model
        payloads = body["serialized_named_tensors"]
        if len(payloads) != m.args.tp_size:
            return 400, {"success": False, "message": f"{len(payloads)} payloads for tp_size {m.args.tp_size}"}
        if body.get("load_format") is not None:
            return 400, {"success": False, "message": f"Unknown load_format={body['load_format']}"}
        for tp_rank, payload in enumerate(payloads):
            named = SafeUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
            for name, tensor in named:
                m.params[name] = tensor.clone()   # the rank's model copies what it loads
                if tp_rank == 0:
                    m.received_order.append(name)
        if body.get("weight_version") is not None:
            m.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "Success"}

    def _update_from_distributed(self, body):
        """`weight_updater.py: receive_weights_from_distributed`: an empty tensor per (name, dtype,
        shape), each broadcast from rank 0 of the group, in list order."""
        import torch.distributed as dist

        m = self.model
        if m.group is None:
            return 400, {"success": False, "message": "Please call `init_weights_update_group` first."}
        handles, weights = [], []
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            w = torch.empty(shape, dtype=getattr(torch, dtype))
            handles.append(dist.broadcast(w, src=0, group=m.group, async_op=True))
            weights.append((name, w))
        for h in handles:
            h.wait()
        for name, w in weights:
            m.params[name] = w
            m.received_order.append(name)
        if body.get("weight_version") is not None:
            m.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "Succeeded to update parameter online."}


def _summary(path, body):
    if path == "/update_weights_from_tensor" and body:
        return {**body, "serialized_named_tensors": [len(p) for p in body["serialized_named_tensors"]]}
    return body


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    print("launch args:", json.dumps(vars(args)), flush=True)
    print("env SGLANG_RETURN_ORIGINAL_LOGPROB =", os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB"), flush=True)
    Handler.model = Model(args)
    ThreadingHTTPServer.request_queue_size = 2048   # uvicorn's default backlog (SGLang serves with uvicorn)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
