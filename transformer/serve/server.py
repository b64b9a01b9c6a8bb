"""`transformer serve` as a process: the socket bound before the model loads, uvicorn with serve's limits
(http_guard.py), run until SIGTERM or Ctrl-C drain it, and `spawn` for scripts that drive a real server."""

import ipaddress
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from transformer.errors import UserError
from transformer.inference.settings import SearchFlags
from transformer.model.checkpoint import resolve_checkpoint
from transformer.serve.app import create_app
from transformer.serve.http_guard import (
    BACKLOG,
    MAX_HEAD,
    Drain,
    DrainingServer,
    allowed_hosts,
    open_file_budget,
    protocol_class,
)
from transformer.serve.service import ServeSettings, Service, check_beam_setting


def listen(host: str, port: int) -> socket.socket:
    """A bound socket for uvicorn, so that a taken port or an unknown host is a one-line error."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)  # from now on connections wait in the backlog until uvicorn accepts them
    except OSError as e:
        raise UserError(f"serve: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def make_server(
    app: FastAPI, settings: ServeSettings, drain: Drain, max_connections: int | None = None, ready: str = ""
) -> DrainingServer:
    """uvicorn with serve's limits: its h11 protocol with a connection cap and a deadline for each request's
    head (http_guard.py), idle connections closed after keep_alive_s, an unfinished head buffered up to
    MAX_HEAD bytes (400 past it; RequestGuard counts a finished one), no WebSocket, and a drained stop."""
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="on",
        ws="none",
        backlog=BACKLOG,
        http=protocol_class(max_connections or settings.max_connections, settings.read_timeout_s),
        timeout_keep_alive=settings.keep_alive_s,
        h11_max_incomplete_event_size=MAX_HEAD,
        # Past the drain, uvicorn cancels what is left; the drain itself has answered it 503 by then.
        timeout_graceful_shutdown=settings.drain_s + 2,
    )
    return DrainingServer(config, drain, ready)


def run_serve(
    checkpoint: str,
    host: str,
    port: int,
    settings: ServeSettings,
    device: str = "auto",
    flags: SearchFlags = SearchFlags(),
    target_lang: str | None = None,
) -> None:
    """The `serve` command: check what is quick to check, bind (a taken port is an error before the model
    loads), load the checkpoint, and serve until SIGTERM or Ctrl-C, which drain (http_guard.DrainingServer)."""
    resolve_checkpoint(checkpoint)
    check_beam_setting(flags.beam, settings)
    if flags.engine == "ctranslate2":
        from transformer.inference.ctranslate2_export import require_ctranslate2

        require_ctranslate2()
    connections, note = open_file_budget(settings.max_connections)
    sock = listen(host, port)
    try:
        service = Service(checkpoint, settings, device, flags, target_lang)
    except BaseException:
        sock.close()
        raise
    bound_host, bound_port = sock.getsockname()[:2]
    hosts = allowed_hosts(host, settings.allow_hosts)
    print(f"dtype: {service.translator.settings.dtype}: {service.dtype_note}", file=sys.stderr)
    for line in (service.translator.note, note):
        if line:
            print(line, file=sys.stderr)
    if not ipaddress.ip_address(bound_host).is_loopback:
        print(
            f"warning: listening on {bound_host}, not only this machine: anyone who can reach it may use the "
            "service (there is no authentication)",
            file=sys.stderr,
        )
        if hosts is not None and ipaddress.ip_address(bound_host).is_unspecified:
            print(
                f"note: requests must name this machine by its address or as {', '.join(sorted(hosts))}; "
                "allow its host names with --allow-host NAME (or any with --allow-host '*')",
                file=sys.stderr,
            )
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    step = f" (step {service.info['step']})" if service.info["step"] is not None else ""
    ready = f"serving {service.info['checkpoint']}{step} at http://{shown}:{bound_port}/"  # spawn() waits for it
    server = make_server(create_app(service, host), settings, service.drain, connections, ready)
    service.others_connected = lambda: len(server.server_state.connections) > 1  # the request's own is one
    server.run(sockets=[sock])
    service.worker.shutdown(wait=False, cancel_futures=True)  # the exit waits for a search in progress only


def spawn(
    checkpoint: str | Path,
    *flags: str,
    timeout: float = 120.0,
    env: dict | None = None,
    preexec_fn=None,
    log: list | None = None,
) -> tuple[subprocess.Popen, str]:
    """`transformer serve CHECKPOINT --port 0 FLAGS...` in a subprocess on 127.0.0.1 -> (the process, its base URL),
    once it listens; for scripts that drive a real server. The caller stops it (terminate, then wait). `log`,
    when given, receives every line the server writes to stderr, as it comes."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "transformer", "serve", str(checkpoint), "--host", "127.0.0.1", "--port", "0", *flags],
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",
        errors="replace",
        env=env,
        preexec_fn=preexec_fn,
    )
    lines: queue.Queue[str] = queue.Queue()

    def drain():  # keep reading, so that the server never blocks on a full pipe
        for line in proc.stderr:
            lines.put(line)
            if log is not None:
                log.append(line)
        lines.put("")

    threading.Thread(target=drain, daemon=True).start()
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        if line.startswith("serving ") and " at http://" in line:
            return proc, line.rsplit(" at ", 1)[1].strip().rstrip("/")
        if line == "":  # the server exited
            break
    proc.kill()
    proc.wait()
    raise RuntimeError("transformer serve did not start:\n" + "".join(seen[-20:]))
