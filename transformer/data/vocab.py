"""The joint SentencePiece vocabulary: special-token ids, training, loading, encoding and decoding."""

from __future__ import annotations

import io
import itertools
import logging
import os
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm

from transformer.errors import UserError
from transformer.files import atomic_write

# The special ids, fixed for every model this package trains.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

log = logging.getLogger("transformer")

_NOT_TEXT = frozenset((PAD_ID, BOS_ID, EOS_ID))
# Not Unicode text: what Python makes of a command-line byte that is not UTF-8 (surrogateescape), or a JSON
# "\ud800". Each becomes U+FFFD, as a bad byte does where a stream is decoded with errors="replace".
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD, so that it encodes, prints and goes into JSON."""
    return _LONE_SURROGATE.sub("\ufffd", text)


class Vocab:
    """A SentencePiece model whose special ids are the ones above."""

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

    def __len__(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Many sentences at once, on every core (SentencePiece's own thread pool)."""
        texts = list(texts)
        try:
            return self.sp.encode(texts, out_type=int, num_threads=os.cpu_count() or 1)
        except TypeError:  # a str that UTF-8 cannot encode; retried only then, so files pay nothing for it
            return self.sp.encode([valid_text(t) for t in texts], out_type=int, num_threads=os.cpu_count() or 1)

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        return [self.sp.decode([int(i) for i in seq if i not in _NOT_TEXT]) for seq in ids]

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.sp.id_to_piece(int(i)) for i in ids]

    def piece_ids(self, pieces: Sequence[str]) -> list[int]:
        """The inverse of pieces(): for engines that speak in pieces (CTranslate2)."""
        return [self.sp.piece_to_id(p) for p in pieces]


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
) -> Vocab:
    """Train a joint SentencePiece model on `sentences` (both languages mixed), or on a sample of `max_sentences`
    of them (0: all) drawn with `seed`."""
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
