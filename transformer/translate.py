"""Text in, text out: a Translator that loads a checkpoint once, batches by length, searches and detokenises; sacreBLEU scoring."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence, TextIO

import torch

from transformer.batch import pad_sequences
from transformer.checkpoint import load_model
from transformer.data import pack_by_size
from transformer.errors import UserError
from transformer.search import Hypothesis, beam_search, greedy_search
from transformer.vocab import EOS_ID



def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise UserError(f"--device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def length_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped so that batch size x longest (length + EOS) <= max_tokens; longest first, so
    an out-of-memory error shows on the first batch rather than the last."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return pack_by_size(order, [n + 1 for n in lengths], max_tokens)


def search_ids(model, src_ids: Sequence[Sequence[int]], beam: int, lenpen: float, max_len_offset: int,
               max_tokens: int, device, nbest: int = 1) -> list[list[Hypothesis]]:
    """Per source (subword ids, no EOS), its n-best hypotheses, input order kept. An empty source gives
    nbest empty hypotheses without running the model; sources are cut to max_positions - 2 subwords."""
    limit = model.cfg.max_positions - 2
    out: list[list[Hypothesis]] = [[Hypothesis([], 0.0) for _ in range(nbest)] for _ in src_ids]
    todo = [i for i, ids in enumerate(src_ids) if len(ids) > 0]
    lengths = [min(len(src_ids[i]), limit) for i in todo]
    for batch in length_batches(lengths, max_tokens):
        rows = [list(src_ids[todo[j]][:limit]) + [EOS_ID] for j in batch]
        src = pad_sequences(rows).to(device)  # (B, S)
        if beam == 1 and nbest == 1:
            found = [[h] for h in greedy_search(model, src, max_len_offset)]
        else:
            found = beam_search(model, src, beam, lenpen, max_len_offset, nbest)
        for j, hyps in zip(batch, found):
            out[todo[j]] = hyps
    return out


def translate_ids(model, src_ids: list[list[int]], beam: int, lenpen: float, max_len_offset: int,
                  max_tokens: int, device) -> list[list[int]]:
    """Best output ids (no BOS/EOS) per source, in input order: the trainer's validation-BLEU entry point."""
    return [hyps[0].tokens for hyps in search_ids(model, src_ids, beam, lenpen, max_len_offset, max_tokens, device)]


def _one_line(text: str) -> str:
    # A subword may hold a line break (the vocabulary saw any character but '\n'): keep one line per input.
    return " ".join(text.splitlines()) if ("\n" in text or "\r" in text) else text


class Translator:
    """A model, its vocabulary and decode settings, loaded once; translate() maps lines to lines."""

    def __init__(self, checkpoint: str | Path, device: str = "auto", beam: Optional[int] = None,
                 lenpen: Optional[float] = None, max_tokens: Optional[int] = None,
                 max_len_offset: Optional[int] = None, int8: bool = False):
        self.device = pick_device(device)
        self.model, self.vocab, self.cfg = load_model(checkpoint, self.device)
        if int8:
            from transformer.quantize import quantize_int8

            self.model = quantize_int8(self.model)
        dec = self.cfg.decode
        self.beam = dec.beam if beam is None else beam
        self.lenpen = dec.lenpen if lenpen is None else lenpen
        self.max_tokens = dec.max_tokens if max_tokens is None else max_tokens
        self.max_len_offset = dec.max_len_offset if max_len_offset is None else max_len_offset
        for ok, message in ((self.beam >= 1, "beam must be at least 1"), (self.lenpen >= 0, "lenpen must not be negative"),
                            (self.max_tokens >= 1, "max tokens must be positive"),
                            (self.max_len_offset >= 1, "max length offset must be at least 1")):
            if not ok:
                raise UserError(message)
        self.lines_seen = 0  # numbers the lines in truncation warnings across streamed chunks

    def encode(self, lines: Sequence[str]) -> list[list[int]]:
        ids = self.vocab.encode([line if line.strip() else "" for line in lines])
        limit = self.cfg.model.max_positions - 2
        for i, seq in enumerate(ids):
            if len(seq) > limit:
                print(f"warning: input line {self.lines_seen + i + 1} has {len(seq)} subwords; truncated to the "
                      f"first {limit} (model.max_positions - 2)", file=sys.stderr)
        self.lines_seen += len(lines)
        return ids

    def translate_nbest(self, lines: Sequence[str], nbest: int = 1) -> list[list[tuple[float, str]]]:
        """Per line, up to `nbest` (score, translation) pairs, best first."""
        if nbest > self.beam:
            raise UserError(f"--nbest ({nbest}) cannot exceed the beam size ({self.beam})")
        found = search_ids(self.model, self.encode(lines), self.beam, self.lenpen, self.max_len_offset,
                           self.max_tokens, self.device, nbest)
        return [[(h.score, _one_line(text)) for h, text in zip(hyps, self.vocab.decode([h.tokens for h in hyps]))]
                for hyps in found]

    def translate(self, lines: Sequence[str]) -> list[str]:
        return [hyps[0][1] for hyps in self.translate_nbest(lines, 1)]


def bleu_chrf(hypotheses: Sequence[str], references: Sequence[str]) -> dict:
    """Corpus BLEU and chrF with sacreBLEU defaults (13a tokenisation, cased), with their signatures."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hypotheses) != len(references):
        raise UserError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu, chrf = BLEU(), CHRF()
    b = bleu.corpus_score(list(hypotheses), [list(references)])
    c = chrf.corpus_score(list(hypotheses), [list(references)])
    return {
        "bleu": b.score, "chrf": c.score,
        "bleu_signature": str(bleu.get_signature()), "chrf_signature": str(chrf.get_signature()),
        "bleu_detail": str(b), "chrf_detail": str(c),
        "bp": b.bp, "sys_len": b.sys_len, "ref_len": b.ref_len, "sentences": len(hypotheses),
    }


def stdin_chunks(stream: Optional[TextIO] = None, fallback_lines: int = 512) -> Iterator[list[str]]:
    """Lines of stdin in chunks of whatever has arrived: a whole piped file comes in large chunks,
    an interactive line comes alone, as soon as Enter is pressed."""
    stream = sys.stdin if stream is None else stream
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        fd = None
    if fd is None:  # not a real file (e.g. a StringIO in tests): fixed-size chunks
        chunk = []
        for line in stream:
            chunk.append(line.rstrip("\n").rstrip("\r"))
            if len(chunk) >= fallback_lines:
                yield chunk
                chunk = []
        if chunk:
            yield chunk
        return
    yield from _fd_chunks(fd)


def _fd_chunks(fd: int) -> Iterator[list[str]]:
    # os.read returns what is available now (blocking only while nothing is), unlike a buffered readline loop.
    pending = b""
    while True:
        data = os.read(fd, 1 << 16)
        if not data:
            break
        pending += data
        *complete, pending = pending.split(b"\n")
        if complete:
            yield [_decode_line(raw) for raw in complete]
    if pending:
        yield [_decode_line(pending)]


def _decode_line(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")  # one bad byte should not stop a stream
    return text[:-1] if text.endswith("\r") else text


def _write_nbest(out: TextIO, results: list[list[tuple[float, str]]], nbest: int) -> None:
    for hyps in results:
        if nbest == 1:
            out.write(hyps[0][1] + "\n")
        else:
            for score, text in hyps:
                out.write(f"{score:.4f}\t{text}\n")
    out.flush()


def run_translate(checkpoint: str, sentences: Sequence[str], input: Optional[str], output: Optional[str],
                  beam: Optional[int], lenpen: Optional[float], nbest: int, max_tokens: Optional[int],
                  device: str, int8: bool = False) -> None:
    """The `translate` command: sentences from arguments, a file, or stdin (streamed), one result per line."""
    from transformer.atomic import check_output_path
    from transformer.data import read_lines

    if sentences and input:
        raise UserError("translate: give sentences as arguments or --input FILE, not both")
    if nbest < 1:
        raise UserError("--nbest must be at least 1")
    if output is None and sys.stdout is None:
        raise UserError("translate: standard output is closed; give --output FILE")
    if not sentences and not input and sys.stdin is None:
        raise UserError("translate: standard input is closed; give sentences as arguments or --input FILE")
    if output:  # before anything is opened: never truncate an input or a checkpoint
        check_output_path(output, [input, checkpoint], command="translate")
    translator = Translator(checkpoint, device, beam, lenpen, max_tokens, int8=int8)
    if nbest > translator.beam:
        raise UserError(f"--nbest ({nbest}) cannot exceed the beam size ({translator.beam}); raise --beam")
    if output is None and hasattr(sys.stdout, "reconfigure"):
        try:  # a translation may hold characters the terminal's encoding lacks: never crash on printing
            sys.stdout.reconfigure(errors="replace")
        except (ValueError, OSError):
            pass
    lines = list(sentences) if sentences else read_lines(input) if input else None  # read before opening the output
    out = open(output, "w", encoding="utf-8") if output else sys.stdout
    try:
        if lines is not None:
            _write_nbest(out, translator.translate_nbest(lines, nbest), nbest)
        else:
            for chunk in stdin_chunks():
                _write_nbest(out, translator.translate_nbest(chunk, nbest), nbest)
        if output:
            out.close()
    except OSError as e:
        if isinstance(e, BrokenPipeError) or e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, output or "standard output") from None  # e.g. a full disk: say where
    finally:
        if output and not out.closed:
            try:
                out.close()
            except OSError:  # already reported above
                pass


def run_evaluate(run_dir: str, split: Optional[str], src: Optional[str], ref: Optional[str], beam: Optional[int],
                 lenpen: Optional[float], max_tokens: Optional[int], device: str, int8: bool = False) -> dict:
    """The `evaluate` command: translate a split (or --src/--ref files), score, write .hyp and .json."""
    import json
    import time

    from transformer.data import load_split, read_parallel

    if (src is None) != (ref is None):
        raise UserError("evaluate: --src and --ref go together")
    if src is not None and split is not None:
        raise UserError("evaluate: give --split or --src/--ref, not both")
    translator = Translator(run_dir, device, beam, lenpen, max_tokens, int8=int8)
    if src is not None:
        sources, references = read_parallel(src, ref)
        name = Path(src).name
    else:
        data = translator.cfg.data
        aliases = {"train": data.train_split, "valid": data.valid_split, "test": data.test_split}
        split = split or "test"
        real = aliases.get(split, split)
        if data.source == "local":
            from transformer.data import split_paths

            if not all(p.is_file() for p in split_paths(data, real)):
                known = sorted({s for s in aliases} | set(aliases.values()))
                raise UserError(f"evaluate: unknown split {split!r}: no {split_paths(data, real)[0]} "
                                f"(splits of this run: {', '.join(known)}; or pass --src FILE --ref FILE)")
        sources, references = load_split(data, real)
        name = split
    checkpoint = Path(run_dir)
    eval_dir = (checkpoint if checkpoint.is_dir() else checkpoint.parent) / "eval"
    if not checkpoint.is_dir():
        name = f"{checkpoint.stem}.{name}"
    # Settings in the name, so that evaluating with another beam does not overwrite the last result.
    name += f".beam{translator.beam}.lp{translator.lenpen:g}" + (".int8" if int8 else "")
    start = time.perf_counter()
    hypotheses = translator.translate(sources)
    seconds = time.perf_counter() - start
    scores = bleu_chrf(hypotheses, references)
    eval_dir.mkdir(parents=True, exist_ok=True)
    hyp_path, json_path = eval_dir / f"{name}.hyp", eval_dir / f"{name}.json"
    hyp_path.write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    record = {"checkpoint": str(run_dir), "split": split, "src": src, "ref": ref, "beam": translator.beam, "int8": int8,
              "lenpen": translator.lenpen, "seconds": round(seconds, 3), "hypotheses": str(hyp_path), **scores}
    json_path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"{scores['bleu_detail']}\n  signature: {scores['bleu_signature']}")
    print(f"{scores['chrf_detail']}\n  signature: {scores['chrf_signature']}")
    print(f"{len(hypotheses)} sentences in {seconds:.1f}s (beam {translator.beam}, lenpen {translator.lenpen}); "
          f"wrote {hyp_path} and {json_path}")
    return record
