"""Local HTTP services for reward tests: a reward service and an OpenAI-style chat judge on 127.0.0.1.

Run as a script (`python fake_services.py reward|judge PORT_FILE`) it serves until killed and
writes its port to PORT_FILE, so a training job's test can start it, and kill it mid-run.
"""
from __future__ import annotations

import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def reward_answer(payload: dict) -> dict:
    """Score 1 when the response contains the ground truth, with its length as a metric; a response
    containing "BAD" gets an item error."""
    scores = []
    for item in payload["items"]:
        if "BAD" in str(item["response"]):
            scores.append({"error": "cannot score"})
        else:
            scores.append({"score": float(str(item["ground_truth"]) in str(item["response"])),
                           "length": float(len(str(item["response"])))})
    return {"scores": scores}


def digits_answer(payload: dict) -> dict:
    """jobs/tasks/digits.py's reward as a service: the fraction of the first 8 characters that are digits."""
    return {"scores": [{"score": sum(c.isdigit() for c in str(i["response"])[:8]) / 8} for i in payload["items"]]}


def judge_answer(payload: dict) -> dict:
    """A judge that rates 10 when the response repeats the reference answer, 0 when not, and answers
    with no number at all when the response has no digit (a parse failure)."""
    user = payload["messages"][-1]["content"]
    ref = re.search(r"Reference answer:\n(.*?)\n\nResponse:\n(.*?)\n\nRate", user, re.DOTALL)
    if ref is None:
        content = "I cannot tell."
    elif not any(c.isdigit() for c in ref.group(2)):
        content = "Hmm, hard to say."
    else:
        content = "10" if ref.group(1).strip() and ref.group(1).strip() in ref.group(2) else "Rating: 0"
    return {"id": "x", "object": "chat.completion", "model": payload.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}


LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    answer = staticmethod(reward_answer)
    requests: list = []
    fail_next = 0   # answer HTTP 503 this many times first (retries)
    delay_s = 0.0
    answered = 0
    stop_after = 0   # > 0: the process exits right after answering this many requests (a service dying mid-run)

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        cls.requests.append(body)
        if cls.delay_s:
            import time
            time.sleep(cls.delay_s)
        if cls.fail_next > 0:
            cls.fail_next -= 1
            self.send_response(503)
            self.end_headers()
            return
        data = json.dumps(cls.answer(body)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()
        with LOCK:
            cls.answered += 1
            if cls.stop_after and cls.answered >= cls.stop_after:
                import os
                os._exit(0)

    def log_message(self, *args):
        pass


def serve(kind: str) -> tuple[ThreadingHTTPServer, str]:
    """Start a server thread; (server, base url). Stop with server.shutdown()."""
    answer = {"reward": reward_answer, "digits": digits_answer, "judge": judge_answer}[kind]
    handler = type(f"{kind}Handler", (Handler,), {"answer": staticmethod(answer), "requests": []})
    server_class = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 256})   # 32 clients connect at once
    server = server_class(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    server.handler = handler
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


if __name__ == "__main__":
    srv, url = serve(sys.argv[1])
    srv.handler.stop_after = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    with open(sys.argv[2], "w") as f:
        f.write(url)
    threading.Event().wait()
