#!/usr/bin/env python3
"""Emulator of the Ollama server's HTTP API, for guard's integration tests.

Ollama itself cannot be installed in the test environment, so this stands in
for it. It follows Ollama's documented API (docs/api.md): /api/generate,
/api/chat, /api/embed, /api/embeddings, /api/tags, /api/ps, /api/show and
/api/version, closely enough that the official `ollama` Python client works
against it unchanged. Generation is simulated (words "tok0 ", "tok1 ", ...
emitted one every --token-delay-ms), model loads cost --load-ms, and a control
API (GET /emulator/stats, POST /emulator/reset) lets tests observe what guard
forwarded. Standard library only; binds 127.0.0.1.

Usage: ollama_emulator.py --port N [--models a:1b,b:135m] [--token-delay-ms 20]
       [--tokens 12] [--load-ms 300] [--vram-ratio 1.0] [--remote-models x-cloud]
"""
import argparse
import hashlib
import json
import math
import re
import select
import signal
import socket
import sys
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL_SIZE = 100_000_000
DEFAULT_KEEP_ALIVE = 300.0  # seconds (Ollama's default "5m")
FOREVER = float("inf")
EMBED_DIM = 16
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}


def iso(ts):
    """RFC 3339 UTC timestamp, as Ollama writes it."""
    ts = min(ts, time.time() + 100 * 365 * 86400)  # "forever" -> far future
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def parse_keep_alive(v):
    """keep_alive -> seconds: number = seconds, string = Go duration, < 0 = forever."""
    if v is None or v == "":
        return DEFAULT_KEEP_ALIVE
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            sign = -1 if v.startswith("-") else 1
            parts = _DURATION.findall(v)
            if not parts:
                return DEFAULT_KEEP_ALIVE
            v = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    v = float(v)
    return FOREVER if v < 0 else v


def details_for(name):
    tag = name.partition(":")[2]
    size = tag.upper() if re.fullmatch(r"\d+(\.\d+)?[mb]", tag) else "1B"
    return {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
            "parameter_size": size, "quantization_level": "Q4_K_M"}


def digest_for(name):
    return hashlib.sha256(name.encode()).hexdigest()


class Emulator:
    """Shared state: known models, loaded models and the test counters."""

    def __init__(self, args):
        self.args = args
        self.remote = set(filter(None, args.remote_models.split(",")))
        self.models = list(dict.fromkeys(
            [m for m in args.models.split(",") if m] + sorted(self.remote)))
        self.lock = threading.Lock()
        self.loaded = {}  # name -> expiry (epoch seconds)
        self.busy = {}  # name -> generations in flight (never expire while busy)
        self.load_locks = {m: threading.Lock() for m in self.models}
        self.started = time.time()
        self.reset()

    def reset(self):
        with self.lock:
            self.requests = {}
            self.active = getattr(self, "active", 0)
            self.max_active = self.active
            self.cancelled = 0
            self.tokens = 0

    def resolve(self, name):
        """Canonical model name ("x" means "x:latest"), or None if unknown."""
        if not isinstance(name, str):
            return None
        for cand in (name, name + ":latest"):
            if cand in self.models:
                return cand
        return None

    def count_request(self, path):
        with self.lock:
            self.requests[path] = self.requests.get(path, 0) + 1

    def add_tokens(self, n):
        with self.lock:
            self.tokens += n

    def cancel(self):
        with self.lock:
            self.cancelled += 1

    def stats(self):
        with self.lock:
            return {"requests": dict(self.requests), "active": self.active,
                    "max_active": self.max_active, "cancelled": self.cancelled,
                    "tokens_generated": self.tokens}

    def _purge(self):  # caller holds self.lock
        now = time.time()
        for m, exp in list(self.loaded.items()):
            if exp <= now and not self.busy.get(m):
                del self.loaded[m]

    def begin(self, model):
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.busy[model] = self.busy.get(model, 0) + 1

    def end(self, model, keep_alive):
        """Request finished: refresh the expiry, or unload if keep_alive is 0."""
        with self.lock:
            self.active -= 1
            self.busy[model] -= 1
            if keep_alive == 0:
                self.loaded.pop(model, None)
            elif model in self.loaded:
                self.loaded[model] = time.time() + keep_alive

    def ensure_loaded(self, model):
        """Load the model if cold (sleeping --load-ms); returns load time in ns."""
        t0 = time.monotonic_ns()
        if model in self.remote:  # cloud models run remotely: nothing to load
            return time.monotonic_ns() - t0
        with self.load_locks[model]:
            with self.lock:
                self._purge()
                cold = model not in self.loaded
            if cold:
                time.sleep(self.args.load_ms / 1000)
                with self.lock:
                    self.loaded[model] = time.time() + DEFAULT_KEEP_ALIVE
        return time.monotonic_ns() - t0

    def unload(self, model):
        with self.lock:
            self.loaded.pop(model, None)

    def running(self):
        with self.lock:
            self._purge()
            items = sorted(self.loaded.items())
        size = MODEL_SIZE
        return [{"name": m, "model": m, "size": size, "digest": digest_for(m),
                 "details": details_for(m), "expires_at": iso(exp),
                 "size_vram": int(size * self.args.vram_ratio), "context_length": 4096}
                for m, exp in items]


def embedding(text):
    """Deterministic unit vector derived from the text."""
    h = hashlib.sha256(text.encode()).digest()
    v = [(b - 127.5) / 127.5 for b in h[:EMBED_DIM]]
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


class BadRequest(Exception):
    pass


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # one packet per token, no Nagle delays
    server_version = "ollama-emulator"

    def log_message(self, fmt, *args):  # quiet unless --verbose
        if self.server.emu.args.verbose:
            super().log_message(fmt, *args)

    # ---- dispatch -------------------------------------------------------
    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def _dispatch(self, method):
        path = self.path.split("?", 1)[0]
        emu = self.server.emu
        if not path.startswith("/emulator/"):
            emu.count_request(path)  # counted as soon as the headers are in
        routes = {
            ("GET", "/"): self.root, ("HEAD", "/"): self.root,
            ("GET", "/api/version"): lambda: self.send_json(200, {"version": "0.12.0"}),
            ("GET", "/api/tags"): self.tags, ("GET", "/api/ps"): self.ps,
            ("POST", "/api/show"): self.show,
            ("POST", "/api/generate"): lambda: self.generate("generate"),
            ("POST", "/api/chat"): lambda: self.generate("chat"),
            ("POST", "/api/embed"): self.embed, ("POST", "/api/embeddings"): self.embeddings,
            ("GET", "/emulator/stats"): lambda: self.send_json(200, emu.stats()),
            ("POST", "/emulator/reset"): self.reset,
        }
        try:
            handler = routes.get((method, path))
            if handler is None:
                self.read_body()
                known = any(p == path for _, p in routes)
                self.send_json(405 if known else 404,
                               {"error": "method not allowed" if known else "404 page not found"})
            else:
                handler()
        except BadRequest as e:
            self.send_json(400, {"error": str(e)})
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            self.close_connection = True

    # ---- HTTP helpers ---------------------------------------------------
    def read_body(self):
        """Request body, supporting Content-Length and chunked encoding."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def read_json(self):
        raw = self.read_body()
        if not raw.strip():
            return {}
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"invalid JSON: {e}")
        if not isinstance(obj, dict):
            raise BadRequest("request body must be a JSON object")
        return obj

    def send_json(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def require_model(self, req):
        name = req.get("model") or req.get("name")
        if not name:
            raise BadRequest("model is required")
        model = self.server.emu.resolve(name)
        if model is None:
            self.send_json(404, {"error": f"model '{name}' not found"})
        return model

    def write_chunk(self, obj):
        """One NDJSON line as one HTTP chunk; False if the client is gone."""
        data = json.dumps(obj).encode() + b"\n"
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
            return True
        except OSError:
            return False

    def client_gone_within(self, seconds):
        """Sleep up to `seconds`; True as soon as the client closes the socket."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            try:
                readable, _, _ = select.select([self.connection], [], [], max(left, 0))
                if readable:
                    if self.connection.recv(1, socket.MSG_PEEK) == b"":
                        return True
                    time.sleep(max(deadline - time.monotonic(), 0))  # pipelined data
                    return False
            except OSError:
                return True
            if left <= 0:
                return False

    # ---- endpoints ------------------------------------------------------
    def root(self):
        body = b"Ollama is running"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def tags(self):
        emu = self.server.emu
        self.send_json(200, {"models": [
            {"name": m, "model": m, "modified_at": iso(emu.started), "size": MODEL_SIZE,
             "digest": digest_for(m), "details": details_for(m)} for m in emu.models]})

    def ps(self):
        self.send_json(200, {"models": self.server.emu.running()})

    def show(self):
        model = self.require_model(self.read_json())
        if model is None:
            return
        out = {"modelfile": f"FROM {model}\n", "parameters": "stop \"<|im_end|>\"",
               "template": "{{ .Prompt }}", "details": details_for(model),
               "model_info": {"general.architecture": "llama",
                              "general.parameter_count": 135_000_000,
                              "llama.context_length": 8192},
               "capabilities": ["completion"], "modified_at": iso(self.server.emu.started)}
        if model in self.server.emu.remote:
            out.update(remote_host="https://ollama.com:443", remote_model=model)
        self.send_json(200, out)

    def reset(self):
        self.read_body()
        self.server.emu.reset()
        self.send_json(200, self.server.emu.stats())

    def generate(self, kind):
        """/api/generate (kind "generate") and /api/chat (kind "chat")."""
        emu, args = self.server.emu, self.server.emu.args
        req = self.read_json()
        model = self.require_model(req)
        if model is None:
            return
        keep_alive = parse_keep_alive(req.get("keep_alive"))
        if kind == "generate":
            text_in = req.get("prompt") or ""
            part = lambda t: {"response": t}
        else:
            msgs = req.get("messages") or []
            text_in = " ".join(str(m.get("content") or "") for m in msgs if isinstance(m, dict))
            part = lambda t: {"message": {"role": "assistant", "content": t}}

        def obj(text, done, **extra):
            return {"model": req.get("model") or req.get("name"), "created_at": iso(time.time()),
                    **part(text), "done": done, **extra}

        # No prompt/messages: load the model, or unload it with keep_alive 0.
        if not (req.get("prompt") if kind == "generate" else req.get("messages")):
            if keep_alive == 0:
                emu.unload(model)
                return self.send_json(200, obj("", True, done_reason="unload"))
            emu.begin(model)
            try:
                emu.ensure_loaded(model)
            finally:
                emu.end(model, keep_alive)
            return self.send_json(200, obj("", True, done_reason="load"))

        n, reason = args.tokens, "stop"
        num_predict = (req.get("options") or {}).get("num_predict")
        if isinstance(num_predict, int) and 0 <= num_predict < n:
            n, reason = num_predict, "length"
        stream = req.get("stream") is not False
        prompt_tokens = max(1, len(text_in.split()))
        emu.begin(model)
        try:
            t0 = time.monotonic_ns()
            load_ns = emu.ensure_loaded(model)
            t1 = t_first = time.monotonic_ns()
            if stream:
                self.send_response(200)
                self.send_header("Content-Type", "application/x-ndjson")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
            pieces = []
            for i in range(n):
                tok = f"tok{i} "
                if self.client_gone_within(args.token_delay_ms / 1000) or (
                        stream and not self.write_chunk(obj(tok, False))):
                    emu.cancel()  # client went away: stop generating at once
                    self.close_connection = True
                    return
                if i == 0:
                    t_first = time.monotonic_ns()
                pieces.append(tok)
                emu.add_tokens(1)
            t2 = time.monotonic_ns()
            final = obj("" if stream else "".join(pieces), True, done_reason=reason,
                        total_duration=t2 - t0, load_duration=load_ns,
                        prompt_eval_count=prompt_tokens, prompt_eval_duration=t_first - t1,
                        eval_count=n, eval_duration=t2 - t_first)
            if kind == "generate":
                final["context"] = list(range(1, prompt_tokens + n + 1))
            if not stream:
                return self.send_json(200, final)
            if self.write_chunk(final):
                # llama-server writes its chunked terminator apart from the last event; a delay
                # here makes that gap wide enough for a test to see.
                time.sleep(args.end_delay_ms / 1000)
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.close_connection = True
        finally:
            emu.end(model, keep_alive)

    def _embed_common(self, texts):
        emu = self.server.emu
        req = self.read_json()
        model = self.require_model(req)
        if model is None:
            return None
        keep_alive = parse_keep_alive(req.get("keep_alive"))
        inputs = texts(req)
        if not all(isinstance(t, str) for t in inputs):
            raise BadRequest("input must be a string or a list of strings")
        emu.begin(model)
        try:
            t0 = time.monotonic_ns()
            load_ns = emu.ensure_loaded(model)
            vecs = [embedding(t) for t in inputs]
            return {"model": req.get("model") or req.get("name"), "embeddings": vecs,
                    "total_duration": time.monotonic_ns() - t0, "load_duration": load_ns,
                    "prompt_eval_count": sum(max(1, len(t.split())) for t in inputs)}
        finally:
            emu.end(model, keep_alive)

    def embed(self):
        def texts(req):
            inp = req.get("input")
            return [] if inp is None else [inp] if isinstance(inp, str) else list(inp)
        out = self._embed_common(texts)
        if out is not None:
            self.send_json(200, out)

    def embeddings(self):  # legacy endpoint: {"prompt": str} -> {"embedding": [...]}
        out = self._embed_common(lambda req: [req["prompt"]] if req.get("prompt") else [])
        if out is not None:
            self.send_json(200, {"embedding": out["embeddings"][0] if out["embeddings"] else []})


class Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # SIGTERM exits at once, even mid-stream


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--models", default="smollm2:135m")
    p.add_argument("--token-delay-ms", type=float, default=20)
    p.add_argument("--tokens", type=int, default=12)
    p.add_argument("--end-delay-ms", type=float, default=0,
                   help="pause between a stream's last line and its chunked terminator")
    p.add_argument("--load-ms", type=float, default=300)
    p.add_argument("--vram-ratio", type=float, default=1.0)
    p.add_argument("--remote-models", default="")
    p.add_argument("--verbose", action="store_true", help="log requests to stderr")
    args = p.parse_args()

    server = Server(("127.0.0.1", args.port), Handler)
    server.emu = Emulator(args)
    stop = lambda *_: threading.Thread(target=server.shutdown, daemon=True).start()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"READY {server.server_address[1]}", flush=True)
    server.serve_forever()
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
