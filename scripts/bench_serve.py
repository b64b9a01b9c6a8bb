#!/usr/bin/env python
"""Load on `transformer serve` from N concurrent clients on 127.0.0.1, with and without the batching window.

    python scripts/bench_serve.py RUN_DIR_OR_CHECKPOINT [TEST_SET] [--clients 8] [--requests 400] \
        [--time-limit 60] [--sentences 1] [--beam 4] [--windows 5 0] [--engines ours ctranslate2] [--stop early] \
        [--device cpu] [--workers 1] [--dtype int8] [--warmup N] [--bursts 25] [--json bench_serve.json]
    python scripts/bench_serve.py RUN_DIR_OR_CHECKPOINT [TEST_SET] --soak [--minutes 10] [--every 60] \
        [--clients 8] [--json soak.json]

TEST_SET defaults to $TRANSFORMER_DATA/multi30k/test.de (else data/multi30k/test.de): Multi30k test sentences,
sent in file order (cycling), --sentences per request. For each --engines value (what runs /translate: serve
--engine) and each --windows value a fresh server is started (`transformer serve --port 0 --engine E
--batch-window-ms W`, with --workers N and --dtype D where given, on 127.0.0.1 only), warmed up with a short burst of the same
load (2 requests per client, or --warmup), and loaded by --clients threads that each send one request at a time until --requests have been sent or --time-limit
seconds have passed. Reports requests/s, sentences/s, p50/p99 latency, the mean sentences per batched search,
errors (warm-up included; must be 0: the script exits 1 otherwise) and the server's RSS before and after the
load (after the warm-up; it should stay flat). --bursts N: then N bursts of --clients requests released together
at the idle server, 0.2 s apart, and the time to each burst's last answer (what the batching window is for: with
one, the burst shares a search).

After each server, once it has stopped, a row ctranslate2_itself: what CTranslate2 itself does with the same work,
called as its users call it (bench_decode's row of that name, common.ctranslate2_itself), on the same model: a ctranslate2.Translator on the
conversion `--engine ctranslate2` caches beside the checkpoint, in the server's dtype, a new one for each server
(as cold as the server's new process); the sentences the server
answered, in the order they were sent, as SentencePiece pieces made beforehand; `translate_batch` with the same
beam, length penalty and max_decoding_length = model.max_positions - 1, in calls of the size the server formed (its
mean sentences per batched search: 1 a call with one client, window 0 and one sentence per request), one call at a
time on the server's threads (inter_threads 1, intra_threads = torch's thread count, which this process and the
server it started share). Why that batching: the server searches one batch at a time, and a batch holds what its
clients had waiting; CTranslate2 given the same batches one after another is the same work without the server
around it. Its warm-up: the calls that hold the sentences of the server's warm-up. Every server row gets the ratio
/ct2 itself (vs_ct2_itself in the JSON): its sentences/s over that row's. Without ctranslate2 installed the rows and
the ratio are left out (a note on stderr says so).

--soak: one server (the first --engines and --windows value) under --clients clients for --minutes, each
sending a mix of requests one at a time: /translate of 1 to 64 sentences at beams 1 to 8 (n-best up to 3),
/attention, /beam traces and /positions tables of random sizes, and some that a hostile client sends (one that
hangs up before its answer, a chunked body past the size limit, another Host name, a connection that sends half a
request and waits). Reports the server's RSS every --every seconds (a table and, with --json, the list), the
requests answered, refused as they should be (4xx) and errors (5xx other than 503, dropped connections: must be
0, else it exits 1).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import torch
from common import ctranslate2_itself, ctranslate2_pieces, rss_mib, write_json

from transformer.data.corpus import read_lines
from transformer.device import cpu_description
from transformer.inference.ctranslate2_engine import CT2_COMPUTE_TYPES
from transformer.inference.settings import DTYPES, ENGINES, STOP_RULES, SearchFlags
from transformer.inference.translator import Translator
from transformer.serve.server import spawn


def request(conn: http.client.HTTPConnection, method: str, path: str, body=None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"{}")


def health(port: int, path: str = "/health") -> dict:
    """GET /health (or `path`) on a new connection (a kept-alive one may have been closed by the server while idle)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        return request(conn, "GET", path)[1]
    finally:
        conn.close()


def load(
    port: int, sentences: list[str], clients: int, total: int, per_request: int, beam: int, time_limit: float
) -> dict:
    """--clients threads, one request at a time each, until `total` requests are sent or time is up."""
    lock, issued, latencies, errors = threading.Lock(), [0], [], []
    deadline = time.monotonic() + time_limit

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=max(10.0, time_limit))
        try:
            while time.monotonic() < deadline:
                with lock:
                    if issued[0] >= total:
                        return
                    i = issued[0]
                    issued[0] += 1
                batch = [sentences[(i * per_request + j) % len(sentences)] for j in range(per_request)]
                start = time.perf_counter()
                try:
                    status, answer = request(conn, "POST", "/translate", {"text": batch, "beam": beam})
                    ok = status == 200 and len(answer["translations"]) == len(batch)
                    why = answer.get("error", f"status {status}")
                except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
                    ok, why = False, f"{type(e).__name__}: {e}"
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=max(10.0, time_limit))
                with lock:
                    (latencies.append(time.perf_counter() - start) if ok else errors.append(why))
        finally:
            conn.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    ms = sorted(1000 * s for s in latencies)
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))] if ms else float("nan")  # noqa: E731
    return {
        "requests": len(latencies),
        "errors": len(errors),
        "first_errors": errors[:5],
        "seconds": elapsed,
        "requests_per_s": len(latencies) / elapsed,
        "sentences_per_s": len(latencies) * per_request / elapsed,
        "p50_ms": pick(0.50),
        "p99_ms": pick(0.99),
        "mean_ms": statistics.fmean(ms) if ms else float("nan"),
    }


def bursts(port: int, sentences: list[str], args) -> dict:
    """--bursts rounds of --clients requests released together (a barrier; each client on its own open
    connection) at an idle server, 0.2 s apart -> the time from a round's release to its last answer: the case
    the batching window is for."""
    timeout = max(10.0, args.time_limit)
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=timeout) for _ in range(args.clients)]
    times, errors = [], []
    try:
        for round_ in range(args.bursts):
            barrier = threading.Barrier(args.clients)

            def client(k: int, round_: int = round_, barrier: threading.Barrier = barrier) -> None:
                first = (round_ * args.clients + k) * args.sentences
                batch = [sentences[(first + j) % len(sentences)] for j in range(args.sentences)]
                barrier.wait()
                try:
                    status, answer = request(conns[k], "POST", "/translate", {"text": batch, "beam": args.beam})
                    if status != 200:
                        errors.append(answer.get("error", f"status {status}"))
                except (OSError, http.client.HTTPException, ValueError) as e:
                    errors.append(f"{type(e).__name__}: {e}")

            threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            times.append(time.perf_counter() - start)
            time.sleep(0.2)
    finally:
        for conn in conns:
            conn.close()
    ms = [1000 * t for t in times]
    return {
        "rounds": len(ms),
        "median_ms": statistics.median(ms),
        "min_ms": min(ms),
        "max_ms": max(ms),
        "errors": errors,
    }


def run_one(args, sentences: list[str], engine: str, window: float) -> dict:
    stop = ("--stop", args.stop) if args.stop else ()
    workers = ("--workers", str(args.workers)) if args.workers else ()
    dtype = ("--dtype", args.dtype) if args.dtype else ()
    server, url = spawn(
        args.checkpoint,
        "--device",
        args.device,
        "--engine",
        engine,
        *stop,
        *workers,
        *dtype,
        "--batch-window-ms",
        str(window),
        "--max-pending",
        str(max(1024, args.clients * args.sentences)),
        "--max-sentences",
        str(max(64, args.sentences)),
    )
    port = urlsplit(url).port
    try:
        info = health(port, "/info")
        dtype, searches_side_by_side = info["dtype"], info["decode"]["workers"]
        # Warm-up, a short burst of the same load: first-call allocations and the allocator's growth to the
        # batch sizes this load makes are not what a running service keeps adding.
        warmup = load(port, sentences, args.clients, warmup_requests(args), args.sentences, args.beam, args.time_limit)
        warm, before = health(port), rss_mib(server.pid)
        result = load(port, sentences, args.clients, args.requests, args.sentences, args.beam, args.time_limit)
        after, done = rss_mib(server.pid), health(port)
        batches, searched = done["batches"] - warm["batches"], done["sentences"] - warm["sentences"]
        burst = bursts(port, sentences, args) if args.bursts else None
    finally:
        server.terminate()
        server.wait(timeout=60)
    result["errors"] += warmup["errors"] + len(burst["errors"] if burst else [])
    result["first_errors"] = (warmup["first_errors"] + result["first_errors"] + (burst["errors"] if burst else []))[:5]
    if burst:
        result["bursts"] = {k: v for k, v in burst.items() if k != "errors"}
    return {
        "engine": engine,
        "window_ms": window,
        "dtype": dtype,
        "workers": searches_side_by_side,
        "warmup_requests": warmup_requests(args),
        **result,
        "rss_before_mb": before,
        "rss_after_mb": after,
        "batches": batches,
        "sentences_per_batch": searched / max(1, batches),
    }


def warmup_requests(args) -> int:
    """Requests of the warm-up burst: --warmup, else 2 per client."""
    return args.warmup if args.warmup is not None else 2 * args.clients


def itself_translator(args, dtype: str) -> Translator:
    """CTranslate2 on the conversion `--engine ctranslate2` caches beside the checkpoint (its .ct2), in `dtype`,
    as one translator on all of torch's threads: the server searches one batch at a time."""
    return Translator(
        args.checkpoint, args.device, SearchFlags(beam=args.beam, dtype=dtype, engine="ctranslate2", workers=1)
    )


def itself_row(ct2: Translator, sentences: list[str], server: dict, args) -> dict | None:
    """CTranslate2 itself on a server run's work (the docstring above says how and why) -> its row; None when the
    server answered nothing."""
    n = server["requests"] * args.sentences
    if n == 0:
        return None
    max_positions = ct2.cfg.model.max_positions
    sent = [sentences[k % len(sentences)] for k in range(n)]  # what load() sent, in order
    pieces = ctranslate2_pieces(ct2.vocab, ct2.encode(sent, warn=False), max_positions)
    calls = min(n, max(1, round(n / server["sentences_per_batch"])))
    batches = [pieces[i * n // calls : (i + 1) * n // calls] for i in range(calls)]  # sizes differ by 1 at most

    def translate(batch: list[list[str]]) -> None:
        ctranslate2_itself(ct2.ct2, ct2.vocab, batch, ct2.settings, max_positions, len(batch), "examples")

    for batch in batches[: max(1, round(warmup_requests(args) * args.sentences * calls / n))]:  # the server's warm-up
        translate(batch)
    start = time.perf_counter()
    for batch in batches:
        translate(batch)
    elapsed = time.perf_counter() - start
    return {
        "engine": "ctranslate2_itself",
        "window_ms": server["window_ms"],
        "server_engine": server["engine"],
        "dtype": server["dtype"],
        "compute_type": CT2_COMPUTE_TYPES[server["dtype"]],
        "sentences": n,
        "calls": calls,
        "sentences_per_call": n / calls,
        "seconds": elapsed,
        "sentences_per_s": n / elapsed,
        "inter_threads": 1,
        "intra_threads": torch.get_num_threads() if ct2.device.type == "cpu" else 1,
        "beam": ct2.settings.beam,
        "length_penalty": ct2.settings.lenpen,
        "max_decoding_length": max_positions - 1,
    }


def hostile(kind: str, port: int, sentence: str) -> str:
    """One request as a hostile client sends it -> what came of it ("hung up", or the status line's code)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        if kind == "hang up":  # sends a request and leaves before the answer
            body = json.dumps({"text": [sentence], "beam": 4}).encode()
            sock.sendall(
                b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            return "hung up"
        if kind == "chunked":  # a chunked body past the size limit
            sock.sendall(
                b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            chunk = b"x" * 65536
            try:
                for _ in range(64):
                    sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:
                pass
        elif kind == "host":  # a page elsewhere, through DNS rebinding
            sock.sendall(b"GET /info HTTP/1.1\r\nHost: rebound.example\r\nConnection: close\r\n\r\n")
        elif kind == "half":  # half a request line, then nothing until the server gives up
            sock.sendall(b"POST /translate HTTP/1.1\r\nHo")
        data = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
        return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else "closed"
    finally:
        sock.close()


def mixed_request(rng: random.Random, sentences: list[str]) -> tuple[str, str, dict | None]:
    """(method, path, body) of one ordinary request of the soak's mix."""
    r = rng.random()
    if r < 0.6:
        beam = rng.choice([1, 2, 4, 8])
        count = rng.choice([1, 1, 2, 4, 8, 16, 64])
        return (
            "POST",
            "/translate",
            {
                "text": rng.sample(sentences, min(count, len(sentences))),
                "beam": beam,
                "nbest": rng.randint(1, min(beam, 3)),
            },
        )
    if r < 0.75:
        return (
            "POST",
            "/attention",
            {"text": " ".join(rng.sample(sentences, rng.randint(1, 2))), "beam": rng.choice([1, 4])},
        )
    if r < 0.9:
        return "POST", "/beam", {"text": rng.choice(sentences), "beam": rng.choice([2, 4, 8]), "nbest": 1}
    d_model = 2 * rng.randint(1, 256)
    return "GET", f"/positions?d_model={d_model}&length={rng.randint(1, 262_144 // d_model)}", None


def soak_client(seed: int, port: int, sentences: list[str], deadline: float, outcomes: Counter, lock) -> None:
    """One soak client: the mix of requests (a twentieth of them hostile) until `deadline`, each outcome counted."""
    rng = random.Random(seed)
    conn, used = http.client.HTTPConnection("127.0.0.1", port, timeout=120), time.monotonic()
    while time.monotonic() < deadline:
        if time.monotonic() - used > 4:  # the server has closed it (serve --keep-alive-timeout 5): a new one
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        if rng.random() < 0.05:
            kind = rng.choice(["hang up", "chunked", "host", "half"])
            try:
                what = f"{kind}: {hostile(kind, port, rng.choice(sentences))}"
            except OSError as e:
                what = f"{kind}: {type(e).__name__}"
        else:
            method, path, body = mixed_request(rng, sentences)
            try:
                status, _ = request(conn, method, path, body)
                what = f"{path.split('?')[0]} {status}"
            except (OSError, http.client.HTTPException, ValueError) as e:
                what = f"{path.split('?')[0]} {type(e).__name__}"
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            used = time.monotonic()
        with lock:
            outcomes[what] += 1
    conn.close()


def memory_sample(pid: int, seconds: float, requests: int, **more) -> dict:
    return {
        "s": round(seconds, 1),
        "rss_mb": rss_mib(pid),
        "peak_mb": rss_mib(pid, "VmHWM"),
        "requests": requests,
        **more,
    }


def soak(args, sentences: list[str]) -> dict:
    """--clients clients sending the mix for --minutes; the server's RSS every --every seconds."""
    stop = ("--stop", args.stop) if args.stop else ()
    workers = ("--workers", str(args.workers)) if args.workers else ()
    server, url = spawn(
        args.checkpoint,
        "--device",
        args.device,
        "--engine",
        args.engines[0],
        *stop,
        *workers,
        "--batch-window-ms",
        str(args.windows[0]),
        "--read-timeout",
        "2",
    )
    outcomes: Counter = Counter()
    lock = threading.Lock()
    deadline = time.monotonic() + 60 * args.minutes
    port = urlsplit(url).port
    samples = [{"s": 0.0, "rss_mb": rss_mib(server.pid), "peak_mb": rss_mib(server.pid, "VmHWM"), "requests": 0}]
    threads = [
        threading.Thread(target=soak_client, args=(seed, port, sentences, deadline, outcomes, lock))
        for seed in range(args.clients)
    ]
    start = time.monotonic()
    try:
        for t in threads:
            t.start()
        while time.monotonic() < deadline:
            time.sleep(max(0.0, min(args.every, deadline - time.monotonic())))
            with lock:
                done = sum(outcomes.values())
            samples.append(memory_sample(server.pid, time.monotonic() - start, done))
        for t in threads:
            t.join()
        time.sleep(2)  # idle: what the server keeps once the load is over
        samples.append(memory_sample(server.pid, time.monotonic() - start, sum(outcomes.values()), idle=True))
    finally:
        server.terminate()
        server.wait(timeout=60)
    expected = ("hung up", " 413", " 421", " 408", "closed")
    errors = {k: n for k, n in outcomes.items() if not (k.endswith(" 200") or any(k.endswith(e) for e in expected))}
    return {
        "minutes": args.minutes,
        "clients": args.clients,
        "every_s": args.every,
        "samples": samples,
        "outcomes": dict(sorted(outcomes.items())),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "rss_first_mb": samples[0]["rss_mb"],
        "rss_max_mb": max(x["rss_mb"] for x in samples),
        "rss_last_mb": samples[-1]["rss_mb"],
    }


def print_soak(result: dict, args) -> None:
    print(f"soak: {args.clients} clients, {args.minutes:g} min of mixed requests, {args.device}; server RSS in MiB")
    print(f"{'time':>8} {'RSS':>8} {'peak':>8} {'requests':>9}")
    for x in result["samples"]:
        label = "idle" if x.get("idle") else f"{x['s'] / 60:.1f} min"
        print(f"{label:>8} {x['rss_mb']:>8.1f} {x['peak_mb']:>8.1f} {x['requests']:>9}")
    print("outcomes: " + ", ".join(f"{k} x{n}" for k, n in result["outcomes"].items()))
    print(f"errors: {result['errors']}" + (f" {result['error_kinds']}" if result["errors"] else ""))


def argument_parser() -> argparse.ArgumentParser:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="run directory or .pt file")
    default_data = Path(os.environ.get("TRANSFORMER_DATA", "data")) / "multi30k" / "test.de"
    ap.add_argument("test_set", nargs="?", default=str(default_data), help=f"source sentences (default {default_data})")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    ap.add_argument("--requests", type=int, default=400, help="requests per setting, at most (default 400)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per setting, at most (default 60)")
    ap.add_argument("--sentences", type=int, default=1, help="sentences per request (default 1)")
    ap.add_argument("--beam", type=int, default=4, help="beam size of every request (default 4)")
    ap.add_argument(
        "--windows", type=float, nargs="+", default=[5.0, 0.0], help="batching windows to compare, in ms (default: 5 0)"
    )
    ap.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        default=["ours"],
        help="what runs /translate, each in its own server (default: ours)",
    )
    ap.add_argument(
        "--stop",
        choices=STOP_RULES,
        help="our beam search's stop rule (serve --stop; default: the checkpoint's decode.stop); "
        "CTranslate2 always stops like early",
    )
    ap.add_argument("--device", default="cpu", help="where the server runs the model (default cpu)")
    ap.add_argument("--workers", type=int, help="the servers' --workers (default: theirs, decode.workers)")
    ap.add_argument("--dtype", choices=DTYPES, help="the servers' --dtype (default: theirs, fp32)")
    ap.add_argument(
        "--bursts",
        type=int,
        default=0,
        help="after the load, this many bursts of --clients requests released together at the idle server "
        "(the time to each burst's last answer; default 0: none)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        help="requests of the warm-up burst, before the timed load and CTranslate2 itself's row alike (default: "
        "2 per client); --warmup equal to --requests measures both warm, at every shape the load makes",
    )
    ap.add_argument("--json", metavar="FILE", help="write the results here")
    ap.add_argument("--soak", action="store_true", help="memory over time under a mix of requests (see above)")
    ap.add_argument("--minutes", type=float, default=10.0, help="--soak: how long (default 10)")
    ap.add_argument("--every", type=float, default=60.0, help="--soak: seconds between RSS samples (default 60)")
    return ap


def main() -> None:
    ap = argument_parser()
    args = ap.parse_args()
    if min(args.clients, args.requests, args.sentences, args.beam) < 1 or args.time_limit <= 0:
        sys.exit("error: --clients, --requests, --sentences, --beam and --time-limit must be positive")
    if args.minutes <= 0 or args.every <= 0:
        sys.exit("error: --minutes and --every must be positive")
    sentences = [s for s in read_lines(args.test_set) if s.strip()]
    if not sentences:
        sys.exit(f"error: no sentences in {args.test_set}")
    if args.soak:
        run_soak(args, sentences)
    results = run_servers(args, sentences)
    print_results(results, args)
    if args.json:
        report = {
            "checkpoint": str(args.checkpoint),
            "test_set": str(args.test_set),
            "clients": args.clients,
            "sentences_per_request": args.sentences,
            "beam": args.beam,
            "stop": args.stop,
            "device": args.device,
            "requests_limit": args.requests,
            "time_limit_s": args.time_limit,
            "machine": machine(),
            "results": results,
        }
        write_json(args.json, report)
    if any(r.get("errors") for r in results):
        sys.exit(1)


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_description(),
    }


def run_soak(args, sentences: list[str]) -> None:
    """--soak: one server under load for --minutes, its memory over time; exits 1 on an error."""
    result = soak(args, sentences)
    print_soak(result, args)
    if args.json:
        report = {
            "checkpoint": str(args.checkpoint),
            "test_set": str(args.test_set),
            "device": args.device,
            "engine": args.engines[0],
            "window_ms": args.windows[0],
            "machine": machine(),
            "soak": result,
        }
        write_json(args.json, report)
    sys.exit(1 if result["errors"] else 0)


def run_servers(args, sentences: list[str]) -> list[dict]:
    """A server per engine and batching window, each beside CTranslate2 itself on its sentences where installed."""
    try:
        import ctranslate2  # noqa: F401

        itself = True
    except ImportError:
        itself = False
        print(
            "note: ctranslate2 is not installed: no ctranslate2_itself rows and no /ct2 itself column "
            "(pip install -e '.[ctranslate2]')",
            file=sys.stderr,
        )
    results = []
    for engine in args.engines:
        for window in args.windows:
            server = run_one(args, sentences, engine, window)
            results.append(server)
            if itself:  # after the server has stopped: nothing else runs beside it
                # A new translator for each server, as cold as the server's new process: CTranslate2's first
                # calls at each shape are slower (int8 here: 22.7 sentences/s on a new translator, 37.4 on the
                # one that had translated the same sentences before).
                row = itself_row(itself_translator(args, server["dtype"]), sentences, server, args)
                if row is not None:
                    server["vs_ct2_itself"] = server["sentences_per_s"] / row["sentences_per_s"]
                    results.append(row)
    return results


def print_results(results: list[dict], args) -> None:
    print(
        f"{args.clients} clients, {args.sentences} sentence(s) per request, beam {args.beam}, "
        f"stop {args.stop or 'decode.stop'}, {args.device}; "
        f"server RSS in MiB"
    )
    print(
        f"{'engine':>18} {'window':>8} {'requests':>8} {'errors':>6} {'req/s':>8} {'sent/s':>8} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'sent/batch':>10} {'RSS before':>10} {'RSS after':>9} {'/ct2 itself':>11}"
    )
    for r in results:
        if r["engine"] == "ctranslate2_itself":
            print(
                f"{r['engine']:>18} {r['window_ms']:>6g}ms {'':>8} {'':>6} {'':>8} {r['sentences_per_s']:>8.1f} "
                f"{'':>8} {'':>8} {r['sentences_per_call']:>10.2f}"
            )
            continue
        ratio = f"{r['vs_ct2_itself']:.2f}x" if "vs_ct2_itself" in r else ""
        print(
            f"{r['engine']:>18} {r['window_ms']:>6g}ms {r['requests']:>8} {r['errors']:>6} {r['requests_per_s']:>8.1f} "
            f"{r['sentences_per_s']:>8.1f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['sentences_per_batch']:>10.2f} "
            f"{r['rss_before_mb']:>10.1f} {r['rss_after_mb']:>9.1f} {ratio:>11}"
        )
        if "bursts" in r:
            b = r["bursts"]
            print(
                f"{'':>18} {'':>8} bursts of {args.clients} at once, {b['rounds']} rounds: last answer after "
                f"{b['median_ms']:.0f} ms (median; {b['min_ms']:.0f}-{b['max_ms']:.0f})"
            )
        for why in r["first_errors"]:
            print(f"  error: {why}")
    shown = next((r for r in results if r["engine"] == "ctranslate2_itself"), None)
    if shown is not None:
        print(
            f"ctranslate2_itself: translate_batch on the server's sentences (as pieces) above it, in calls of its "
            f"sent/batch, one at a time, inter_threads 1 x intra_threads {shown['intra_threads']}, "
            f"{shown['compute_type']}; /ct2 itself: the server's sent/s over that row's"
        )


if __name__ == "__main__":
    main()
