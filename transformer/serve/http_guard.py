"""What one stranger may cost `transformer serve` below its API: a cap on open connections, deadlines for a
request's head and body and for idle connections, a body limit that counts the bytes as they arrive, the Host
names it answers to, and a stop on SIGTERM that drains what is in flight and exits 0.

uvicorn's h11 protocol times out only idle kept-alive connections: a client that opens a connection and sends
nothing, or half a request line, holds a file descriptor forever; and a flood of them ends in "too many open files",
which asyncio logs with a traceback per failed accept. These are the missing pieces, in uvicorn's own terms.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import ipaddress
import json
import os
import resource
import signal
import socket
import struct
import sys
import termios
import time
from collections.abc import Callable, Iterable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from transformer.serve.request_batching import release_freed_memory

# Connections the kernel may queue before they are accepted; also the most asyncio accepts in one go, so the
# open-file budget keeps room for them on top of --max-connections.
BACKLOG = 256
MAX_HEAD = 16 * 1024  # bytes of a request's line and headers; h11 buffers at most this much of an unfinished one
# What clients slower than their answers may hold: each must take at least MIN_SEND_RATE bytes a second of it
# (averaged over --read-timeout), counting what the server holds and what its kernel still has to send, and all of
# them together may leave at most UNSENT_BUDGET bytes unsent in the server's memory (past it, those that have been
# slow the longest are dropped). 32 KiB/s takes the largest answer (about 15 MB) in 8 minutes.
MIN_SEND_RATE = 32 * 1024
UNSENT_BUDGET = 128 * 2**20
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
# Every response: no sniffing, and the page may load only what this server serves (no CDN, no inline code).
HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
}
_PHRASES = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}


def error_json(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def raw_error(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection, for where no request has been parsed."""
    body = error_json(message)
    head = (
        f"HTTP/1.1 {status} {_PHRASES[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n"
        + "".join(f"{name}: {value}\r\n" for name, value in HEADERS.items())
        + "\r\n"
    )
    return head.encode() + body


def kernel_unsent(sock) -> int:
    """Bytes in a socket's kernel send queue, not yet taken by the peer (Linux's SIOCOUTQ); 0 where it cannot be
    asked (another system, a closed socket): there, only the server's own buffer is timed."""
    if sock is None or not hasattr(termios, "TIOCOUTQ"):
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 0


# ----------------------------------------------------------------------------- connections


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus a cap on open connections (past it, a new one gets 503 and is closed), a
    deadline for each request's head (from the connection's opening, or the first byte after an answer, the
    request line and headers must arrive within read_timeout seconds: a fixed deadline, so that a byte now and
    then does not keep a connection), and bounds on what clients slower than their answers hold in memory: each
    must take MIN_SEND_RATE bytes a second of its answer (over each read_timeout), or is dropped, and together they
    may leave UNSENT_BUDGET bytes unsent, past which the longest slow are dropped (without them a reader of a few
    bytes a second held a large answer for hours, and a few dozen such readers held hundreds of MiB). uvicorn
    closes idle kept-alive connections
    (config.timeout_keep_alive); RequestGuard times the body."""

    _trim_pending = False  # a release of freed memory is scheduled (one at a time, for every connection)

    def __init__(self, *args, max_connections: int, read_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_connections, self.read_timeout = max_connections, read_timeout
        self.head_timer: asyncio.TimerHandle | None = None
        self.send_timer: asyncio.TimerHandle | None = None
        self.slow_since = 0.0  # when the client last fell behind its answer (while send_timer runs)
        self.held = 0  # the most of an answer this connection has left unsent
        self.close_when_sent = False  # idle past the keep-alive timeout while its answer was still on its way

    def connection_made(self, transport) -> None:
        if len(self.connections) >= self.max_connections:
            self.transport = transport  # for connection_lost; this connection is never counted
            transport.write(
                raw_error(
                    503,
                    f"too many open connections (serve --max-connections {self.max_connections}); try again shortly",
                )
            )
            transport.close()
            return
        super().connection_made(transport)
        self._time_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._time_head()

    def send_400_response(self, msg: str) -> None:
        """h11's refusal of bytes that are no HTTP/1.1 request (or a head past MAX_HEAD while still arriving), as
        JSON like every other refusal: uvicorn's is plain text ("Invalid HTTP request received.")."""
        if self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete:
            self.transport.close()  # an answer is on its way: no second one can follow it
            return
        self.transport.write(
            raw_error(
                400,
                f"the request is not valid HTTP/1.1, or its line and headers are larger than {MAX_HEAD} bytes",
            )
        )
        self.transport.close()

    def connection_lost(self, exc) -> None:
        self._stop_head_timer()
        self._stop_send_timer()
        super().connection_lost(exc)
        if self.held > UNSENT_BUDGET // 64:  # a large answer's copy is freed: give the memory back (soon, once)
            self._release_memory_soon()

    def pause_writing(self) -> None:
        """The client takes the answer slower than it comes: from now on it must take MIN_SEND_RATE bytes a second
        of it (checked every read_timeout seconds), and the slow clients' unsent answers must fit UNSENT_BUDGET."""
        super().pause_writing()
        self.held = max(self.held, self.transport.get_write_buffer_size())
        self._time_sending()
        self._within_budget()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timer, or starts a pipelined request
        if not self.transport.is_closing():
            self._time_sending()  # an answer the kernel still holds is timed as one the server holds
        self._time_head()

    def timeout_keep_alive_handler(self) -> None:
        """An idle connection is closed, but not while its answer is still on its way: closed, the kernel would go
        on sending it at the client's pace, past the rule below; _check_sending closes it once it is sent."""
        if self.send_timer is not None and self._unsent():
            self.close_when_sent = True
            return
        super().timeout_keep_alive_handler()

    def _unsent(self) -> int:
        """Bytes of its answers the client has not taken: in the transport's buffer and in the kernel's send queue
        (what the kernel's socket buffers hold, megabytes with Linux's autotuning, is as slow a client's to take)."""
        return self.transport.get_write_buffer_size() + kernel_unsent(self.transport.get_extra_info("socket"))

    def _time_sending(self) -> None:
        if self.send_timer is None and (unsent := self._unsent()):
            self.unsent, self.slow_since = unsent, self.loop.time()
            self.send_timer = self.loop.call_later(self.read_timeout, self._check_sending)

    def _check_sending(self) -> None:
        left = self._unsent()
        if not left:  # all of it taken
            self.send_timer = None
            if self.close_when_sent:
                super().timeout_keep_alive_handler()
        elif self.unsent - left >= min(self.unsent, MIN_SEND_RATE * self.read_timeout) or left > self.unsent:
            # More unsent than before: the next answer was queued, which the server does only once the client has
            # taken the last one (uvicorn waits for the buffer to drain); measured from here on, not from the last.
            self.unsent = left
            self.send_timer = self.loop.call_later(self.read_timeout, self._check_sending)
        else:
            self.send_timer = None
            self._drop()

    def _drop(self) -> None:
        """Close the connection now, with what the kernel holds of the answer: a plain close would let the kernel
        go on sending its buffer (megabytes, at the client's pace); a reset (SO_LINGER 0) discards it."""
        self._stop_send_timer()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def _within_budget(self) -> None:
        """Drop the clients that have been slow the longest until the slow ones' unsent answers fit UNSENT_BUDGET."""
        slow = sorted((c for c in self.connections if c.send_timer is not None), key=lambda c: c.slow_since)
        unsent = {c: c.transport.get_write_buffer_size() for c in slow}
        total = sum(unsent.values())
        for c in slow:
            if total <= UNSENT_BUDGET:
                break
            total -= unsent[c]
            c._drop()

    def _release_memory_soon(self) -> None:
        """malloc_trim, once, a second from now and off the event loop: freed answers otherwise stay in the
        allocator's arenas (the server's memory stayed well above its start after many slow clients left)."""
        if GuardedH11Protocol._trim_pending:
            return
        GuardedH11Protocol._trim_pending = True

        def release() -> None:
            GuardedH11Protocol._trim_pending = False
            self.loop.run_in_executor(None, release_freed_memory)

        self.loop.call_later(1.0, release)

    def _stop_send_timer(self) -> None:
        if self.send_timer is not None:
            self.send_timer.cancel()
            self.send_timer = None

    def _time_head(self) -> None:
        """The head's deadline runs while no request is being answered and uvicorn's keep-alive timer does
        not (it stops that timer at the first byte of the next request)."""
        waiting = self.cycle is None or self.cycle.response_complete
        if not waiting or self.transport.is_closing():
            self._stop_head_timer()
        elif self.head_timer is None and self.timeout_keep_alive_task is None:
            self.head_timer = self.loop.call_later(self.read_timeout, self._head_too_slow)

    def _stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_too_slow(self) -> None:
        self.head_timer = None
        if self.transport.is_closing():
            return
        started = bool(self.conn.trailing_data[0]) and self.conn.their_state is h11.IDLE
        if started:  # half a request: say why it ends; a connection that sent nothing is simply closed
            self.transport.write(
                raw_error(
                    408,
                    f"the request's line and headers did not arrive within "
                    f"{self.read_timeout:g} s (serve --read-timeout)",
                )
            )
        self.transport.close()


LATER_FILES = 64  # files the server opens after start-up (the page's, a log's): kept out of the connections' share


def open_file_budget(max_connections: int) -> tuple[int, str | None]:
    """-> (connections this process can hold open, a note when that is fewer than max_connections). Raises the
    soft limit on open files up to the hard one where more are needed: each connection holds one, and so
    would the backlog accepted in one go."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    need = max_connections + in_use + BACKLOG + LATER_FILES
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections, None
    fits = connections_that_fit(soft, in_use)
    if fits >= max_connections:
        return max_connections, None
    return fits, (
        f"note: this process may open {soft} files (ulimit -n), so serve holds at most {fits} "
        f"connections at once, not --max-connections {max_connections}; raise the limit for more"
    )


def connections_that_fit(limit: int, in_use: int) -> int:
    """Connections to hold under a limit of open files too small for --max-connections and a whole backlog: half of
    what is left after the files in use and LATER_FILES, the other half for a burst of accepts (each new connection
    holds a file until it is answered, or refused with 503 past the cap). A burst larger than that waits in the
    kernel's queue (quiet_accept_errors says so once a minute). Under `ulimit -n 256` this held 1 connection."""
    return max(1, (limit - in_use - LATER_FILES) // 2)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, every_s: float = 60.0) -> None:
    """asyncio logs a traceback for every accept() that fails for lack of file descriptors (thousands a
    second once they run out): one line instead, at most every `every_s` seconds, with the count."""
    default = loop.get_exception_handler()
    state = {"last": float("-inf"), "count": 0}

    def handler(loop, context: dict) -> None:
        e = context.get("exception")
        if not (
            isinstance(e, OSError)
            and e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
            and "accept" in context.get("message", "")
        ):
            return default(loop, context) if default else loop.default_exception_handler(context)
        state["count"] += 1
        now = time.monotonic()
        if now - state["last"] >= every_s:
            print(
                f"serve: cannot accept connections: {e.strerror} ({state['count']} refused since the last such "
                "message); waiting clients are taken as others leave. Lower --max-connections or raise "
                "`ulimit -n`",
                file=sys.stderr,
                flush=True,
            )
            state["last"], state["count"] = now, 0

    loop.set_exception_handler(handler)


# ----------------------------------------------------------------------------- requests


class Drain:
    """The server's stop: from begin() (SIGTERM or Ctrl-C) new requests are refused with 503 and those in flight
    go on; `seconds` later whatever still waits is answered 503 (the callbacks in `on_over`)."""

    def __init__(self, seconds: float):
        self.seconds, self.draining = seconds, False
        self.over = asyncio.Event()
        self.on_over: list[Callable[[], None]] = []

    def begin(self) -> None:
        if not self.draining:
            self.draining = True
            asyncio.get_running_loop().call_later(self.seconds, self.end)

    def end(self) -> None:
        if not self.over.is_set():
            self.over.set()
            for callback in self.on_over:
                callback()


def host_name(value: str) -> str:
    """A Host header's (or --allow-host's) name: lower case, without its port or a final dot; IPv6 in brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value.split("]", 1)[0] + "]"
    if value.count(":") > 1:  # a bare IPv6 address (from --allow-host)
        return f"[{value}]"
    return value.split(":", 1)[0].rstrip(".")


def allowed_hosts(listen_host: str, extra: Iterable[str]) -> frozenset[str] | None:
    """The Host names served: loopback names, the --host name unless it is a wildcard, and --allow-host's;
    None for any ('*'). The address a connection reached is always served as well (RequestGuard)."""
    extra = list(extra)
    if "*" in extra:
        return None
    names = set(LOOPBACK_NAMES) | {host_name(name) for name in extra}
    try:
        if not ipaddress.ip_address(listen_host).is_unspecified:
            names.add(host_name(listen_host))
    except ValueError:  # a name, not an address
        if listen_host:
            names.add(host_name(listen_host))
    return frozenset(names)


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class RequestGuard:
    """ASGI middleware before the API: refuses requests while the server stops (503), heads past MAX_HEAD (431)
    and requests for another Host (421: a page elsewhere cannot read the API through DNS rebinding), checks a
    POST's Content-Type (415), then
    reads the whole body itself, counting its bytes as they arrive whatever Content-Length says or whether it is
    chunked (413 past max_body_bytes) within read_timeout seconds (408), and hands the app the body as one
    message. A refusal before the body is read closes the connection. Every response gets HEADERS."""

    def __init__(self, app, hosts: frozenset[str] | None, max_body_bytes: int, read_timeout: float, drain: Drain):
        self.app, self.hosts, self.max_body_bytes = app, hosts, max_body_bytes
        self.read_timeout, self.drain = read_timeout, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [
                    (k.lower().encode(), v.encode()) for k, v in HEADERS.items()
                ]
            await send(message)

        try:
            self._check(scope)
            body = await self._read_body(receive)
        except _Refused as e:
            return await _send_error(send_with_headers, e.status, e.message)
        if body is None:  # the client went away
            return
        replayed = False

        async def receive_once():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # from now on: http.disconnect, when the client goes

        await self.app(scope, receive_once, send_with_headers)

    def _check(self, scope) -> None:
        if self.drain.draining:
            raise _Refused(503, "the server is shutting down")
        head = (
            len(scope.get("raw_path", b""))
            + len(scope["query_string"])
            + sum(len(n) + len(v) + 4 for n, v in scope["headers"])
        )
        if head > MAX_HEAD:  # h11 bounds only a head still arriving; one that came in one piece is counted here
            raise _Refused(431, f"the request's line and headers are larger than {MAX_HEAD} bytes")
        headers = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        if self.hosts is not None:
            host = host_name(headers.get("host", ""))
            server = scope.get("server") or ("",)
            if not host:
                raise _Refused(400, "a request needs a Host header")
            if host not in self.hosts and host != host_name(str(server[0])):
                raise _Refused(
                    421,
                    f"this server does not answer to the host name {host!r} (it answers to "
                    f"{', '.join(sorted(self.hosts))} and its own address); to serve that name, "
                    f"start it with --allow-host {host}",
                )
        if scope["method"] == "POST":
            if headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
                raise _Refused(415, "send the body as JSON, with the header Content-Type: application/json")
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            raise _Refused(413, f"the body is larger than {self.max_body_bytes} bytes")

    async def _read_body(self, receive) -> bytes | None:
        """The body, counted as it arrives and within the deadline; None when the client went away."""
        deadline, chunks, size = time.monotonic() + self.read_timeout, [], 0
        while True:
            message = await self._next(receive, deadline)
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _Refused(413, f"the body is larger than {self.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _next(self, receive, deadline: float) -> dict:
        """The next ASGI message, unless the deadline passes (408) or the server's drain ends first (503)."""
        got, over = asyncio.ensure_future(receive()), asyncio.ensure_future(self.drain.over.wait())
        try:
            await asyncio.wait(
                {got, over}, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            over.cancel()
            if not got.done():
                got.cancel()
        if got.done() and not got.cancelled():
            return got.result()
        if self.drain.over.is_set():
            raise _Refused(503, "the server is shutting down")
        raise _Refused(408, f"the body did not arrive within {self.read_timeout:g} s (serve --read-timeout)")


async def _send_error(send, status: int, message: str) -> None:
    body = error_json(message)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


# ----------------------------------------------------------------------------- the server


class DrainingServer(uvicorn.Server):
    """uvicorn's server, stopping the way `serve` promises: on SIGTERM or Ctrl-C it stops accepting, lets the
    requests in flight finish for up to drain.seconds, answers the rest 503 and returns, so that the process
    exits 0 (uvicorn raises the signal again once stopped, ending the process "killed by SIGTERM")."""

    def __init__(self, config: uvicorn.Config, drain: Drain, ready: str = ""):
        super().__init__(config)
        self.drain, self.ready = drain, ready  # printed once serving (and SIGTERM handled), for who waits on it

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting; what is in flight is answered 503 (shutdown)
        else:
            self.should_exit = True

    async def startup(self, sockets=None) -> None:
        quiet_accept_errors(asyncio.get_running_loop())
        await super().startup(sockets=sockets)
        if self.ready and self.started:
            print(self.ready, file=sys.stderr, flush=True)

    async def shutdown(self, sockets=None) -> None:
        busy = len(self.server_state.tasks)
        if busy:
            print(
                f"serve: stopping: answering the {busy} request(s) in flight, for up to {self.drain.seconds:g} s "
                "(serve --drain-timeout)",
                file=sys.stderr,
                flush=True,
            )
        self.drain.begin()
        await super().shutdown(sockets=sockets)  # returns at once after a second Ctrl-C (force_exit)
        self.drain.end()  # whatever still waits is answered 503
        await self._answers_sent(seconds=2.0)
        if self.force_exit:  # uvicorn skips the app's shutdown then; the loop's end would cancel it, with a traceback
            await self.lifespan.shutdown()

    async def _answers_sent(self, seconds: float) -> None:
        """Let the requests that the drain's end answered send their 503 before the event loop ends: a request task
        that the loop's end cancels instead gets uvicorn's plain-text 500 and a traceback in the log. Every request
        waiting on the model or its body returns at once once the drain is over, so this takes milliseconds."""
        deadline = time.monotonic() + seconds
        while self.server_state.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


def protocol_class(max_connections: int, read_timeout: float):
    """The http protocol for uvicorn.Config(http=...)."""
    return functools.partial(GuardedH11Protocol, max_connections=max_connections, read_timeout=read_timeout)
