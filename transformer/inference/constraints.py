"""Terminology constraints (`--constraints-file`): beam search whose outputs must contain given target phrases,
batched over sentences and beams like search.py's, with dynamic beam allocation (Post & Vilar, 2018) in the
vectorised form of Hu et al. (2019), as Sockeye and fairseq have it.

Each hypothesis carries its progress: the phrases it holds already (a phrase counts once its pieces appear in a
row, anywhere in the hypothesis, the forced prefix included) and the longest start of a missing phrase it ends
with. Its bank is the number of constraint pieces that makes (met phrases' pieces + that partial match). At each
step, a sentence's candidates are each live hypothesis's 2*beam most probable next tokens (as in search.py) and
also every token that would advance a missing phrase, however improbable; EOS is allowed only to a hypothesis
that holds every phrase. Then:
- an EOS candidate finishes when it ranks within the top `beam` candidates of the top bank (every phrase held) by
  summed log-probability; in a sentence without constraints the top bank is every candidate, which is
  search.py's rule;
- the `beam` live hypotheses are the non-EOS candidates taken bank by bank in turn, best first, the fullest bank
  first within a turn (Hu et al.'s allocation): every bank keeps about beam / (banks) of the beam while it has
  candidates, and what a bank cannot fill goes to the others.

Stop rules, with their guarantees: "exact" stops a sentence once no live hypothesis can reach the nbest-th
finished score (search.py's bound, which holds for any live hypothesis, whatever its bank), so the n-best list is
the one this constrained beam would hold at the length limit: the best-scoring hypotheses that hold every phrase
among those the beam kept, not the best-scoring constrained translation of all (no beam search promises that).
"early" stops once `beam` have finished. Every hypothesis returned holds every phrase, piece for piece.

A sentence none of whose hypotheses held every phrase by its length limit (a phrase longer than the limit, or
phrases the beam could not fit) comes back with no hypotheses: the caller (translator.py) warns and gives the
best unconstrained translation instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from transformer.inference.search import (
    ForcedPrefix,
    Hypothesis,
    SearchResult,
    Sentences,
    device_index,
    device_tensor,
    new_decoder,
    next_log_probs,
    penalty,
    to_host,
)
from transformer.inference.settings import SearchSettings
from transformer.model.transformer import evaluating


class Progress(NamedTuple):
    """A hypothesis's progress through its sentence's phrases."""

    met: frozenset[int]  # the phrases it holds
    tail: tuple[int, ...]  # its last pieces, as many as its longest partial match of a missing phrase
    bank: int  # constraint pieces held: the met phrases' and the partial match's

    def complete(self, phrases: Phrases) -> bool:
        return len(self.met) == len(phrases.phrases)


class Phrases:
    """One sentence's constraints as piece ids: each phrase once, empty ones dropped."""

    def __init__(self, phrases: Sequence[Sequence[int]]):
        unique = dict.fromkeys(tuple(p) for p in phrases if len(p))
        self.phrases: tuple[tuple[int, ...], ...] = tuple(unique)
        self.pieces = sum(len(p) for p in self.phrases)  # the top bank
        self.tokens = frozenset(t for p in self.phrases for t in p)
        self.longest = max((len(p) for p in self.phrases), default=0)

    def start(self) -> Progress:
        return Progress(frozenset(), (), 0)

    def advance(self, progress: Progress, token: int) -> Progress:
        """The progress of a hypothesis that adds `token`."""
        if token not in self.tokens:  # the common case: any partial match is broken
            if not progress.tail:
                return progress
            return Progress(progress.met, (), progress.bank - len(progress.tail))
        tail = (*progress.tail, token)
        met = progress.met | {
            i
            for i, phrase in enumerate(self.phrases)
            if i not in progress.met and len(phrase) <= len(tail) and tail[-len(phrase) :] == phrase
        }
        partial = 0
        for i, phrase in enumerate(self.phrases):
            if i in met:
                continue
            for length in range(min(len(phrase) - 1, len(tail)), partial, -1):
                if tail[-length:] == phrase[:length]:
                    partial = length
                    break
        held = sum(len(self.phrases[i]) for i in met)
        return Progress(met, tail[len(tail) - partial :] if partial else (), held + partial)

    def next_tokens(self, progress: Progress) -> set[int]:
        """The tokens that would advance a missing phrase: each one's first piece, and the piece after each
        partial match the hypothesis ends with."""
        wanted = set()
        for i, phrase in enumerate(self.phrases):
            if i in progress.met:
                continue
            wanted.add(phrase[0])
            tail = progress.tail
            for length in range(1, min(len(phrase) - 1, len(tail)) + 1):
                if tail[-length:] == phrase[:length]:
                    wanted.add(phrase[length])
        return wanted


def constrained_search(
    model,
    src: torch.Tensor,
    constraints: Sequence[Sequence[Sequence[int]]],
    settings: SearchSettings,
    prefixes: Sequence[Sequence[int]] | None = None,
) -> SearchResult:
    """Per source row of `src` (B, S), its settings.nbest best hypotheses that contain every phrase of its
    constraints (lists of piece ids), best first; an empty list where none did (module docstring)."""
    if not 1 <= settings.nbest <= settings.beam:
        raise ValueError(f"need 1 <= nbest <= beam, got beam={settings.beam}, nbest={settings.nbest}")
    if len(constraints) != src.size(0):
        raise ValueError(f"{len(constraints)} constraint lists for {src.size(0)} source rows")
    forced = ForcedPrefix.of(prefixes, src)
    with evaluating(model):
        return _ConstrainedBeam(model, src, [Phrases(c) for c in constraints], settings).run(forced)


class _Candidate(NamedTuple):
    score: float  # summed log-probability
    row: int  # the beam row it extends, within its sentence
    token: int
    progress: Progress


class _ConstrainedBeam:
    def __init__(self, model, src, phrases: list[Phrases], settings: SearchSettings):
        self.model, self.src, self.phrases = model, src, phrases
        self.k, self.settings, self.stop = settings.beam, settings, settings.stop
        self.bos, self.eos, self.pad = model.specials.bos, model.specials.eos, model.specials.pad

    def run(self, forced: ForcedPrefix | None) -> SearchResult:
        model, src, k, device = self.model, self.src, self.k, self.src.device

        # A shortlist keeps each sentence's constraints' and forced prefix's pieces among its candidates.
        def also() -> torch.Tensor:
            needed = [sorted(p.tokens) for p in self.phrases]
            ids = torch.full((len(needed), max(map(len, needed), default=0)), -1, dtype=torch.long)
            for row, tokens in enumerate(needed):
                ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            return ids if forced is None else torch.cat([ids, forced.ids().cpu()], dim=1)

        decoder = new_decoder(model, src, True, also)
        sentences = Sentences.start(model, src, self.settings, forced)
        alive, finished = sentences.alive, sentences.finished
        progress = [[self.phrases[s].start()] for s in alive]  # per live sentence, per row
        n = 1
        prefix = torch.full((src.size(0), 1), self.bos, dtype=torch.long, device=device)
        scores = torch.zeros(src.size(0), device=device)
        t = 0
        while alive:
            lprobs = next_log_probs(decoder, prefix, t, self.settings, sentences.at_limit(t, n), forced, n)
            lprobs = decoder.widen(lprobs)  # phrases are ranked by their ids
            # EOS only for a hypothesis that holds every phrase.
            unfinishable = [
                s * n + j
                for s, rows in enumerate(progress)
                for j, p in enumerate(rows)
                if not p.complete(self.phrases[alive[s]])
            ]
            if unfinishable:
                lprobs[device_index(unfinishable, device), self.eos] = float("-inf")
            per_row = min(2 * k, lprobs.size(1))
            top_lprobs, top_tokens = lprobs.topk(per_row, dim=1)
            wanted_rows, wanted_tokens = [], []
            for s, rows in enumerate(progress):
                for j, p in enumerate(rows):
                    for token in sorted(self.phrases[alive[s]].next_tokens(p)):
                        wanted_rows.append(s * n + j)
                        wanted_tokens.append(token)
            wanted = lprobs[device_index(wanted_rows, device), device_index(wanted_tokens, device)]
            host_lprobs, host_tokens, host_wanted, host_scores, host_prefix = to_host(
                top_lprobs, top_tokens, wanted, scores, prefix
            )
            extra: dict[int, list[tuple[int, float]]] = {}
            for row, token, value in zip(wanted_rows, wanted_tokens, host_wanted.tolist()):
                extra.setdefault(row, []).append((token, value))

            parents, tokens, new_scores, new_progress, best_live = [], [], [], [], []
            divisor = penalty(self.settings, t + 1)
            for s, index in enumerate(alive):
                rows = range(s * n, s * n + n)
                candidates = self._candidates(s, index, rows, progress[s], host_lprobs, host_tokens, host_scores, extra)
                for c in self._finishing(candidates, index):
                    if self.stop == "early" and len(finished[index]) >= k:
                        break
                    finished[index].append(Hypothesis(host_prefix[s * n + c.row, 1:].tolist(), c.score / divisor))
                kept = self._allocate([c for c in candidates if c.token != self.eos])
                best_live.append(kept[0].score if kept else float("-inf"))
                kept += [_Candidate(float("-inf"), 0, self.pad, self.phrases[index].start())] * (k - len(kept))
                parents.append([s * n + c.row for c in kept])
                tokens.append([c.token for c in kept])
                new_scores.append([c.score for c in kept])
                new_progress.append([c.progress for c in kept])

            keep = sentences.searching(best_live, t)
            if not keep:
                break
            keep_t = sentences.keep(keep, forced)
            alive = sentences.alive
            index = device_index([r for s in keep for r in parents[s]], device)
            new_token = device_tensor([x for s in keep for x in tokens[s]], device)
            scores = device_tensor([x for s in keep for x in new_scores[s]], device, torch.float32)
            progress = [new_progress[s] for s in keep]
            prefix = torch.cat([prefix.index_select(0, index), new_token[:, None]], dim=1)
            decoder.keep_rows(index, keep_t)
            n = k
            t += 1
        return SearchResult(finished, decoder.steps, sentences.sentence_steps)

    def _candidates(self, s, index, rows, progress, host_lprobs, host_tokens, host_scores, extra) -> list[_Candidate]:
        """A sentence's candidates, best first (ties: the earlier row and rank), each with its progress."""
        phrases = self.phrases[index]
        found = []
        for j, row in enumerate(rows):
            base = np.float32(host_scores[row])
            if base == float("-inf"):
                continue
            seen = set()
            pairs = list(zip(host_tokens[row].tolist(), (base + host_lprobs[row]).tolist()))
            pairs += [(token, float(base + np.float32(value))) for token, value in extra.get(row, ())]
            for token, score in pairs:
                if score == float("-inf") or token in seen:
                    continue
                seen.add(token)
                advanced = progress[j] if token == self.eos else phrases.advance(progress[j], token)
                found.append(_Candidate(score, j, token, advanced))
        found.sort(key=lambda c: c.score, reverse=True)  # stable: ties keep row and rank order
        return found

    def _finishing(self, candidates: list[_Candidate], index: int) -> list[_Candidate]:
        """The EOS candidates that rank within the top `beam` of the top bank (every phrase held)."""
        top = self.phrases[index].pieces
        in_top_bank = [c for c in candidates if c.progress.bank == top][: self.k]
        return [c for c in in_top_bank if c.token == self.eos]

    def _allocate(self, candidates: list[_Candidate]) -> list[_Candidate]:
        """The `beam` live hypotheses: best first within each bank, the banks taken in turn, fullest first."""
        rank_in_bank: dict[int, int] = {}
        ranked = []
        for position, c in enumerate(candidates):
            rank = rank_in_bank.get(c.progress.bank, 0)
            rank_in_bank[c.progress.bank] = rank + 1
            ranked.append((rank, -c.progress.bank, position))
        chosen = sorted(ranked)[: self.k]
        return sorted((candidates[position] for _, _, position in chosen), key=lambda c: c.score, reverse=True)
