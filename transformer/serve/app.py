"""`transformer serve`'s JSON API over one Service (service.py): translate, attention, beam-search trace, the animated
walk through a sentence (a GIF), positional encoding, info and health, every error as {"error": message}, and the
look-inside page in static/. What a connection may cost below the API is http_guard.py's."""

import asyncio
import math
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from transformer.data.batch import source_limit
from transformer.errors import UserError
from transformer.inference.translator import Translation
from transformer.serve.http_guard import RequestGuard, allowed_hosts
from transformer.serve.request_batching import Batcher
from transformer.serve.service import (
    AnimateBody,
    ApiError,
    AttentionBody,
    BeamBody,
    Service,
    TranslateBody,
    api_error,
    check_positions,
    until_gone,
)

STATIC = Path(__file__).parent / "static"


def _shown(t: Translation, alignments: bool) -> dict:
    """A translation in a /translate answer: text and score, and its alignment's [source word, output word]
    pairs when asked for."""
    shown = {"text": t.text, "score": t.score if math.isfinite(t.score) else None}  # JSON has no -inf
    if alignments:
        shown["alignment"] = [list(pair) for pair in t.alignment or []]
    return shown


def create_app(service: Service, listen_host: str = "") -> FastAPI:
    """The API and the page over one loaded Service. Run it with its lifespan (uvicorn, or `with TestClient`).
    It answers requests for loopback names, the address the client reached, `listen_host` (--host) and
    settings.allow_hosts (http_guard.allowed_hosts)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        window = service.settings.batch_window_ms / 1000
        service.batcher = Batcher(service.translator, service.worker, window, service.others_connected)
        stopping = ApiError(503, "the server is shutting down")
        service.drain.on_over.append(lambda: service.batcher.fail_all(stopping))
        task = asyncio.create_task(service.batcher.run())
        try:
            yield
        finally:
            task.cancel()
            service.batcher.fail_all(stopping)

    settings = service.settings
    app = FastAPI(title="transformer serve", lifespan=lifespan, docs_url=None, redoc_url=None)  # docs need a CDN
    _add_errors(app)
    app.add_middleware(
        RequestGuard,
        hosts=allowed_hosts(listen_host, settings.allow_hosts),
        max_body_bytes=settings.max_body_bytes,
        read_timeout=settings.read_timeout_s,
        drain=service.drain,
    )
    _add_routes(app, service)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _add_errors(app: FastAPI) -> None:
    """Every error as {"error": message} (the size, type and host checks are http_guard.RequestGuard's)."""

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
    """The JSON API and the page. Whatever runs the model goes through the batcher, counted against
    --max-pending and bounded before it starts; /health and /info answer from the loop at once."""
    settings = service.settings
    _add_inspections(app, service)

    @app.post("/translate")
    async def translate(body: TranslateBody, request: Request) -> dict:
        lines = [" ".join(line.splitlines()) for line in body.text]  # one sentence per item, as one input line
        service.check_size(lines)
        settings, seed = service.request_settings(body)
        options = service.sentence_options(body, lines, seed)
        service.check_room(len(lines))
        try:  # once: the batcher sizes batches by it and searches it
            ids = service.translator.encode(lines, warn=False, target_lang=body.target_lang)
        except UserError as e:  # a language the model lacks, or none asked of a multilingual one
            raise ApiError(422, str(e)) from None
        try:
            found = await until_gone(request, service.batcher.translate(ids, settings, options)) if lines else []
        except Exception as e:
            raise api_error(e, "translate") from None
        limit = source_limit(service.cfg.model.max_positions)  # longer sources were translated from their start
        service.batcher.stats["requests"] += 1
        service.batcher.stats["sentences"] += len(lines)
        constrained = [bool(o.constraints) for o in options] if options else [False] * len(lines)
        sampling = {"sample": settings.sample, "temperature": settings.temperature, "seed": seed}
        return {
            "beam": settings.beam,
            "nbest": body.nbest,
            **(sampling if settings.sample is not None else {}),
            "translations": [
                {
                    **_shown(hyps[0], body.alignments),
                    "truncated": len(src) > limit,
                    **({"constraints_met": hyps[0].constrained} if asked else {}),
                    "nbest": [_shown(t, body.alignments) for t in hyps],
                }
                for hyps, src, asked in zip(found, ids, constrained)
            ],
        }

    @app.get("/positions")
    async def positions(request: Request, d_model: int | None = None, length: int | None = None) -> Response:
        model = service.cfg.model
        d_model = model.d_model if d_model is None else d_model
        length = min(model.max_positions, 100) if length is None else length
        check_positions(d_model, length, settings.max_position_values)
        return await service.inspect(request, service.position_view, d_model, length)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "pending": service.batcher.pending_sentences(), **service.batcher.stats}

    @app.get("/info")
    async def info() -> dict:
        return service.info

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html")


def _add_inspections(app: FastAPI, service: Service) -> None:
    """What the page shows of one sentence: its attention, its beam search, its animated walk (a GIF)."""

    @app.post("/attention")
    async def attention(body: AttentionBody, request: Request) -> Response:
        sentence = service.one_sentence(body.text, body.target_lang)
        if body.target is not None:
            service.check_size([body.text + body.target])
        beam = service.check_beam(body.beam)
        service.check_attention(sentence.ids, body.target)
        return await service.inspect(request, service.attention, sentence, body.target, beam)

    @app.post("/beam")
    async def beam_steps(body: BeamBody, request: Request) -> Response:
        ids = service.one_sentence(body.text, body.target_lang).ids
        beam = service.check_beam(body.beam, body.nbest)
        service.check_trace(ids, beam)
        return await service.inspect(request, service.beam_trace, ids, beam, body.nbest)

    @app.post("/animate")
    async def animate(body: AnimateBody, request: Request) -> Response:
        sentence = service.one_sentence(body.text, body.target_lang)
        beam = service.check_beam(body.beam)
        service.check_animation(body)
        disposition = {"Content-Disposition": 'attachment; filename="walk.gif"'}
        return await service.inspect(
            request, service.animation, sentence, body, beam, media_type="image/gif", headers=disposition
        )
