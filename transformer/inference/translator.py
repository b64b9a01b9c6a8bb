"""Text in, text out: a Translator that loads a checkpoint (or an ensemble of several) once and runs it on a
device, in a dtype (fp32/bf16/int8), through an engine (ours or CTranslate2), with the SearchSettings its flags
and the checkpoint make (settings.py); lines encoded and cut, what they ask (a forced prefix, constraints) encoded
and checked, their hypotheses as Translations with word alignments (the batches and which search each gets:
batched.py; the command's own input and output: translate_io.py); translate_ids, the trainer's entry point."""

from __future__ import annotations

import random
import re
import sys
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from transformer.data.batch import source_limit
from transformer.device import auto_precision, bounded_onednn_caches, native_bf16, pick_device
from transformer.errors import UserError
from transformer.inference.alignment import default_layer, pharaoh, piece_alignments, word_alignments
from transformer.inference.batched import SentenceOptions, search_ids, search_workers, threads_per_worker
from transformer.inference.ensemble import Ensemble, check_vocabularies
from transformer.inference.search import Hypothesis
from transformer.inference.settings import SearchFlags, SearchSettings, search_settings
from transformer.model.checkpoint import load_checkpoint, model_from_checkpoint, resolve_checkpoint
from transformer.model.transformer import count_parameters

TRUNCATION_WARNINGS = 5  # lines named one by one before the rest are only counted
# A line is cut to this many characters before SentencePiece splits it: splitting costs tens of bytes of memory per
# character (a line of megabytes takes gigabytes), while the model reads only max_positions - 2 subwords of a line,
# a few thousand characters. A warning names each line cut; a stream goes on (one line must not stop it).
MAX_LINE_CHARS = 1 << 20


def pick_dtype(name: str, device: torch.device, engine: str = "ours", sampling: bool = False) -> tuple[str, str]:
    """-> (fp32|bf16|int8, why). "auto" takes the fastest that keeps BLEU: bf16 on a CUDA device that supports
    it and on a CPU with native bf16, else fp32 (int8 is never chosen for you: it changes more outputs). For
    CTranslate2, bf16 only where CTranslate2 itself computes it on the device (its CPU builds do not). Our
    engine's sampling takes fp32 (SAMPLING_DTYPE). `name` is one of settings.DTYPES (SearchFlags checked it)."""
    if name != "auto":
        return name, "asked for"
    if sampling and engine == "ours":
        return "fp32", SAMPLING_DTYPE
    if engine == "ctranslate2":
        from transformer.inference.ctranslate2_engine import CT2_COMPUTE_TYPES
        from transformer.inference.ctranslate2_export import require_ctranslate2

        if CT2_COMPUTE_TYPES["bf16"] in require_ctranslate2().get_supported_compute_types(device.type):
            return "bf16", f"auto: CTranslate2 computes bf16 on this {device.type}"
        return "fp32", f"auto: CTranslate2 has no bf16 on this {device.type}"
    return auto_precision(device)


# Why sampling's auto is fp32: in bf16 a row's log-probabilities depend on the shape of its batch (the kernels' blocking
# and sums change with it), and a draw near a boundary moves with them: a seeded sentence drew other samples under
# another --max-tokens or --workers (18 of 60 lines agreed; fp32: 60 of 60), which a resumed back-translation cannot
# have. CTranslate2's samples depend on the batch anyway (its random stream): its auto is unchanged.
SAMPLING_DTYPE = "auto: fp32 when sampling, so that a sentence's samples do not depend on its batch"
# An explicit reduced precision with sampling is kept (the speed may be worth it where nothing is resumed) and said.
SAMPLING_IN = (
    "warning: sampling in {dtype}: a sentence's samples may change with its batch (--max-tokens, --workers, the "
    "other lines); --dtype fp32 draws the same samples however the input is batched"
)


def translate_ids(model, src_ids: list[list[int]], settings: SearchSettings, device) -> list[list[int]]:
    """Best output ids (no BOS/EOS) per source, in input order (settings.nbest aside: one is kept): the
    trainer's validation-BLEU entry point."""
    return [hyps[0].tokens for hyps in search_ids(model, src_ids, replace(settings, nbest=1), device)]


SHOWN_LACKING = 10  # characters a refusal names before it counts the rest


def lacking(vocab, text: str, ids: Sequence[int]) -> str | None:
    """What of `text` the vocabulary lacks, where `ids`, its encoding (by whichever side's model), hold the unknown
    piece: the characters that none of its other pieces spell, quoted, or a phrase for pieces whose characters are
    all spelled elsewhere (a piece the id list lacks); None when no id is unknown. Reads only the ids and the text,
    not which model split them."""
    unk = vocab.specials.unk
    if unk not in ids:
        return None
    spelled = set(vocab.decode([[i for i in ids if i != unk]])[0])
    # SentencePiece normalises (NFKC) before it splits: a character counts as spelled if its normal form is.
    missing = [
        c
        for c in dict.fromkeys(text)
        if not c.isspace() and not set(unicodedata.normalize("NFKC", c)) <= spelled | {" "}
    ]
    if not missing:
        return "pieces the vocabulary has no id for"
    more = f" and {len(missing) - SHOWN_LACKING} more" if len(missing) > SHOWN_LACKING else ""
    return "characters the vocabulary lacks: " + ", ".join(map(repr, missing[:SHOWN_LACKING])) + more


def refuse_lacking(vocab, text: str, ids: Sequence[int], what: str) -> None:
    """A forced prefix or a constraint (`what`) with text the vocabulary lacks, refused in one line: that text would
    be forced as the unknown piece, printed as ⁇, and a constraint of it counted as met."""
    problem = lacking(vocab, text, ids)
    if problem is not None:
        raise UserError(f"{what} has {problem} (they would be <unk>, printed as ⁇); remove or replace them")


def _one_line(text: str) -> str:
    # A subword may hold a line break (the vocabulary saw any character but '\n'): keep one line per input.
    return " ".join(text.splitlines()) if ("\n" in text or "\r" in text) else text


@dataclass
class Translation:
    """One translation of a line: its score (search.py's), its text on one line, and with alignments asked for,
    (source word, output word) pairs (alignment.py)."""

    score: float
    text: str
    alignment: list[tuple[int, int]] | None = None
    constrained: bool = True  # False: the line's constraints could not all be met, and this is unconstrained

    def alignment_text(self) -> str:
        return pharaoh(self.alignment or [])


# A language token at the start of a line, as OPUS-MT's users write it: >>fr<< text.
LANGUAGE_TOKEN = re.compile(r"\s*(>>[^<>\s]+<<)\s*")


def target_tokens(cfg, vocab) -> tuple[dict[str, str], bool]:
    """(language -> the token that asks a multilingual model for it, whether every line must ask for one): a
    multilingual run of ours (data.target_tokens: required), or an imported Marian vocabulary's >>xx<< pieces (as
    OPUS-MT takes them: optional); ({}, False) for a model of one target language."""
    if cfg.data.target_tokens:
        return dict(cfg.data.target_tokens), True
    codes = [p for p in vocab.pieces(range(len(vocab))) if LANGUAGE_TOKEN.fullmatch(p)]
    return ({code[2:-2]: code for code in codes} if len(codes) > 1 else {}), False


class Translator:
    """A model (or an ensemble), its vocabulary and search settings, loaded once; translate() maps lines to lines.

    checkpoint: a run directory or checkpoint file, or several: an ensemble (ensemble.py; one vocabulary, checked
    here; the first one's config, decode section and run state; ours only). flags: what the caller asked for
    (SearchFlags; None = the checkpoint's decode section), made into `settings` (SearchSettings, search_settings)
    once the checkpoint is read, with the dtype picked for the device, and with sampling a seed (drawn here when
    none is given, and said in `note`). dtype: fp32, bf16 (weights cast; log-probabilities still in fp32), int8
    (CPU: dynamic quantization of the linear layers) or auto (pick_dtype; `note` says what it picked; a library
    caller's default is fp32). engine: ours (PyTorch search) or ctranslate2 (the checkpoint converted once,
    cached beside it: ctranslate2_export.cached_conversion). workers: searches side by side on a CPU
    (search_batches); CTranslate2 gets them as its inter_threads. keep_model: with CTranslate2, keep the PyTorch
    model too (fp32, on the CPU), for what only it can show (serve's attention maps and beam traces); otherwise
    it is dropped once converted.
    """

    def __init__(
        self,
        checkpoint: str | Path | Sequence[str | Path],
        device: str = "auto",
        flags: SearchFlags = SearchFlags(),
        keep_model: bool = False,
        target_lang: str | None = None,
    ):
        bounded_onednn_caches()  # a library caller's first CPU work may be ours
        checkpoints = [checkpoint] if isinstance(checkpoint, (str, Path)) else list(checkpoint)
        self.device = pick_device(device)
        engine = flags.engine or SearchSettings.engine
        if engine == "ctranslate2" and len(checkpoints) > 1:
            raise UserError("an ensemble runs on --engine ours only: CTranslate2 searches one model at a time")
        dtype, why = pick_dtype(flags.dtype or SearchSettings.dtype, self.device, engine, flags.sample is not None)
        models, vocabs = [], []
        for path in checkpoints:
            state = load_checkpoint(resolve_checkpoint(path))
            model, vocab, cfg = model_from_checkpoint(state, self.device if engine == "ours" else "cpu")
            if not models:  # the first: its config, decode section and run state are the translator's
                self.vocab, self.cfg = vocab, cfg
                self.run: dict = state.get("run") or {}  # the training state it was saved at, for serve's /info
            del state
            vocabs.append(vocab)
            check_vocabularies(vocabs, [str(c) for c in checkpoints])  # before the next one loads
            models.append(model)
        if len(models) > 1:  # a source or an output must fit every member
            shortest = min(m.cfg.max_positions for m in models)
            self.cfg = replace(self.cfg, model=replace(self.cfg.model, max_positions=shortest))
        self.parameters = sum(map(count_parameters, models))  # as trained: the dtypes and layouts below hide some
        self.settings = search_settings(
            self.cfg.decode, replace(flags, dtype=dtype), len(self.vocab), self.cfg.model.n_decoder_layers
        )
        # For the commands to print once their own checks have passed (a library caller may ignore it).
        notes = [f"dtype: {dtype} ({why})"] if flags.dtype == "auto" else []
        if dtype == "bf16" and self.device.type == "cpu" and not native_bf16(self.device)[0]:
            notes = [
                "warning: this CPU has no native bf16 (no avx512_bf16 or amx_bf16): bf16 runs emulated, "
                "much slower than fp32"
            ]
        if flags.sample is not None and engine == "ours" and dtype != "fp32":
            notes.append(SAMPLING_IN.format(dtype=dtype))
        if engine == "ctranslate2" and flags.stop == "exact":  # asked for, not the checkpoint's default
            notes.append("warning: --stop exact does not apply to --engine ctranslate2, which stops like --stop early")
        if self.settings.sample is not None and self.settings.seed is None:
            self.settings = replace(self.settings, seed=random.SystemRandom().randrange(2**32))
            notes.append(f"sampling with seed {self.settings.seed} (--seed {self.settings.seed} draws these again)")
        last = self.cfg.model.n_decoder_layers
        if engine == "ctranslate2" and self.settings.alignments and self.settings.alignment_layer not in (None, last):
            raise UserError(
                f"--engine ctranslate2 returns the attention of the last decoder layer ({last}) only; "
                "drop --alignment-layer, or use --engine ours"
            )
        self.note = "\n".join(notes) if notes else None
        # --shortlist: the output weights as trained, before a weight format packs or quantizes them; the members
        # of an ensemble share the first one's list, as they share its vocabulary. Also on the PyTorch copy that
        # serve keeps beside CTranslate2 for its traces.
        outputs = []
        if self.settings.shortlist:
            from transformer.inference.shortlist import ShortlistOutput, of_run

            table = of_run(checkpoints[0], self.vocab, models[0].specials)
            outputs = [ShortlistOutput(table, m.output.weight, m.output.bias) for m in models]
        self.ct2 = None
        if engine == "ctranslate2":
            from transformer.inference.ctranslate2_engine import load

            workers = search_workers(self.settings.workers, self.device)  # laid out over the CPU's threads as ours
            threads = threads_per_worker(workers) if self.device.type == "cpu" else 1
            self.ct2 = load(checkpoints[0], self.device, self.settings, workers, threads)
            models = models if keep_model else []  # converted: the PyTorch copy is not needed any more
        else:
            models = [self._in_format(m, dtype) for m in models]
        for model, output in zip(models, outputs):
            model.shortlist = output
        self.model = (models[0] if len(models) == 1 else Ensemble(models)) if models else None
        self.lines_seen = 0  # numbers the lines in warnings across streamed chunks
        self.lines_truncated = 0
        self.targets, self.token_required = target_tokens(self.cfg, self.vocab)
        self.target_lang = self.check_target(target_lang)

    def _in_format(self, model, dtype: str):
        """The model with its weights as `dtype` and the device want them (weight_formats.py)."""
        if dtype == "bf16" and self.device.type == "cpu":
            from transformer.inference.weight_formats import pack_bf16

            return pack_bf16(model)
        if dtype == "bf16":
            return model.to(torch.bfloat16)
        if dtype == "int8":
            from transformer.inference.weight_formats import quantize_int8

            return quantize_int8(model)
        if self.device.type == "cpu":
            from transformer.inference.weight_formats import cpu_fp32

            return cpu_fp32(model)
        return model

    def check_target(self, target_lang: str | None) -> str | None:
        """`target_lang`, if the model translates into it (a one-line error naming the languages it has otherwise)."""
        if target_lang is None:
            return None
        languages = list(self.targets) or [self.cfg.data.tgt_lang]
        if target_lang not in languages:
            raise UserError(
                f"--target-lang {target_lang}: this model translates into {', '.join(languages)}"
                + ("" if self.targets else " only")
            )
        return target_lang

    def asking(self, lines: Sequence[str], target_lang: str | None = None) -> tuple[list[str], list[list[int]]]:
        """A multilingual run's lines without the language token a line starts with (>>fr<<, as OPUS-MT's users
        write it), and each line's token id: the line's own, else `target_lang` (else the translator's). A line that
        asks for no language, or for one the model lacks, is a one-line error. An imported multi-target Marian model:
        its code written before a line that has none (its vocabulary splits it off); one target language: the lines as
        they are. No ids for those."""
        target_lang = self.check_target(target_lang) or self.target_lang
        if not self.token_required:  # a Marian vocabulary splits off a leading >>xx<< itself
            code = self.targets.get(target_lang)
            asked = [
                f"{code} {line}" if code and line.strip() and not LANGUAGE_TOKEN.match(line) else line for line in lines
            ]
            return asked, [[] for _ in lines]
        texts, prefixes = [], []
        for i, line in enumerate(lines):
            match = LANGUAGE_TOKEN.match(line)
            token = match.group(1) if match else self.targets.get(target_lang, "")
            if match and token not in self.targets.values():
                raise UserError(
                    f"input line {self.lines_seen + i + 1} asks for {token}: this model translates into "
                    f"{', '.join(self.targets)} ({', '.join(self.targets.values())})"
                )
            if not token and line.strip():
                raise UserError(
                    f"this model translates into {', '.join(self.targets)}: give --target-lang (serve: "
                    f'"target_lang"), or start each line with its language\'s token, e.g. {next(iter(self.targets.values()))}'
                )
            texts.append(line[match.end() :] if match else line)
            prefixes.append(self.vocab.piece_ids([token]) if token and line.strip() else [])
        return texts, prefixes

    def encode(self, lines: Sequence[str], warn: bool = True, target_lang: str | None = None) -> list[list[int]]:
        """Subword ids per line (a multilingual model's after the token of the language asked for: asking); a line
        longer than the model takes is truncated by the search, and one longer than MAX_LINE_CHARS is cut before it
        is split; both are said on stderr (warn=False: the caller tells its own way, as serve does in its answer)."""
        lines, prefixes = self.asking(list(lines), target_lang)
        lengths = [len(line) for line in lines]
        cut = [line[:MAX_LINE_CHARS] for line in lines]
        ids = [
            prefix + seq
            for prefix, seq in zip(prefixes, self.vocab.encode([line if line.strip() else "" for line in cut]))
        ]
        limit = source_limit(self.cfg.model.max_positions)
        for i, seq in enumerate(ids):
            if warn and (len(seq) > limit or lengths[i] > MAX_LINE_CHARS):
                self.lines_truncated += 1
                # A file of long lines would bury everything else on stderr: the first few, then a count at the end.
                if self.lines_truncated <= TRUNCATION_WARNINGS:
                    more = (
                        "; further ones are counted at the end" if self.lines_truncated == TRUNCATION_WARNINGS else ""
                    )
                    has = (
                        f"{len(seq)} subwords"
                        if lengths[i] <= MAX_LINE_CHARS
                        else f"over {MAX_LINE_CHARS:,} characters (only those are read)"
                    )
                    print(
                        f"warning: input line {self.lines_seen + i + 1} has {has}; truncated to the first {limit} "
                        f"subwords (model.max_positions - 2){more}",
                        file=sys.stderr,
                    )
        self.lines_seen += len(lines)
        return ids

    def report_truncation(self) -> None:
        """At the end of the input: how many lines were truncated in all, once the warnings stopped naming them."""
        if self.lines_truncated >= TRUNCATION_WARNINGS:  # at 5, the fifth warning promised a count
            print(
                f"warning: {self.lines_truncated} of {self.lines_seen} input lines were longer than "
                f"{source_limit(self.cfg.model.max_positions)} subwords and were truncated",
                file=sys.stderr,
            )

    def search(
        self,
        src_ids: Sequence[Sequence[int]],
        settings: SearchSettings | None = None,
        options: Sequence[SentenceOptions] | None = None,
        unmet: list[int] | None = None,
    ) -> list[list[Hypothesis]]:
        """Per source (subword ids), its settings.nbest best hypotheses, through this translator's engine, each
        with its alignment when settings.alignments. settings: this translator's, or a variant of them (serve's
        request settings: dataclasses.replace of these; their dtype and engine are this translator's whatever
        they say). options and unmet: as for search_ids."""
        settings = self.settings if settings is None else settings
        if self.ct2 is not None:
            if options is not None and any(o.constraints for o in options):
                raise UserError("--engine ctranslate2 has no terminology constraints; use --engine ours")
            from transformer.inference.ctranslate2_engine import ctranslate2_search

            prefixes = None if options is None else [o.prefix for o in options]
            max_positions = self.cfg.model.max_positions
            return ctranslate2_search(self.ct2, self.vocab, src_ids, settings, max_positions, prefixes)
        found = search_ids(self.model, src_ids, settings, self.device, options, unmet)
        if settings.alignments:
            limit = source_limit(self.cfg.model.max_positions)
            pairs = [(src_ids[i][:limit], h.tokens) for i, hyps in enumerate(found) for h in hyps]
            layer = settings.alignment_layer or default_layer(self.cfg.model.n_decoder_layers)
            links = iter(piece_alignments(self.model, pairs, layer, settings.max_tokens))
            for hyps in found:
                for h in hyps:
                    h.alignment = next(links)
        return found

    def sentence_options(
        self,
        count: int,
        prefixes: Sequence[str] | None = None,
        constraints: Sequence[Sequence[str]] | None = None,
        first_line: int = 0,
        warn: bool = True,
        where: Callable[[int], str] | None = None,
    ) -> list[SentenceOptions] | None:
        """What `count` sentences ask beyond the settings, from text: per sentence a target prefix ("" = none) and
        target phrases, encoded into pieces (None: no sentence asks anything). A prefix longer than
        model.max_positions - 2 pieces is cut there, with a warning naming its line (first_line + 1 onwards;
        warn=False: none). A prefix or phrase with text the vocabulary lacks is refused (UserError, naming it:
        `where(i)`, by default "input line N")."""
        if not prefixes and not constraints:
            return None
        where = where or (lambda i: f"input line {first_line + i + 1}")
        limit = source_limit(self.cfg.model.max_positions)
        # Target text: split as the target side is (a Marian vocabulary's target.spm; ours is one model for both).
        prefix_ids = self.vocab.encode_target([p if p.strip() else "" for p in prefixes]) if prefixes else [[]] * count
        for i, (text, ids) in enumerate(zip(prefixes or [""] * count, prefix_ids)):
            refuse_lacking(self.vocab, text, ids, f"the prefix of {where(i)}")
            if warn and len(ids) > limit:
                print(
                    f"warning: the prefix of {where(i)} has {len(ids)} pieces; only the first "
                    f"{limit} are forced (model.max_positions - 2)",
                    file=sys.stderr,
                )
        phrases = []
        for i, line in enumerate(constraints or [[]] * count):
            texts = [p for p in line if p.strip()]
            encoded = self.vocab.encode_target(texts) if texts else []
            for text, ids in zip(texts, encoded):
                refuse_lacking(self.vocab, text, ids, f"the constraint {text!r} of {where(i)}")
            phrases.append(tuple(tuple(ids) for ids in encoded if ids))
        return [SentenceOptions(tuple(p[:limit]), c) for p, c in zip(prefix_ids, phrases)]

    def translations(
        self, src_ids: Sequence[Sequence[int]], found: Sequence[Sequence[Hypothesis]], unmet: Sequence[int] = ()
    ) -> list[list[Translation]]:
        """search()'s hypotheses as Translations: text on one line, word alignments where the hypotheses have them."""
        limit = source_limit(self.cfg.model.max_positions)
        out = []
        for i, (ids, hyps) in enumerate(zip(src_ids, found)):
            texts = self.vocab.decode([h.tokens for h in hyps])
            source_pieces = self.vocab.pieces(list(ids[:limit]))
            out.append(
                [
                    Translation(
                        h.score,
                        _one_line(text),
                        None
                        if h.alignment is None
                        else word_alignments(source_pieces, self.vocab.pieces(h.tokens), h.alignment),
                        i not in unmet,
                    )
                    for h, text in zip(hyps, texts)
                ]
            )
        return out

    def translate_lines(
        self,
        lines: Sequence[str],
        prefixes: Sequence[str] | None = None,
        constraints: Sequence[Sequence[str]] | None = None,
        settings: SearchSettings | None = None,
    ) -> list[list[Translation]]:
        """Per line, its settings.nbest Translations, best first; per line optionally a forced target prefix and
        target phrases its translations must contain. A line whose phrases cannot all be met gets its best
        unconstrained translations and a warning on stderr."""
        first = self.lines_seen
        ids = self.encode(lines)
        options = self.sentence_options(len(lines), prefixes, constraints, first)
        unmet: list[int] = []
        found = self.search(ids, settings, options, unmet)
        for i in sorted(unmet):
            print(
                f"warning: input line {first + i + 1}: its translations could not contain every constraint "
                "within the length limit; it has the unconstrained ones",
                file=sys.stderr,
            )
        return self.translations(ids, found, unmet)

    def translate_nbest(self, lines: Sequence[str], nbest: int | None = None) -> list[list[tuple[float, str]]]:
        """Per line, up to `nbest` (default settings.nbest) (score, translation) pairs, best first."""
        settings = None if nbest is None else replace(self.settings, nbest=nbest)
        return self.texts(self.search(self.encode(lines), settings))

    def texts(self, found: Sequence[Sequence[Hypothesis]]) -> list[list[tuple[float, str]]]:
        """search()'s hypotheses as (score, translation) pairs, one line each."""
        return [
            [(h.score, _one_line(text)) for h, text in zip(hyps, self.vocab.decode([h.tokens for h in hyps]))]
            for hyps in found
        ]

    def translate(self, lines: Sequence[str]) -> list[str]:
        return [hyps[0][1] for hyps in self.translate_nbest(lines, 1)]
