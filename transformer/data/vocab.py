"""The vocabularies, with their special-token ids, loading, encoding and decoding: ours, one joint SentencePiece
model that this package trains; and Marian's (an imported OPUS-MT model's, as transformers' MarianTokenizer reads it:
a source and a target SentencePiece model whose pieces are numbered by vocab.json). Both answer the same calls:
encode (sources), encode_target, decode, pieces, piece_ids, len(); `stored` is what a checkpoint keeps of them."""

from __future__ import annotations

import functools
import hashlib
import io
import itertools
import json
import logging
import os
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from transformer.errors import UserError
from transformer.files import JSON_LIMIT, atomic_write, read_regular
from transformer.run_dir import RunDir


@dataclass(frozen=True)
class Specials:
    """The ids a vocabulary reserves: padding, unknown pieces, the decoder's first input (bos) and the end (eos)."""

    pad: int = 0
    unk: int = 1
    bos: int = 2
    eos: int = 3


# The special ids, fixed for every model this package trains.
OURS = Specials()
PAD_ID, UNK_ID, BOS_ID, EOS_ID = OURS.pad, OURS.unk, OURS.bos, OURS.eos

log = logging.getLogger("transformer")

_NOT_TEXT = frozenset((PAD_ID, BOS_ID, EOS_ID))
# Not Unicode text: what Python makes of a command-line byte that is not UTF-8 (surrogateescape), or a JSON
# "\ud800". Each becomes U+FFFD, as a bad byte does where a stream is decoded with errors="replace".
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD, so that it encodes, prints and goes into JSON."""
    return _LONE_SURROGATE.sub("\ufffd", text)


# SentencePiece splits a list on a thread pool it starts for the call, which costs far more than splitting one
# sentence, and far more again on cores a search keeps busy (serve's case). Below about 64 sentences the pool
# does not pay even on idle cores: those go one by one.
POOL_FROM = 64


def split_texts(sp: spm.SentencePieceProcessor, texts: list[str], out_type: type) -> list[list]:
    """`texts` (valid_text already) split by `sp` into ids (out_type int) or pieces (str): many on every core, a
    few (a serve request's) in this thread."""
    if len(texts) < POOL_FROM:
        return [sp.encode(text, out_type=out_type) for text in texts]
    return sp.encode(texts, out_type=out_type, num_threads=os.cpu_count() or 1)


class Vocab:
    """A SentencePiece model whose special ids are the ones above (OURS), for both sides."""

    specials = OURS

    def __init__(self, model_proto: bytes):
        self.proto = model_proto
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(model_proto)
        except Exception as e:  # sentencepiece raises bare RuntimeError/OSError
            raise UserError(f"not a valid SentencePiece model ({e})") from None
        specials = (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id())
        if specials != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise UserError(
                f"SentencePiece model has special ids pad/unk/bos/eos = {specials}, "
                f"expected {(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}"
            )

    @classmethod
    def load(cls, path: str | Path) -> Vocab:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"no SentencePiece model at {path}")
        try:
            return cls(path.read_bytes())
        except UserError as e:
            raise UserError(f"vocab: {path}: {e}; delete it, and `transformer train` trains a new one") from None

    def check_reuse(self, path: str | Path, vocab_size: int) -> Vocab:
        """A stored SentencePiece model must not be larger than data.vocab_size; smaller may be the corpus's limit."""
        if len(self) > vocab_size:
            raise UserError(
                f"vocab: {path} has {len(self)} pieces but data.vocab_size is {vocab_size}; delete it "
                f"to train a new vocabulary, or set data.vocab_size to {len(self)}"
            )
        if len(self) < vocab_size:
            log.warning(
                "vocab: %s has %d pieces, fewer than data.vocab_size %d: the most this corpus gives, or "
                "the size of an earlier data.vocab_size (then delete it to train one of the new size)",
                path,
                len(self),
                vocab_size,
            )
        return self

    def save(self, path: str | Path) -> None:
        atomic_write(path, lambda f: f.write(self.proto))

    def with_pieces(self, pieces: Sequence[str]) -> Vocab:
        """This vocabulary with `pieces` it lacks appended as pieces kept whole wherever they occur in a text
        (SentencePiece's user-defined pieces, numbered after every piece it has): a corpus's tag in a vocabulary
        taken from a run that had none. Itself when it has them all."""
        missing = [p for p in dict.fromkeys(pieces) if self.sp.piece_to_id(p) == UNK_ID and p != "<unk>"]
        if not missing:
            return self
        from sentencepiece import sentencepiece_model_pb2

        model = sentencepiece_model_pb2.ModelProto()
        model.ParseFromString(self.proto)
        for piece in missing:
            model.pieces.add(piece=piece, score=0.0, type=sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED)
        return Vocab(model.SerializeToString())

    @property
    def stored(self) -> bytes:
        """What a checkpoint holds of it: the SentencePiece model's bytes."""
        return self.proto

    @property
    def files(self) -> dict[str, bytes]:
        """What a run directory holds of it: spm.model."""
        return {SPM_FILE: self.proto}

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.proto).hexdigest()

    def __len__(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Sentences split into ids (split_texts: many on every core)."""
        texts = list(texts)
        if len(texts) < POOL_FROM:
            return split_texts(self.sp, [valid_text(t) for t in texts], int)
        try:
            return split_texts(self.sp, texts, int)
        except TypeError:  # a str that UTF-8 cannot encode; retried only then, so files pay nothing for it
            return split_texts(self.sp, [valid_text(t) for t in texts], int)

    def encode_target(self, texts: Sequence[str]) -> list[list[int]]:
        """Target sentences: one joint model splits both sides alike."""
        return self.encode(texts)

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        return [self.sp.decode([int(i) for i in seq if i not in _NOT_TEXT]) for seq in ids]

    def pieces(self, ids: Sequence[int]) -> list[str]:
        table = self._tables[0]
        return [table[int(i)] for i in ids]

    def piece_ids(self, pieces: Sequence[str]) -> list[int]:
        """The inverse of pieces(): for engines that speak in pieces (CTranslate2)."""
        table, unk = self._tables[1], self.sp.unk_id()
        return [table.get(p, unk) for p in pieces]

    @functools.cached_property
    def _tables(self) -> tuple[list[str], dict[str, int]]:
        """(piece by id, id by piece): a CTranslate2 engine converts every source and output, and a call into
        SentencePiece per piece showed in its profile at full batches."""
        by_id = [self.sp.id_to_piece(i) for i in range(len(self))]
        return by_id, {piece: i for i, piece in enumerate(by_id)}


SPM_FILE = RunDir.VOCAB  # our vocabulary's one file
# What MarianTokenizer.save_pretrained writes and an imported vocabulary keeps, verbatim.
MARIAN_FILES = RunDir.MARIAN_VOCAB
SOURCE_SPM, TARGET_SPM, VOCAB_JSON, TOKENIZER_CONFIG = MARIAN_FILES
# The most each file may hold when it is read from a directory: OPUS-MT's SentencePiece models are under 1 MB.
MARIAN_FILE_LIMITS = {SOURCE_SPM: 64 << 20, TARGET_SPM: 64 << 20, VOCAB_JSON: JSON_LIMIT, TOKENIZER_CONFIG: JSON_LIMIT}
SPIECE_UNDERLINE = "\u2581"


def _special_token(config: dict, key: str, default: str) -> str:
    """A special token's text in tokenizer_config.json: a string, or an AddedToken written as {"content": ...}."""
    value = config.get(key) or default
    return str(value.get("content", default)) if isinstance(value, dict) else str(value)


def _sentencepiece(data: bytes, name: str) -> spm.SentencePieceProcessor:
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(data)
    except Exception as e:  # sentencepiece raises bare RuntimeError/OSError
        raise UserError(f"Marian vocabulary: {name} is not a valid SentencePiece model ({e})") from None
    return sp


class MarianVocab:
    """A Marian vocabulary, read as transformers' MarianTokenizer reads it: sources split by source.spm, targets by
    target.spm, every piece numbered by vocab.json (SentencePiece's own ids are not used; a piece vocab.json lacks is
    <unk>); a language code such as >>fra<< that starts a sentence is one piece, kept whole. Its special ids are
    vocab.json's: </s> (0 in OPUS-MT), <unk> (1) and <pad> (the last), which is also the decoder's first input
    (Marian's decoder_start_token_id) unless `start` names another piece (a model of ours exported to Marian's
    format starts from its <s>). Decoding leaves out every special piece, as MarianTokenizer's
    decode(skip_special_tokens=True) does, and joins the rest with target.spm. One vocabulary for both sides only:
    a tokenizer with separate_vocabs (its own target_vocab.json) is refused."""

    def __init__(self, files: dict[str, bytes], start: str | None = None):
        missing = [name for name in MARIAN_FILES if name not in files]
        if missing:
            raise UserError(f"Marian vocabulary: {', '.join(missing)} missing")
        self.files = {name: bytes(files[name]) for name in MARIAN_FILES}
        self.source = _sentencepiece(self.files[SOURCE_SPM], SOURCE_SPM)
        self.target = _sentencepiece(self.files[TARGET_SPM], TARGET_SPM)
        try:
            config = json.loads(self.files[TOKENIZER_CONFIG].decode("utf-8"))
            vocab = json.loads(self.files[VOCAB_JSON].decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise UserError(f"Marian vocabulary: tokenizer_config.json or vocab.json is not JSON ({e})") from None
        if not isinstance(config, dict) or not isinstance(vocab, dict):
            raise UserError("Marian vocabulary: tokenizer_config.json and vocab.json must each hold a JSON object")
        if config.get("separate_vocabs"):
            raise UserError(
                "Marian vocabulary: separate_vocabs is true (a target vocabulary of its own, target_vocab.json): "
                "not supported, only models whose source and target share vocab.json"
            )
        ids = sorted(vocab.values()) if all(type(i) is int for i in vocab.values()) else None
        if ids != list(range(len(vocab))):
            raise UserError("Marian vocabulary: vocab.json must number its pieces 0, 1, ... without gaps")
        self.piece_to_id: dict[str, int] = vocab
        self.id_to_piece = [""] * len(vocab)
        for piece, i in vocab.items():
            self.id_to_piece[i] = piece
        tokens = {
            key: _special_token(config, key, d)
            for key, d in (("unk_token", "<unk>"), ("eos_token", "</s>"), ("pad_token", "<pad>"))
        }
        absent = [t for t in tokens.values() if t not in vocab]
        if absent:
            raise UserError(f"Marian vocabulary: vocab.json lacks the special pieces {', '.join(absent)}")
        if start is not None and start not in vocab:
            raise UserError(f"Marian vocabulary: the decoder's start piece {start!r} is not in vocab.json")
        self.start = start
        pad = vocab[tokens["pad_token"]]
        bos = pad if start is None else vocab[start]
        self.specials = Specials(pad=pad, unk=vocab[tokens["unk_token"]], bos=bos, eos=vocab[tokens["eos_token"]])
        self._not_text = frozenset((self.specials.pad, self.specials.unk, self.specials.eos, bos))
        self.source_lang, self.target_lang = config.get("source_lang"), config.get("target_lang")

    @classmethod
    def load(cls, directory: str | Path) -> MarianVocab:
        directory = Path(directory)
        missing = [name for name in MARIAN_FILES if not (directory / name).exists()]
        if missing:
            raise UserError(f"Marian vocabulary: {directory} has no {', '.join(missing)}")
        return cls(
            {
                name: read_regular(directory / name, MARIAN_FILE_LIMITS[name], "Marian vocabulary")
                for name in MARIAN_FILES
            }
        )

    @property
    def stored(self) -> dict:
        """What a checkpoint holds of it: its four files, verbatim (and the decoder's start piece, where not <pad>)."""
        return {"kind": "marian", "files": dict(self.files), **({"start": self.start} if self.start else {})}

    @property
    def sha256(self) -> str:
        digest = hashlib.sha256()
        for name in MARIAN_FILES:
            digest.update(hashlib.sha256(self.files[name]).digest())
        if self.start:
            digest.update(self.start.encode("utf-8"))
        return digest.hexdigest()

    def __len__(self) -> int:
        return len(self.id_to_piece)

    @staticmethod
    def _language_code(text: str) -> tuple[list[str], str]:
        """MarianTokenizer.remove_language_code: a leading >>xx<< as one piece, and the text after it."""
        end = text.find("<<") if text.startswith(">>") else -1
        return ([text[: end + 2]], text[end + 2 :]) if end != -1 else ([], text)

    def _encode(self, sp: spm.SentencePieceProcessor, texts: Sequence[str]) -> list[list[int]]:
        split = [self._language_code(valid_text(t)) for t in texts]
        pieces = split_texts(sp, [rest for _, rest in split], str)
        unk, lookup = self.specials.unk, self.piece_to_id
        return [[lookup.get(p, unk) for p in code + found] for (code, _), found in zip(split, pieces)]

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Source sentences, split by source.spm."""
        return self._encode(self.source, texts)

    def encode_target(self, texts: Sequence[str]) -> list[list[int]]:
        """Target sentences, split by target.spm."""
        return self._encode(self.target, texts)

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        out = []
        for seq in ids:
            pieces = [self.id_to_piece[int(i)] for i in seq if int(i) not in self._not_text]
            out.append(self.target.decode_pieces(pieces).replace(SPIECE_UNDERLINE, " ").strip())
        return out

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.id_to_piece[int(i)] for i in ids]

    def piece_ids(self, pieces: Sequence[str]) -> list[int]:
        return [self.piece_to_id.get(p, self.specials.unk) for p in pieces]


AnyVocab = Vocab | MarianVocab


def vocab_from_stored(stored: bytes | dict) -> AnyVocab:
    """The vocabulary a checkpoint holds: our SentencePiece model's bytes, or a Marian vocabulary's files."""
    if isinstance(stored, dict):
        if stored.get("kind") != "marian" or not isinstance(stored.get("files"), dict):
            raise UserError(f"checkpoint: a vocabulary of unknown kind {stored.get('kind')!r}")
        return MarianVocab(stored["files"], stored.get("start"))
    return Vocab(stored)


def vocab_in(directory: str | Path) -> AnyVocab | None:
    """The vocabulary a run directory holds (spm.model, or a Marian vocabulary's files), or None."""
    directory = Path(directory)
    if (directory / SPM_FILE).is_file():
        return Vocab.load(directory / SPM_FILE)
    if all((directory / name).is_file() for name in MARIAN_FILES):
        return MarianVocab.load(directory)
    return None


def run_vocab(directory: str | Path) -> AnyVocab:
    """vocab_in(directory), or the error that names the SentencePiece model it lacks."""
    found = vocab_in(directory)
    return found if found is not None else Vocab.load(Path(directory) / SPM_FILE)


def save_vocab_files(vocab: AnyVocab, directory: str | Path) -> None:
    """The vocabulary's files into a directory (each atomically)."""
    for name, data in vocab.files.items():
        atomic_write(Path(directory) / name, lambda f, data=data: f.write(data))


def sample_sentences(sentences: Iterable[str], k: int, seed: int) -> list[str]:
    """A uniform sample of `k` of `sentences` in one pass with `k` of them in memory (reservoir sampling,
    Algorithm R), the same for the same seed; all of them, in order, when there are no more than `k`."""
    rng = random.Random(seed)
    sample: list[str] = []
    for i, sentence in enumerate(sentences):
        if i < k:
            sample.append(sentence)
        else:
            j = rng.randrange(i + 1)  # sentence i is kept with probability k / (i + 1)
            if j < k:
                sample[j] = sentence
    return sample


def train_vocab(
    sentences: Iterable[str],
    vocab_size: int,
    model_type: str = "bpe",
    character_coverage: float = 1.0,
    max_sentences: int = 2_000_000,
    seed: int = 1,
    reserved: Sequence[str] = (),
) -> Vocab:
    """Train a joint SentencePiece model on `sentences` (both languages mixed), or on a sample of `max_sentences`
    of them (0: all) drawn with `seed`. `reserved`: pieces kept whole wherever they occur in a text (corpus tags),
    numbered right after the special ids; none, as every model before them had."""
    model = io.BytesIO()
    sentences = (s for s in sentences if s.strip())
    first = next(sentences, None)
    if first is None:  # SentencePiece would fail with an INTERNAL error that names nothing
        raise UserError(
            "vocab: every training sentence is blank (or only spaces): there is no text to train a "
            "SentencePiece model on; check the training split's files (data.dir, data.train_split)"
        )
    sentences = itertools.chain([first], sentences)
    if max_sentences:
        # Sampled here: SentencePiece's own sample (input_sentence_size) differs from one process to the next
        # whatever set_random_generator_seed says (0.2.3), so one config gave another vocabulary each run.
        sentences = iter(sample_sentences(sentences, max_sentences, seed))
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences,
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            # Given at most max_sentences, SentencePiece samples nothing; with these two as they were, a corpus
            # below the limit (Multi30k) gets the vocabulary it always had.
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            # Words of any length, and a vocabulary that fits small corpora.
            max_sentence_length=1 << 16,
            hard_vocab_limit=False,
            **({"user_defined_symbols": list(reserved)} if reserved else {}),
            minloglevel=2,
            num_threads=os.cpu_count() or 1,
        )
    except (RuntimeError, ValueError) as e:
        raise UserError(f"SentencePiece training failed: {e}") from None
    vocab = Vocab(model.getvalue())
    if len(vocab) < vocab_size:  # hard_vocab_limit=False: a small corpus gives fewer pieces, not an error
        log.warning(
            "vocab: the training data gives only %d pieces, fewer than data.vocab_size %d; the vocabulary "
            "has %d (data.vocab_size is an upper bound)",
            len(vocab),
            vocab_size,
            len(vocab),
        )
    return vocab
