"""The model behind serve's API: its settings and limits (ServeSettings), the request bodies, the checkpoint loaded
once with its facts for /info, what a request may make it compute, the settings a request searches with, and the
inspections (attention maps, beam traces, positions) on the one model worker."""

import asyncio
import json
import random
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, field_validator

from transformer.data.batch import prepare_sources, source_limit
from transformer.data.vocab import valid_text
from transformer.errors import UserError, first_line, is_out_of_memory
from transformer.inference.batched import SentenceOptions
from transformer.inference.scoring import NAMES
from transformer.inference.search import TraceStep, search
from transformer.inference.settings import MAX_SAMPLES, SearchFlags, SearchSettings
from transformer.inference.translator import Translator
from transformer.model.checkpoint import resolve_checkpoint
from transformer.serve.http_guard import (
    Drain,
)
from transformer.serve.request_batching import Batcher
from transformer.visualize.attention import KINDS, inspect_attention
from transformer.visualize.walkthrough import PARTS, frames, walk


@dataclass(frozen=True)
class ServeSettings:
    """Batching, and what one request or connection may cost; each but max_position_values has a `serve` flag."""

    batch_window_ms: float = 5.0  # how long a waiting /translate request waits for others to join its batch
    max_sentences: int = 64  # sentences per /translate request
    max_chars: int = 10_000  # characters per request, all sentences together
    max_beam: int = 16
    max_samples: int = MAX_SAMPLES  # samples per sentence a request may ask for (its nbest with "sample")
    max_constraints: int = 8  # target phrases per sentence
    max_prefix: int = 128  # pieces of a sentence's forced target prefix (and never more than the model takes)
    max_pending: int = 1024  # requests' sentences waiting for the model (an inspection counts one)
    max_position_values: int = 262_144  # d_model x length of one /positions table (about 2 MB of JSON)
    max_answer_values: int = 2_000_000  # attention weights in an /attention answer, pieces in a /beam trace
    max_connections: int = 512  # open connections; past it a new one gets 503 and is closed
    read_timeout_s: float = 10.0  # for a request's line and headers, and again for its body (408 after)
    keep_alive_s: float = 5.0  # an idle connection between requests is closed after this
    drain_s: float = 10.0  # on SIGTERM, how long requests in flight may take; the rest get 503
    allow_hosts: tuple[str, ...] = ()  # Host names served besides loopback ones and --host; "*": any

    def __post_init__(self):
        if not 0 <= self.batch_window_ms <= 10_000:
            raise UserError(f"--batch-window-ms must be between 0 and 10000, got {self.batch_window_ms}")
        for name in (
            "max_sentences",
            "max_chars",
            "max_beam",
            "max_samples",
            "max_constraints",
            "max_prefix",
            "max_pending",
            "max_answer_values",
            "max_connections",
        ):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_samples > MAX_SAMPLES:  # translate's bound, and the settings' check
            raise UserError(f"--max-samples must be at most {MAX_SAMPLES}, got {self.max_samples}")
        if self.max_position_values < 1:
            raise UserError(f"max_position_values must be at least 1, got {self.max_position_values}")
        if self.max_pending < self.max_sentences:
            raise UserError(
                f"--max-pending ({self.max_pending}) must be at least --max-sentences ({self.max_sentences})"
            )
        for flag, value in (
            ("--read-timeout", self.read_timeout_s),
            ("--keep-alive-timeout", self.keep_alive_s),
            ("--drain-timeout", self.drain_s),
        ):
            if not 0 < value <= 3600:
                raise UserError(f"{flag} must be more than 0 and at most 3600 seconds, got {value}")
        for name in self.allow_hosts:
            if not name.strip() or any(c in name for c in "/ @?#"):
                raise UserError(f"--allow-host takes a host name such as example.org (or '*'), got {name!r}")

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
    @field_validator("text", "target", "prefix", "constraints", mode="after", check_fields=False)
    @classmethod
    def valid_unicode(cls, value):
        """JSON may spell a lone surrogate ("\\ud800"), which no UTF-8 encodes: U+FFFD instead."""
        if isinstance(value, list):
            return [[valid_text(w) for w in v] if isinstance(v, list) else valid_text(v) for v in value]
        return value if value is None else valid_text(value)


class TranslateBody(_TextBody):
    text: list[str]  # one sentence per item; a single string is taken as one sentence
    beam: int | None = None  # default: the checkpoint's decode.beam
    nbest: int = 1  # with sample: samples per sentence
    sample: str | None = None  # "topk:K" or "topp:P": sampling instead of beam search (default: serve --sample)
    temperature: float | None = None  # with sample (default: serve --temperature, else 1)
    seed: int | None = None  # with sample (default: serve --seed, else a new one per request)
    prefix: list[str] | None = None  # per sentence, a target prefix its translations start with ("": none)
    constraints: list[list[str]] | None = None  # per sentence, target phrases its translations contain
    alignments: bool = False  # word alignments with each translation
    target_lang: str | None = None  # a multilingual model's language to translate into (default: serve --target-lang)

    @field_validator("text", "prefix", mode="before")
    @classmethod
    def one_sentence(cls, value):
        return [value] if isinstance(value, str) else value


class Sentence(NamedTuple):
    """One sentence an inspection shows, as the model reads it."""

    text: str  # without a language token it was written with
    prefix: list[int]  # a multilingual model's language token (Translator.asking), else empty
    ids: list[int]  # prefix, then the text's pieces


class AttentionBody(_TextBody):
    text: str
    target: str | None = None  # read this target instead of the model's own translation
    beam: int | None = None
    target_lang: str | None = None  # as /translate's


class BeamBody(_TextBody):
    text: str
    beam: int | None = None
    nbest: int = 1
    target_lang: str | None = None


class AnimateBody(_TextBody):
    text: str
    target_lang: str | None = None
    beam: int | None = None  # the search whose best translation the decoder part follows
    layer: int | None = None  # as `transformer animate` takes them: numbered from 1, None its defaults
    head: int | None = None
    only: Literal["encoder", "decoder"] | None = None
    fps: float = 1.0


# ----------------------------------------------------------------------------- the service

# What serve's dtypes mean for an answer (/info, serve --help and the README say the same).
ALONE = (
    "a translation does not depend on the other requests batched with it (its score may differ from the "
    "request's alone in the sixth digit: the order of a sum depends on the batch's shape)"
)
SHARED = (
    "a translation may depend on the other requests batched with it: {dtype} rounds each batch's numbers "
    "together (int8 quantizes activations with one scale per batch); serve --dtype fp32 for answers that do not"
)


def serve_dtype(flags: SearchFlags) -> SearchFlags:
    """serve's "auto" is fp32, whatever translate's would be: a stranger's request in the same batch must not
    change anyone's translation, and in bf16 or int8 it can (tests/serve/test_http_guard.py measures fp32's
    independence)."""
    return replace(flags, dtype="fp32") if flags.dtype in (None, "auto") else flags


class Service:
    """The checkpoint loaded once, its facts for /info, the one thread that runs the model, and the bounds on
    what a request may make it compute."""

    def __init__(
        self,
        checkpoint: str | Path,
        settings: ServeSettings,
        device: str = "auto",
        flags: SearchFlags = SearchFlags(),
        target_lang: str | None = None,
    ):
        path = resolve_checkpoint(checkpoint)
        self.settings = settings
        check_beam_setting(flags.beam, settings)  # before the model loads
        self.seed = flags.seed  # a request's seed when it sends none (None: a new one per request)
        # With CTranslate2, /translate runs on it; the page's attention maps and beam traces need our model's
        # internals, so the translator keeps that too.
        self.translator = Translator(path, device, serve_dtype(flags), keep_model=True, target_lang=target_lang)
        if settings.max_beam < self.translator.settings.beam:
            raise UserError(
                f"--max-beam ({settings.max_beam}) is below the checkpoint's decode.beam "
                f"({self.translator.settings.beam}); raise it, or serve with a smaller --beam"
            )
        self.model, self.vocab, self.cfg = self.translator.model, self.translator.vocab, self.translator.cfg
        self.max_beam = min(settings.max_beam, len(self.vocab))  # a request's beam; wider is beam_above_vocabulary
        self.model_device = next(self.model.parameters()).device  # the translator's, or the CPU beside CTranslate2
        dtype = self.translator.settings.dtype
        self.dtype_note = ALONE if dtype == "fp32" else SHARED.format(dtype=dtype)
        self.info = self._describe(path)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")  # searches never overlap
        self.batcher: Batcher | None = None
        self.drain = Drain(settings.drain_s)
        # Whether a connection besides the request's own is open: its batch waits the window only then. run_serve
        # asks uvicorn; elsewhere (a TestClient) the window always applies.
        self.others_connected: Callable[[], bool] = lambda: True

    def _describe(self, path: Path) -> dict:
        m, d, run = self.cfg.model, self.translator.settings, self.translator.run
        return {
            "checkpoint": path.name,
            "step": run.get("step"),
            "validation": {
                "best": run.get("best"),
                "metric": run.get("best_metric"),
                **_validation_at(path.parent, run.get("step")),
            }
            if run
            else None,
            "model": {**asdict(m), "parameters": self.translator.parameters},
            "vocab_size": len(self.vocab),
            "languages": [self.cfg.data.src_lang, self.cfg.data.tgt_lang],
            # a model of several target languages: what a request's "target_lang" may ask for (the page offers them)
            "target_languages": list(self.translator.targets),
            "target_lang": self.translator.target_lang,
            # CTranslate2 has one stop rule, ours "early" (the page, /beam, still searches with ours)
            "decode": {
                "engine": d.engine,
                "beam": d.beam,
                "lenpen": d.lenpen,
                "lenpen_kind": d.lenpen_kind,
                "stop": "early" if d.engine == "ctranslate2" else d.stop,
                "max_len_offset": d.max_len_offset,
                "max_tokens": d.max_tokens,
                "workers": d.workers,
                "sample": d.sample,
                "temperature": d.temperature,
            },
            "device": str(self.translator.device),
            "dtype": d.dtype,
            "dtype_note": self.dtype_note,
            "limits": {
                **asdict(self.settings),
                "max_beam": self.max_beam,
                "max_body_bytes": self.settings.max_body_bytes,
            },
        }

    def check_beam(self, beam: int | None, nbest: int = 1) -> int:
        beam = self.translator.settings.beam if beam is None else beam
        if not 1 <= beam <= self.max_beam:
            raise ApiError(422, f"beam must be between 1 and {self.max_beam}, got {beam}")
        if not 1 <= nbest <= beam:
            raise ApiError(422, f"nbest must be between 1 and the beam size ({beam}), got {nbest}")
        return beam

    def request_settings(self, body: TranslateBody) -> tuple[SearchSettings, int | None]:
        """The settings a /translate request searches with: the server's, with the request's beam, n-best,
        sampling and alignments; and with sampling on our engine, the seed of its sentences (the request's, else
        the server's, else a new one), which travels with them (SentenceOptions) so that requests that differ only
        in their seeds share a search. A bad value or combination is a 422 in one line."""
        d = self.translator.settings
        sample = body.sample if body.sample is not None else d.sample
        if sample is None:
            if body.temperature is not None or body.seed is not None:
                raise ApiError(422, "temperature and seed go with sample (topk:K or topp:P)")
            beam = self.check_beam(body.beam, body.nbest)
            return replace(d, beam=beam, nbest=body.nbest, alignments=body.alignments), None
        if body.beam not in (None, 1):
            raise ApiError(422, f"sample draws each token; it cannot go with beam {body.beam} (nbest N: N samples)")
        if not 1 <= body.nbest <= self.settings.max_samples:
            raise ApiError(422, f"nbest (samples) must be between 1 and {self.settings.max_samples}, got {body.nbest}")
        if body.seed is not None and self.translator.ct2 is not None:
            raise ApiError(422, "this server's engine (ctranslate2) draws from its own random stream: no seed")
        temperature = d.temperature if body.temperature is None else body.temperature
        try:
            settings = replace(
                d, beam=1, nbest=body.nbest, sample=sample, temperature=temperature, alignments=body.alignments
            )
            replace(settings, seed=body.seed)  # the request's seed is checked as a --seed is
        except UserError as e:  # the settings' check names the command's flag: the field here
            raise ApiError(422, str(e).removeprefix("--")) from None
        if self.translator.ct2 is not None:
            return settings, None
        seeds = (body.seed, self.seed, random.SystemRandom().randrange(2**32))
        return settings, next(s for s in seeds if s is not None)

    def sentence_options(self, body: TranslateBody, lines: list[str], seed: int | None) -> list[SentenceOptions] | None:
        """A /translate request's prefixes and constraints, one item per sentence, within the server's limits, and
        its sentences' sampling seed."""
        for name, given in (("prefix", body.prefix), ("constraints", body.constraints)):
            if given is not None and len(given) != len(lines):
                raise ApiError(422, f"{name} must have one item per sentence: {len(given)} for {len(lines)} sentences")
        if body.constraints is not None and any(body.constraints):
            if body.sample is not None or self.translator.settings.sample is not None:
                raise ApiError(422, "constraints need beam search; they cannot go with sample")
            if self.translator.ct2 is not None:
                raise ApiError(422, "this server's engine (ctranslate2) has no terminology constraints")
            most = max(len(c) for c in body.constraints)
            if most > self.settings.max_constraints:
                raise ApiError(
                    422, f"{most} constraints for one sentence; the limit is {self.settings.max_constraints}"
                )
        # Their characters count against --max-chars with the sentences'.
        self.check_size(
            lines, sum(map(len, body.prefix or [])) + sum(len(p) for c in body.constraints or [] for p in c)
        )
        options = None
        if body.prefix or body.constraints:
            limit = min(self.settings.max_prefix, source_limit(self.cfg.model.max_positions))
            for i, ids in enumerate(self.vocab.encode_target([p if p.strip() else "" for p in body.prefix or []])):
                if len(ids) > limit:
                    raise ApiError(422, f"prefix {i} is {len(ids)} pieces long; the limit is {limit}")
            try:
                options = self.translator.sentence_options(
                    len(lines), body.prefix, body.constraints, where=lambda i: f"sentence {i}"
                )
            except UserError as e:  # text the vocabulary lacks
                raise ApiError(422, str(e)) from None
        if seed is not None:
            options = [replace(o, seed=seed) for o in options or [SentenceOptions()] * len(lines)]
        return options

    def check_size(self, lines: list[str], extra_chars: int = 0) -> None:
        if len(lines) > self.settings.max_sentences:
            raise ApiError(413, f"{len(lines)} sentences in one request; the limit is {self.settings.max_sentences}")
        chars = sum(len(line) for line in lines) + extra_chars
        if chars > self.settings.max_chars:
            raise ApiError(413, f"{chars} characters in one request; the limit is {self.settings.max_chars}")

    def check_room(self, sentences: int) -> None:
        if self.batcher.pending_sentences() + sentences > self.settings.max_pending:
            raise ApiError(503, "too many requests are waiting for the model; try again shortly")

    def one_sentence(self, text: str, target_lang: str | None = None) -> Sentence:
        """An inspection's sentence as the model reads it (a multilingual model's after the token of the language
        asked for, or written at its start: Translator.asking)."""
        self.check_size([text])
        if not text.strip():
            raise ApiError(422, "text is empty")
        try:
            (text,), (prefix,) = self.translator.asking([text], target_lang)
        except UserError as e:  # a language the model lacks, or none asked of a multilingual one
            raise ApiError(422, str(e)) from None
        pieces = self.vocab.encode([text])[0] if text.strip() else []
        if not pieces:
            raise ApiError(422, "text is empty")
        ids = prefix + pieces
        limit = source_limit(self.cfg.model.max_positions)
        if len(ids) > limit:
            raise ApiError(422, f"the sentence is {len(ids)} pieces long; this model accepts at most {limit}")
        return Sentence(text, prefix, ids)

    def output_limit(self, ids: list[int]) -> int:
        """The most tokens a search may write for this source (search.max_output_lengths)."""
        return min(len(ids) + 1 + self.translator.settings.max_len_offset, self.cfg.model.max_positions - 1)

    def check_answer(self, values: int, what: str, fix: str) -> None:
        """Refuse (413) before computing an answer that would hold more than --max-answer-values numbers."""
        limit = self.settings.max_answer_values
        if values > limit:
            raise ApiError(
                413,
                f"this answer could hold {values:,} {what}; the limit is {limit:,} (serve --max-answer-values): {fix}",
            )

    def check_attention(self, ids: list[int], target: str | None) -> None:
        """layers x heads x queries x keys of the three kinds, with the longest translation the search may give."""
        m = self.cfg.model
        s = len(ids) + 1  # with EOS
        t = 1 + (self.output_limit(ids) if target is None else len(self.vocab.encode_target([target])[0]))  # with BOS
        values = m.n_heads * (m.n_encoder_layers * s * s + m.n_decoder_layers * (t * t + t * s))
        self.check_answer(values, "attention weights", "send a shorter sentence or target")

    def check_trace(self, ids: list[int], beam: int) -> None:
        """Each step shows at most `beam` hypotheses alive and `beam` finished, each as long as the step."""
        steps = self.output_limit(ids) + 1
        self.check_answer(beam * steps * (steps + 1), "pieces", "use a smaller beam or a shorter sentence")

    async def inspect(
        self, request: Request, compute, *args, media_type: str = "application/json", headers: dict | None = None
    ) -> Response:
        """compute(*args) -> JSON-ready answer (or, with another media_type, the answer's bytes), on the model worker
        in its turn (request_batching.py), encoded there too: the loop stays free for other clients; dropped unrun if
        the client goes away first."""
        self.check_room(1)

        def answer() -> bytes:
            value = compute(*args)
            return _json(value) if media_type == "application/json" else value

        try:
            body = await until_gone(request, self.batcher.inspect(answer))
        except Exception as e:
            raise api_error(e, compute.__name__) from None
        return Response(body, media_type=media_type, headers=headers)

    def check_animation(self, body: AnimateBody) -> None:
        """The layer, head and frame rate an /animate request asks for, and the plotting library it needs."""
        from transformer.visualize.animation import MAX_FPS, MIN_FPS
        from transformer.visualize.plots import require_matplotlib

        m = self.cfg.model
        stacks = {"encoder": m.n_encoder_layers, "decoder": m.n_decoder_layers}
        for part in PARTS if body.only is None else (body.only,):
            if body.layer is not None and not 1 <= body.layer <= stacks[part]:
                raise ApiError(422, f"layer must be between 1 and {stacks[part]} (the {part}'s), got {body.layer}")
        if body.head is not None and not 1 <= body.head <= m.n_heads:
            raise ApiError(422, f"head must be between 1 and {m.n_heads}, got {body.head}")
        if not MIN_FPS <= body.fps <= MAX_FPS:
            raise ApiError(422, f"fps must be between {MIN_FPS:g} and {MAX_FPS:g}, got {body.fps:g}")
        try:
            require_matplotlib()
        except UserError as e:
            raise ApiError(501, f"this server cannot draw: {e}") from None

    def animation(self, sentence: Sentence, body: AnimateBody, beam: int) -> bytes:
        """The GIF `transformer animate` writes for the sentence, searched with this server's settings and `beam`."""
        from transformer.visualize.animation import animation_gif

        settings = replace(self.translator.settings, beam=beam, nbest=1)
        text, prefix = sentence.text, sentence.prefix
        shown = walk(self.model, self.vocab, text, settings, body.layer, body.head, body.only, prefix)
        return animation_gif(frames(shown), body.fps)

    def position_view(self, d_model: int, length: int) -> dict:
        """What the model's kind of position shows (Positions.view): its tables, or a note that it has none."""
        view = self.model.position_encoding.view(length, d_model)
        rounded = {name: np.round(table.double().numpy(), 4).tolist() for name, table in view.tables.items()}
        return {
            "kind": view.kind,
            "title": view.title,
            "note": view.note,
            "columns": view.columns,
            "values": view.values,
            "adds_table": view.adds_table,
            "d_model": d_model,
            "length": length,
            "table": next(iter(rounded.values()), None),  # the first (or only) table; null when there is none
            "tables": rounded,
        }

    def attention(self, sentence: Sentence, target: str | None, beam: int) -> dict:
        settings = replace(self.translator.settings, beam=beam, nbest=1)
        maps = inspect_attention(self.model, self.vocab, sentence.text, target, settings, sentence.prefix)
        pieces = {"source": maps.source_pieces, "target": maps.target_pieces}
        sides = {"encoder": ("source", "source"), "decoder": ("target", "target"), "cross": ("target", "source")}
        return {
            "source": maps.source,
            "target": maps.target,
            "translated": maps.translated,
            "source_pieces": pieces["source"],
            "target_pieces": pieces["target"],
            "attention": {
                kind: {
                    "queries": sides[kind][0],
                    "keys": sides[kind][1],
                    "layers": int(maps.shape(kind)[0]),
                    "heads": int(maps.shape(kind)[1]),
                    # (layers, heads, queries, keys); rows sum to 1
                    "weights": np.round(maps.weights[kind].astype(np.float64), 5).tolist(),
                }
                for kind in KINDS
            },
        }

    def beam_trace(self, ids: list[int], beam: int, nbest: int) -> dict:
        d = self.translator.settings
        src, _ = prepare_sources([ids], self.cfg.model.max_positions, self.vocab.specials)  # (1, S)
        trace: list[TraceStep] = []
        # A beam search whatever the server samples with: the page shows the beam at work.
        settings = replace(d, beam=beam, nbest=nbest, sample=None)
        found = search(self.model, src.to(self.model_device), settings, trace=trace)

        def show(hyps):
            return [
                {"pieces": self.vocab.pieces(h.tokens), "text": text, "score": round(h.score, 5)}
                for h, text in zip(hyps, self.vocab.decode([h.tokens for h in hyps]))
            ]

        return {
            "source_pieces": self.vocab.pieces(src[0].tolist()),
            "beam": beam,
            "lenpen": d.lenpen,
            "lenpen_kind": d.lenpen_kind,
            "stop": d.stop,
            "nbest": show(found.hypotheses[0]),
            "steps": [{"alive": show(step.alive[0]), "finished": show(step.finished[0])} for step in trace],
        }


def check_beam_setting(beam: int | None, settings: ServeSettings) -> None:
    if beam is not None and beam > settings.max_beam:
        raise UserError(f"--beam ({beam}) is above --max-beam ({settings.max_beam})")


def _json(value) -> bytes:
    """As FastAPI's JSONResponse encodes an answer."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


async def until_gone(request: Request, work):
    """await `work`, unless the client hangs up first: then it is cancelled (a queued search or inspection is
    dropped before it runs) and the request ends without an answer, for no one is there to read it."""
    work = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_hung_up(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
        # Read the outcome of work that ended with an error nobody awaits (the server's stop answered it while this
        # request was being cancelled): asyncio would log "Task exception was never retrieved" with a traceback.
        work.add_done_callback(lambda task: task.cancelled() or task.exception())
    if work.cancelled():
        raise ApiError(499, "the client closed the connection")
    return work.result()


async def _hung_up(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _validation_at(run_dir: Path, step: int | None) -> dict:
    """The validation figures metrics.jsonl holds for `step` (loss, ppl, bleu...), when the run directory has them."""
    from transformer.training.metrics import read_metrics

    try:
        rows = read_metrics(run_dir)
    except (UserError, OSError):
        return {}
    found = [r for r in rows if r.get("split") == "valid" and r.get("step") == step]
    return {k: v for k, v in found[-1].items() if k in ("loss", "nll", "ppl", *NAMES)} if found else {}


def check_positions(d_model: int, length: int, max_values: int) -> None:
    """The size of a /positions answer; what the model's kind of position needs of d_model is its own check
    (config.positions_problem, through Positions.view)."""
    if length < 1:
        raise ApiError(422, f"length must be at least 1, got {length}")
    if d_model * length > max_values:
        raise ApiError(422, f"d_model x length is {d_model} x {length}; the limit is {max_values} values per table")
