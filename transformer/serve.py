"""`transformer serve`: a JSON API over one checkpoint (translate, attention, beam-search trace, positional
encoding, info), concurrent requests batched onto one model worker, and the look-inside page in static/."""

import asyncio
import functools
import ipaddress
import queue
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, field_validator
from starlette.exceptions import HTTPException

from transformer.attention_maps import KINDS, inspect_attention
from transformer.batch import prepare_sources, source_limit
from transformer.batcher import Batcher
from transformer.checkpoint import resolve_checkpoint
from transformer.errors import UserError, first_line, is_out_of_memory
from transformer.model import PositionalEncoding
from transformer.search import TraceStep, search
from transformer.translate import Translator
from transformer.vocab import valid_text

STATIC = Path(__file__).parent / "static"
# Every response: no sniffing, and the page may load only what this server serves (no CDN, no inline code).
HEADERS = {"X-Content-Type-Options": "nosniff",
           "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"}


@dataclass(frozen=True)
class ServeSettings:
    """Batching and the limits on what one request may ask; each but max_position_values has a `serve` flag."""

    batch_window_ms: float = 5.0      # how long a waiting /translate request waits for others to join its batch
    max_sentences: int = 64           # sentences per /translate request
    max_chars: int = 10_000           # characters per request, all sentences together
    max_beam: int = 16
    max_pending: int = 1024           # sentences waiting for the model; past that, 503 until the queue drains
    max_position_values: int = 262_144  # d_model x length of one /positions table (about 2 MB of JSON)

    def __post_init__(self):
        if not 0 <= self.batch_window_ms <= 10_000:
            raise UserError(f"--batch-window-ms must be between 0 and 10000, got {self.batch_window_ms}")
        for name in ("max_sentences", "max_chars", "max_beam", "max_pending"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_position_values < 1:
            raise UserError(f"max_position_values must be at least 1, got {self.max_position_values}")
        if self.max_pending < self.max_sentences:
            raise UserError(f"--max-pending ({self.max_pending}) must be at least --max-sentences ({self.max_sentences})")

    @property
    def max_body_bytes(self) -> int:
        return 12 * self.max_chars + 65_536  # JSON may spell a character as a 12-byte surrogate pair escape


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def api_error(e: Exception, what: str) -> ApiError:
    """What a failure in the model worker tells the client: its input's fault (422), memory (503), or ours."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, UserError):
        return ApiError(422, str(e))
    if is_out_of_memory(e):
        return ApiError(503, f"not enough memory for this request ({first_line(e)})")
    print(f"serve: {what} failed: {type(e).__name__}: {first_line(e)}", file=sys.stderr)
    return ApiError(500, f"internal error in {what}: {type(e).__name__}")


# ----------------------------------------------------------------------------- request bodies

class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _TextBody(_Body):
    @field_validator("text", "target", mode="after", check_fields=False)
    @classmethod
    def valid_unicode(cls, value):
        """JSON may spell a lone surrogate ("\\ud800"), which no UTF-8 encodes: U+FFFD instead."""
        if isinstance(value, list):
            return [valid_text(v) for v in value]
        return value if value is None else valid_text(value)


class TranslateBody(_TextBody):
    text: list[str]                   # one sentence per item; a single string is taken as one sentence
    beam: Optional[int] = None        # default: the checkpoint's decode.beam
    nbest: int = 1

    @field_validator("text", mode="before")
    @classmethod
    def one_sentence(cls, value):
        return [value] if isinstance(value, str) else value


class AttentionBody(_TextBody):
    text: str
    target: Optional[str] = None      # read this target instead of the model's own translation
    beam: Optional[int] = None


class BeamBody(_TextBody):
    text: str
    beam: Optional[int] = None
    nbest: int = 1


# ----------------------------------------------------------------------------- the service

class Service:
    """The checkpoint loaded once, its facts for /info, and the one thread that runs the model."""

    def __init__(self, checkpoint: str | Path, settings: ServeSettings, device: str = "auto", dtype: str = "auto",
                 beam: Optional[int] = None, lenpen: Optional[float] = None, stop: Optional[str] = None,
                 max_tokens: Optional[int] = None, workers: Optional[int] = None, engine: str = "ours"):
        path = resolve_checkpoint(checkpoint)
        self.settings = settings
        if beam is not None and beam > settings.max_beam:  # before the model loads
            raise UserError(f"--beam ({beam}) is above --max-beam ({settings.max_beam})")
        # With CTranslate2, /translate runs on it; the page's attention maps and beam traces need our model's
        # internals, so the translator keeps that too.
        self.translator = Translator(path, device, beam, lenpen, max_tokens, stop=stop, dtype=dtype, workers=workers,
                                     engine=engine, keep_model=True)
        if settings.max_beam < self.translator.beam:
            raise UserError(f"--max-beam ({settings.max_beam}) is below the checkpoint's decode.beam "
                            f"({self.translator.beam}); raise it, or serve with a smaller --beam")
        self.default_beam = self.translator.beam
        self.model, self.vocab, self.cfg = self.translator.model, self.translator.vocab, self.translator.cfg
        self.max_beam = min(settings.max_beam, len(self.vocab))  # a request's beam; wider is beam_above_vocabulary
        self.model_device = next(self.model.parameters()).device  # the translator's, or the CPU beside CTranslate2
        self.info = self._describe(path)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")  # searches never overlap
        self.batcher: Optional[Batcher] = None

    def _describe(self, path: Path) -> dict:
        m, d, run = self.cfg.model, self.translator, self.translator.run
        return {
            "checkpoint": path.name, "step": run.get("step"),
            "validation": {"best": run.get("best"), "metric": run.get("best_metric"),
                           **_validation_at(path.parent, run.get("step"))} if run else None,
            "model": {**asdict(m), "parameters": d.parameters},
            "vocab_size": len(self.vocab), "languages": [self.cfg.data.src_lang, self.cfg.data.tgt_lang],
            # CTranslate2 has one stop rule, ours "early" (the page, /beam, still searches with ours)
            "decode": {"engine": d.engine, "beam": d.beam, "lenpen": d.lenpen,
                       "stop": "early" if d.engine == "ctranslate2" else d.stop,
                       "max_len_offset": d.max_len_offset, "max_tokens": d.max_tokens, "workers": d.workers},
            "device": str(d.device), "dtype": d.dtype, "limits": {**asdict(self.settings), "max_beam": self.max_beam},
        }

    def check_beam(self, beam: Optional[int], nbest: int = 1) -> int:
        beam = self.default_beam if beam is None else beam
        if not 1 <= beam <= self.max_beam:
            raise ApiError(422, f"beam must be between 1 and {self.max_beam}, got {beam}")
        if not 1 <= nbest <= beam:
            raise ApiError(422, f"nbest must be between 1 and the beam size ({beam}), got {nbest}")
        return beam

    def check_size(self, lines: list[str]) -> None:
        if len(lines) > self.settings.max_sentences:
            raise ApiError(413, f"{len(lines)} sentences in one request; the limit is {self.settings.max_sentences}")
        chars = sum(len(line) for line in lines)
        if chars > self.settings.max_chars:
            raise ApiError(413, f"{chars} characters in one request; the limit is {self.settings.max_chars}")

    def one_sentence(self, text: str) -> list[int]:
        self.check_size([text])
        ids = self.vocab.encode([text])[0] if text.strip() else []
        if not ids:
            raise ApiError(422, "text is empty")
        limit = source_limit(self.cfg.model.max_positions)
        if len(ids) > limit:
            raise ApiError(422, f"the sentence is {len(ids)} pieces long; this model accepts at most {limit}")
        return ids

    async def run_model(self, fn, *args):
        """fn(*args) on the model worker, after whatever it is doing now."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.worker, functools.partial(fn, *args))
        except Exception as e:
            raise api_error(e, fn.__name__) from None

    def attention(self, text: str, target: Optional[str], beam: int) -> dict:
        d = self.translator
        maps = inspect_attention(self.model, self.vocab, text, target, beam, d.lenpen, d.max_len_offset, d.stop)
        pieces = {"source": maps.source_pieces, "target": maps.target_pieces}
        sides = {"encoder": ("source", "source"), "decoder": ("target", "target"), "cross": ("target", "source")}
        return {"source": maps.source, "target": maps.target, "translated": maps.translated,
                "source_pieces": pieces["source"], "target_pieces": pieces["target"],
                "attention": {kind: {"queries": sides[kind][0], "keys": sides[kind][1],
                                     "layers": int(maps.shape(kind)[0]), "heads": int(maps.shape(kind)[1]),
                                     # (layers, heads, queries, keys); rows sum to 1
                                     "weights": np.round(maps.weights[kind].astype(np.float64), 5).tolist()}
                              for kind in KINDS}}

    def beam_trace(self, ids: list[int], beam: int, nbest: int) -> dict:
        d = self.translator
        src, _ = prepare_sources([ids], self.cfg.model.max_positions)  # (1, S)
        trace: list[TraceStep] = []
        found = search(self.model, src.to(self.model_device), beam, d.lenpen, d.max_len_offset, nbest, d.stop, trace=trace)

        def show(hyps):
            return [{"pieces": self.vocab.pieces(h.tokens), "text": text, "score": round(h.score, 5)}
                    for h, text in zip(hyps, self.vocab.decode([h.tokens for h in hyps]))]

        return {"source_pieces": self.vocab.pieces(src[0].tolist()), "beam": beam, "lenpen": d.lenpen,
                "stop": d.stop, "nbest": show(found.hypotheses[0]),
                "steps": [{"alive": show(step.alive[0]), "finished": show(step.finished[0])} for step in trace]}


def _validation_at(run_dir: Path, step: Optional[int]) -> dict:
    """The validation figures metrics.jsonl holds for `step` (loss, ppl, bleu...), when the run directory has them."""
    from transformer.runlog import read_metrics

    try:
        rows = read_metrics(run_dir)
    except (UserError, OSError):
        return {}
    found = [r for r in rows if r.get("split") == "valid" and r.get("step") == step]
    return {k: v for k, v in found[-1].items() if k in ("loss", "nll", "ppl", "bleu", "chrf")} if found else {}


def positions_table(d_model: int, length: int, max_values: int) -> dict:
    if d_model < 2 or d_model % 2:
        raise ApiError(422, f"d_model must be a positive even number, got {d_model}")
    if length < 1:
        raise ApiError(422, f"length must be at least 1, got {length}")
    if d_model * length > max_values:
        raise ApiError(422, f"d_model x length is {d_model} x {length}; the limit is {max_values} values")
    table = PositionalEncoding(d_model, length).table  # (length, d_model)
    return {"d_model": d_model, "length": length, "table": np.round(table.double().numpy(), 4).tolist()}


def create_app(service: Service) -> FastAPI:
    """The API and the page over one loaded Service. Run it with its lifespan (uvicorn, or `with TestClient`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.batcher = Batcher(service.translator, service.worker, service.settings.batch_window_ms / 1000)
        task = asyncio.create_task(service.batcher.run())
        try:
            yield
        finally:
            task.cancel()
            service.batcher.fail_pending(ApiError(503, "the server is shutting down"))

    app = FastAPI(title="transformer serve", lifespan=lifespan, docs_url=None, redoc_url=None)  # docs need a CDN
    _add_guards(app, service.settings)
    _add_routes(app, service)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=HEADERS)


def _add_guards(app: FastAPI, settings: ServeSettings) -> None:
    """Size and type limits before a body is read, and every error as {"error": message}."""

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """Bodies past the size limit are refused before they are read; every response gets HEADERS."""
        if request.method == "POST":
            if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
                return _error(415, "send the body as JSON, with the header Content-Type: application/json")
            length = request.headers.get("content-length")
            if length is None:
                return _error(411, "a POST needs a Content-Length header")
            if not length.isdigit() or int(length) > settings.max_body_bytes:
                return _error(413, f"the body is larger than {settings.max_body_bytes} bytes")
        response = await call_next(request)
        response.headers.update(HEADERS)
        return response

    @app.exception_handler(ApiError)
    async def refused(request: Request, e: ApiError):
        return _error(e.status, e.message)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            return _error(400, "the body is not valid JSON")
        if len(first["loc"]) < 2:
            return _error(422, 'the body must be a JSON object, e.g. {"text": ["Ein Satz."]}')
        return _error(422, f"{'.'.join(str(part) for part in first['loc'][1:])}: {first['msg']}")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):  # a bug: JSON for the client, a traceback in the log
        return _error(500, f"internal error: {type(e).__name__}")



def _add_routes(app: FastAPI, service: Service) -> None:
    """The JSON API and the page."""
    settings = service.settings

    @app.post("/translate")
    async def translate(body: TranslateBody) -> dict:
        lines = [" ".join(line.splitlines()) for line in body.text]  # one sentence per item, as one input line
        service.check_size(lines)
        beam = service.check_beam(body.beam, body.nbest)
        if service.batcher.pending_sentences() + len(lines) > settings.max_pending:
            raise ApiError(503, "too many sentences are waiting; try again shortly")
        ids = service.translator.encode(lines, warn=False)  # once: the batcher sizes batches by it and searches it
        try:
            found = await service.batcher.translate(ids, beam, body.nbest) if lines else []
        except Exception as e:
            raise api_error(e, "translate") from None
        limit = source_limit(service.cfg.model.max_positions)  # longer sources were translated from their start
        service.batcher.stats["requests"] += 1
        service.batcher.stats["sentences"] += len(lines)
        return {"beam": beam, "nbest": body.nbest,
                "translations": [{"text": hyps[0][1], "score": hyps[0][0], "truncated": len(src) > limit,
                                  "nbest": [{"text": text, "score": score} for score, text in hyps]}
                                 for hyps, src in zip(found, ids)]}

    @app.post("/attention")
    async def attention(body: AttentionBody) -> dict:
        service.one_sentence(body.text)
        if body.target is not None:
            service.check_size([body.text + body.target])
        return await service.run_model(service.attention, body.text, body.target, service.check_beam(body.beam))

    @app.post("/beam")
    async def beam_steps(body: BeamBody) -> dict:
        ids = service.one_sentence(body.text)
        return await service.run_model(service.beam_trace, ids, service.check_beam(body.beam, body.nbest), body.nbest)

    @app.get("/positions")
    async def positions(d_model: Optional[int] = None, length: Optional[int] = None) -> dict:
        model = service.cfg.model
        return positions_table(model.d_model if d_model is None else d_model,
                               min(model.max_positions, 100) if length is None else length,
                               settings.max_position_values)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "pending": service.batcher.pending_sentences(), **service.batcher.stats}

    @app.get("/info")
    async def info() -> dict:
        return service.info

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html")


def listen(host: str, port: int) -> socket.socket:
    """A bound socket for uvicorn, so that a taken port or an unknown host is a one-line error."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # from now on connections wait in the backlog until uvicorn accepts them
    except OSError as e:
        raise UserError(f"serve: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run_serve(checkpoint: str, host: str, port: int, settings: ServeSettings, device: str = "auto",
              dtype: str = "auto", beam: Optional[int] = None, lenpen: Optional[float] = None,
              stop: Optional[str] = None, max_tokens: Optional[int] = None, workers: Optional[int] = None,
              engine: str = "ours") -> None:
    """The `serve` command: load the checkpoint, bind, and serve until interrupted."""
    service = Service(checkpoint, settings, device, dtype, beam, lenpen, stop, max_tokens, workers, engine)
    if service.translator.note:
        print(service.translator.note, file=sys.stderr)
    sock = listen(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    if not ipaddress.ip_address(bound_host).is_loopback:
        print(f"warning: listening on {bound_host}, not only this machine: anyone who can reach it may use the "
              "service (there is no authentication)", file=sys.stderr)
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    step = f" (step {service.info['step']})" if service.info["step"] is not None else ""
    print(f"serving {service.info['checkpoint']}{step} at http://{shown}:{bound_port}/", file=sys.stderr, flush=True)
    config = uvicorn.Config(create_app(service), log_level="warning", timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])


def spawn(checkpoint: str | Path, *flags: str, timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """`transformer serve CHECKPOINT --port 0 FLAGS...` in a subprocess on 127.0.0.1 -> (the process, its base URL),
    once it listens; for scripts that drive a real server. The caller stops it (terminate, then wait)."""
    proc = subprocess.Popen([sys.executable, "-m", "transformer", "serve", str(checkpoint), "--host", "127.0.0.1",
                             "--port", "0", *flags], stderr=subprocess.PIPE, text=True, encoding="utf-8",
                            errors="replace")
    lines: "queue.Queue[str]" = queue.Queue()

    def drain():  # keep reading, so that the server never blocks on a full pipe
        for line in proc.stderr:
            lines.put(line)
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
