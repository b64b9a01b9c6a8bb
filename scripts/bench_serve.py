#!/usr/bin/env python
"""Load on `transformer serve` from N concurrent clients on 127.0.0.1, with and without the batching window.

    python scripts/bench_serve.py RUN_DIR_OR_CHECKPOINT [TEST_SET] [--clients 8] [--requests 400] \
        [--time-limit 60] [--sentences 1] [--beam 4] [--windows 5 0] [--engines ours ctranslate2] [--stop early] \
        [--device cpu] [--json bench_serve.json]

TEST_SET defaults to $TRANSFORMER_DATA/multi30k/test.de (else data/multi30k/test.de): Multi30k test sentences,
sent in file order (cycling), --sentences per request. For each --engines value (what runs /translate: serve
--engine) and each --windows value a fresh server is started (`transformer serve --port 0 --engine E
--batch-window-ms W`, on 127.0.0.1 only), warmed up with a short burst of the same
load (2 requests per client), and loaded by --clients threads that each send one request at a time until --requests have been sent or --time-limit
seconds have passed. Reports requests/s, sentences/s, p50/p99 latency, the mean sentences per batched search,
errors (warm-up included; must be 0: the script exits 1 otherwise) and the server's RSS before and after the
load (after the warm-up; it should stay flat).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from transformer.corpus import read_lines
from transformer.device import cpu_description
from transformer.serve import spawn


def rss_mb(pid: int) -> float:
    """Resident memory of a process (Linux /proc), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def request(conn: http.client.HTTPConnection, method: str, path: str, body=None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"{}")


def health(port: int) -> dict:
    """GET /health on a new connection (a kept-alive one may have been closed by the server while idle)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        return request(conn, "GET", "/health")[1]
    finally:
        conn.close()


def load(port: int, sentences: list[str], clients: int, total: int, per_request: int, beam: int,
         time_limit: float) -> dict:
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
    return {"requests": len(latencies), "errors": len(errors), "first_errors": errors[:5], "seconds": elapsed,
            "requests_per_s": len(latencies) / elapsed, "sentences_per_s": len(latencies) * per_request / elapsed,
            "p50_ms": pick(0.50), "p99_ms": pick(0.99), "mean_ms": statistics.fmean(ms) if ms else float("nan")}


def run_one(args, sentences: list[str], engine: str, window: float) -> dict:
    stop = ("--stop", args.stop) if args.stop else ()
    server, url = spawn(args.checkpoint, "--device", args.device, "--engine", engine, *stop, "--batch-window-ms", str(window),
                        "--max-pending", str(max(1024, args.clients * args.sentences)),
                        "--max-sentences", str(max(64, args.sentences)))
    port = urlsplit(url).port
    try:
        # Warm-up, a short burst of the same load: first-call allocations and the allocator's growth to the
        # batch sizes this load makes are not what a running service keeps adding.
        warmup = load(port, sentences, args.clients, 2 * args.clients, args.sentences, args.beam, args.time_limit)
        warm, before = health(port), rss_mb(server.pid)
        result = load(port, sentences, args.clients, args.requests, args.sentences, args.beam, args.time_limit)
        after, done = rss_mb(server.pid), health(port)
        batches, searched = done["batches"] - warm["batches"], done["sentences"] - warm["sentences"]
    finally:
        server.terminate()
        server.wait(timeout=60)
    result["errors"] += warmup["errors"]
    result["first_errors"] = (warmup["first_errors"] + result["first_errors"])[:5]
    return {"engine": engine, "window_ms": window, **result, "rss_before_mb": before, "rss_after_mb": after,
            "batches": batches, "sentences_per_batch": searched / max(1, batches)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="run directory or .pt file")
    default_data = Path(os.environ.get("TRANSFORMER_DATA", "data")) / "multi30k" / "test.de"
    ap.add_argument("test_set", nargs="?", default=str(default_data), help=f"source sentences (default {default_data})")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    ap.add_argument("--requests", type=int, default=400, help="requests per setting, at most (default 400)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per setting, at most (default 60)")
    ap.add_argument("--sentences", type=int, default=1, help="sentences per request (default 1)")
    ap.add_argument("--beam", type=int, default=4, help="beam size of every request (default 4)")
    ap.add_argument("--windows", type=float, nargs="+", default=[5.0, 0.0],
                    help="batching windows to compare, in ms (default: 5 0)")
    ap.add_argument("--engines", nargs="+", choices=("ours", "ctranslate2"), default=["ours"],
                    help="what runs /translate, each in its own server (default: ours)")
    ap.add_argument("--stop", choices=("exact", "early"),
                    help="our beam search's stop rule (serve --stop; default: the checkpoint's decode.stop); "
                         "CTranslate2 always stops like early")
    ap.add_argument("--device", default="cpu", help="where the server runs the model (default cpu)")
    ap.add_argument("--json", metavar="FILE", help="write the results here")
    args = ap.parse_args()
    if min(args.clients, args.requests, args.sentences, args.beam) < 1 or args.time_limit <= 0:
        sys.exit("error: --clients, --requests, --sentences, --beam and --time-limit must be positive")
    sentences = [s for s in read_lines(args.test_set) if s.strip()]
    if not sentences:
        sys.exit(f"error: no sentences in {args.test_set}")

    results = [run_one(args, sentences, engine, window) for engine in args.engines for window in args.windows]
    print(f"{args.clients} clients, {args.sentences} sentence(s) per request, beam {args.beam}, "
          f"stop {args.stop or 'decode.stop'}, {args.device}; "
          f"server RSS in MiB")
    print(f"{'engine':>11} {'window':>8} {'requests':>8} {'errors':>6} {'req/s':>8} {'sent/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'sent/batch':>10} {'RSS before':>10} {'RSS after':>9}")
    for r in results:
        print(f"{r['engine']:>11} {r['window_ms']:>6g}ms {r['requests']:>8} {r['errors']:>6} {r['requests_per_s']:>8.1f} "
              f"{r['sentences_per_s']:>8.1f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['sentences_per_batch']:>10.2f} "
              f"{r['rss_before_mb']:>10.1f} {r['rss_after_mb']:>9.1f}")
        for why in r["first_errors"]:
            print(f"  error: {why}")
    if args.json:
        report = {"checkpoint": str(args.checkpoint), "test_set": str(args.test_set), "clients": args.clients,
                  "sentences_per_request": args.sentences, "beam": args.beam, "stop": args.stop, "device": args.device,
                  "requests_limit": args.requests, "time_limit_s": args.time_limit,
                  "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                              "cpu": cpu_description()},
                  "results": results}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if any(r["errors"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
