"""A fault-injecting HTTP proxy on loopback, between the Tinker SDK and the local backend.

    with FaultProxy(upstream_url, faults=[Fault("503", "forward_backward", 2)]) as proxy:
        subprocess.run([... script ...], env={**env, "TINKER_BASE_URL": proxy.base_url})
        proxy.wait_for(lambda p: p.count("optim_step") >= 3)     # wait for events, never for time

Each Fault hits the n-th request (1-based) of one operation. An operation is a submit path
(`/api/v1/<op>`: forward_backward, optim_step, asample, save_weights, save_weights_for_sampler, ...) or
the result of one: `result:<op>` is the first poll (`/api/v1/retrieve_future`) that carries a result of
that operation's n-th request (the proxy learns request ids from the submit answers). Kinds:

    429-0, 429-1   answered 429 with Retry-After 0 / 1 s, not forwarded
    500, 502, 503  answered with that status, not forwarded
    reset-before   connection reset (RST) without forwarding
    reset-after    forwarded, the server's answer read, then the connection reset: the server acted and the
                   client never hears of it (a lost response)
    delay          forwarded, the answer held past the client's timeout (the client gives up and retries)
    death          the server is killed (SIGKILL of its process group) when the request arrives and the
                   proxy stops listening: the client sees connection refused from then on
    restart        as death, then a new server on the same --run-dir (its database and checkpoints
                   stay) and the proxy listens again on the same port
    sigkill        on_kill() is called (the harness SIGKILLs the script) as the request arrives, which is
                   then forwarded: the server acts for a client that is gone; on `result:OP`, once the
                   server has answered with the result (it applied the request), before the client reads it

The proxy is bounded: it stops by itself `lifetime` seconds after it started, answers every request on a
thread of its own, and never keeps a socket open after close().
"""
from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import random
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

KINDS = ("429-0", "429-1", "500", "502", "503", "reset-before", "reset-after", "delay", "death", "restart", "sigkill")
NOT_FORWARDED = {"429-0": (429, "0"), "429-1": (429, "1"), "500": (500, None), "502": (502, None),
                 "503": (503, None)}
API = "/api/v1/"
# The SDK's own limits: a submit times out after 60 s, a poll of retrieve_future after 45 s.
DELAY_S = {"retrieve_future": 46.0}
DEFAULT_DELAY_S = 61.0


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    op: str  # "forward_backward", ..., or "result:optim_step"
    nth: int  # 1-based

    def __post_init__(self):
        assert self.kind in KINDS, self.kind
        assert self.nth >= 1

    def __str__(self):
        return f"{self.kind}@{self.op}#{self.nth}"


def seeded_faults(seed: int, kind: str, ops_and_counts: dict) -> list[Fault]:
    """One fault of `kind` per operation, at a request number drawn from the seed within the number of such
    requests an uninterrupted run makes (ops_and_counts: {op: count})."""
    rng = random.Random(f"{seed}:{kind}")
    return [Fault(kind, op, rng.randint(1, count)) for op, count in ops_and_counts.items() if count >= 1]


@dataclasses.dataclass
class Event:
    op: str
    n: int  # the n-th request of op
    fault: str | None
    status: int | None  # what the client got (None: reset or no answer)
    request_id: str | None = None
    at: float = 0.0


class FaultProxy:
    def __init__(self, upstream: str, faults=(), *, lifetime: float = 900.0, on_death=None, on_restart=None,
                 on_kill=None):
        """upstream: the server's base URL. on_death(): kill the server; on_restart() -> new upstream URL
        (a server on the same --run-dir), called after on_death for a `restart` fault."""
        self.upstream = upstream.rstrip("/")
        self.faults = {(f.op, f.nth): f for f in faults}
        self.fired: list[Fault] = []
        self.events: list[Event] = []
        self.counts: dict[str, int] = {}
        self.request_ops: dict[str, tuple[str, int]] = {}  # request_id -> (op, n)
        self.attempts: dict[str, int] = {}  # X-Idempotency-Key -> n of its op
        self.results_seen: set[str] = set()
        self.on_death, self.on_restart, self.on_kill = on_death, on_restart, on_kill
        self.dead = False
        self.cond = threading.Condition()
        self.lifetime = lifetime
        self._stopping = threading.Event()
        self._server = None
        self._port = 0
        self._open_sockets: set = set()
        self._start_listening()
        self.base_url = f"http://127.0.0.1:{self._port}"
        self._timer = threading.Timer(lifetime, self.close)
        self._timer.daemon = True
        self._timer.start()

    # ---- listening ------------------------------------------------------------------------------

    def _start_listening(self):
        proxy = self

        class Handler(ProxyHandler):
            owner = proxy

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 128

            def handle_error(self, request, client_address):  # a client gone mid-answer is expected here
                pass

        self._server = Server(("127.0.0.1", self._port), Handler)
        self._port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def _stop_listening(self):
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        with self.cond:
            sockets = list(self._open_sockets)
        for sock in sockets:
            reset(sock)

    def close(self):
        self._stopping.set()
        self._timer.cancel()
        self._stop_listening()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- events ---------------------------------------------------------------------------------

    def count(self, op: str) -> int:
        with self.cond:
            return self.counts.get(op, 0)

    def wait_for(self, predicate, timeout: float = 300.0) -> bool:
        """Block until predicate(self) is true (checked at every request); False after `timeout` s."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 1.0))
        return True

    def _record(self, event: Event):
        with self.cond:
            event.at = time.monotonic()
            self.events.append(event)
            self.cond.notify_all()

    # ---- the faults -----------------------------------------------------------------------------

    def classify(self, path: str, body: bytes, key: str | None = None) -> tuple[str, int, Fault | None]:
        """(op, its request number, the fault scheduled for it) of one request."""
        op = path.split("?", 1)[0].removeprefix(API) if path.startswith(API) else path
        if op == "retrieve_future":
            try:
                rid = json.loads(body).get("request_id")
            except ValueError:
                rid = None
            if rid in self.request_ops and rid not in self.results_seen:
                sub_op, sub_n = self.request_ops[rid]
                key = (f"result:{sub_op}", sub_n)
                fault = self.faults.get(key)
                if fault is not None and fault not in self.fired:
                    return key[0], key[1], fault
        with self.cond:  # an SDK retry (same X-Idempotency-Key) is the same request: same number
            if key and key in self.attempts:
                n = self.attempts[key]
            else:
                self.counts[op] = n = self.counts.get(op, 0) + 1
                if key:
                    self.attempts[key] = n
        fault = self.faults.get((op, n))
        return op, n, fault if fault is not None and fault not in self.fired else None

    def die(self, restart: bool):
        """Kill the server and stop listening; with restart, a new server and the same port again."""
        with self.cond:
            if self.dead:
                return
            self.dead = True
        self._stop_listening()
        if self.on_death is not None:
            self.on_death()
        if restart and self.on_restart is not None and not self._stopping.is_set():
            self.upstream = self.on_restart().rstrip("/")
            self._start_listening()
            with self.cond:
                self.dead = False
                self.cond.notify_all()


def reset(sock):
    """Close with RST (SO_LINGER 0): the peer sees 'connection reset', not a clean end."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class ProxyHandler(BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def setup(self):
        super().setup()
        with self.owner.cond:
            self.owner._open_sockets.add(self.connection)

    def finish(self):
        with contextlib.suppress(OSError, ValueError):
            super().finish()
        with self.owner.cond:
            self.owner._open_sockets.discard(self.connection)

    def do_GET(self):
        self.handle_one()

    def do_POST(self):
        self.handle_one()

    def do_PUT(self):
        self.handle_one()

    def do_DELETE(self):
        self.handle_one()

    def handle_one(self):
        owner = self.owner
        body = self.read_body()
        op, n, fault = owner.classify(self.path, body, self.headers.get("X-Idempotency-Key"))
        kind = fault.kind if fault else None
        if fault is not None:
            with owner.cond:
                owner.fired.append(fault)
        if kind in NOT_FORWARDED:
            status, retry_after = NOT_FORWARDED[kind]
            owner._record(Event(op, n, str(fault), status))
            payload = json.dumps({"detail": f"injected {kind} by the fault proxy"}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            if retry_after is not None:
                self.send_header("Retry-After", retry_after)
            self.end_headers()
            self.wfile.write(payload)
            return
        if kind == "reset-before":
            owner._record(Event(op, n, str(fault), None))
            return self.drop()
        if kind in ("death", "restart"):
            owner._record(Event(op, n, str(fault), None))
            threading.Thread(target=owner.die, args=(kind == "restart",), daemon=True).start()
            return self.drop()
        if kind == "sigkill" and owner.on_kill is not None and not op.startswith("result:"):
            owner.on_kill()
        if owner.dead:
            owner._record(Event(op, n, None, None))
            return self.drop()
        try:
            status, headers, answer = self.forward(body)
        except OSError:  # the server is gone (killed, restarting): the client sees a reset
            owner._record(Event(op, n, str(fault) if fault else None, None))
            return self.drop()
        request_id = None
        if op in ("forward_backward", "optim_step", "asample", "save_weights", "save_weights_for_sampler",
                  "create_model", "load_weights", "forward") and status == 200:
            with contextlib.suppress(ValueError, AttributeError):
                request_id = json.loads(answer).get("request_id")
            if request_id:
                with owner.cond:
                    owner.request_ops.setdefault(request_id, (op, n))
        if op.startswith("result:"):
            with contextlib.suppress(ValueError, AttributeError):
                if json.loads(answer).get("type") == "try_again":
                    # not a result yet: the fault waits for the poll that carries one
                    with owner.cond:
                        owner.fired.remove(fault)
                    fault, kind = None, None
        if op == "retrieve_future" or op.startswith("result:"):
            with contextlib.suppress(ValueError):
                rid = json.loads(body).get("request_id")
                if rid and fault is None and not _is_try_again(answer):
                    with owner.cond:
                        owner.results_seen.add(rid)
        if kind == "sigkill" and owner.on_kill is not None:  # a result: the server has applied the request
            owner.on_kill()
        if kind == "reset-after":
            owner._record(Event(op, n, str(fault), None, request_id))
            return self.drop()
        if kind == "delay":
            owner._record(Event(op, n, str(fault), None, request_id))
            base = op.removeprefix("result:")
            wait = DELAY_S.get("retrieve_future" if op.startswith("result:") else base, DEFAULT_DELAY_S)
            owner._stopping.wait(wait)  # the client has given up by now; its retry gets a normal answer
            return self.drop()
        owner._record(Event(op, n, None, status, request_id))
        self.send_response(status)
        for key, value in headers:
            if key.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def read_body(self) -> bytes:
        """The request body, by Content-Length or chunked (the whole of it: the connection stays in step)."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def forward(self, body):
        parts = urlsplit(self.owner.upstream)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
        try:
            headers = {k: v for k, v in self.headers.items()
                       if k.lower() not in ("host", "connection", "transfer-encoding", "content-length")}
            conn.request(self.command, self.path, body=body or None, headers=headers)
            response = conn.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            conn.close()

    def drop(self):
        self.close_connection = True
        reset(self.connection)


def _is_try_again(answer: bytes) -> bool:
    try:
        return json.loads(answer).get("type") == "try_again"
    except (ValueError, AttributeError):
        return False
