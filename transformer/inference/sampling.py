"""Sampling instead of search (`--sample topk:K|topp:P`, `--temperature`, `--seed`): each output token drawn from
the model's distribution at a temperature, cut to its K most probable tokens or to the fewest whose probabilities
add up to P (nucleus sampling), N samples per source. Back-translation with sampled outputs trains better models
than with beam outputs (Edunov et al., 2018).

What it guarantees:
- A sample is drawn token by token from that distribution until its first EOS; at the length limit EOS is
  forced whatever was drawn (search.greedy_search), so a sample that reaches it is cut there and none runs past
  model.max_positions. There is no stop rule to apply.
- Its score is the model's own, as beam search reports it (temperature 1, nothing cut): summed log-probabilities
  over the length penalty; a source's samples are listed best first.
- A forced prefix (search.ForcedPrefix) is emitted first; only the tokens after it are drawn.
- top-k 1 is greedy search, run as such: the same tokens and scores, ties and reduced precisions included. A
  temperature -> 0 draws the most probable token (its limit: exact ties share it), a nucleus P -> 0 keeps the
  most probable token alone: so do the smallest T and P, which neither underflow nor go NaN.
- Reproducible: the random numbers come from a counter-based stream, a hash of (seed, the source's ids, the
  sample's number, the step), not from a generator shared by a batch. So a seeded run repeats itself, and a
  sentence's samples do not depend on its batch mates, the batch size or the order of the input (as its
  outputs do not: up to float rounding, which can move a probability across a drawn number in the last bits).
  Two identical source lines get the same samples. In fp32: bf16's numbers depend on the batch's shape, and
  with them the draws, so `--dtype auto` is fp32 when sampling (translator.pick_dtype).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from transformer.config import DecodeConfig
from transformer.inference.search import ForcedPrefix, Hypothesis, SearchResult, device_index, greedy_search
from transformer.inference.settings import SamplingKind, SearchSettings, parse_sample
from transformer.model.transformer import evaluating

_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


@dataclass(frozen=True)
class Sampler:
    """How tokens are drawn: `kind` topk (value K) or topp (value P), at `temperature`, from `seed`."""

    kind: SamplingKind
    value: float
    temperature: float = 1.0
    seed: int = 0

    @staticmethod
    def of(settings: SearchSettings) -> Sampler:
        """How settings.sample, .temperature and .seed draw (no seed: 0; a Translator always gives one)."""
        kind, value = parse_sample(settings.sample)
        return Sampler(kind, value, settings.temperature, settings.seed or 0)

    @property
    def greedy(self) -> bool:
        """top-k 1: always the most probable token, which greedy search's own choice gives (ties included)."""
        return self.kind == "topk" and int(self.value) == 1

    def distribution(self, lprobs: torch.Tensor) -> torch.Tensor:
        """log p (R, V) -> the probabilities tokens are drawn from (R, V): p ** (1 / temperature), cut to the top
        K or the nucleus P, renormalised."""
        logits = lprobs
        if self.temperature != 1:
            # Less the row's maximum first: log p / T overflows to -inf for a small T (log p = -1 at T = 1e-39),
            # and a row all -inf has no distribution (NaN). So the maximum stays at 0, and as T -> 0 the rest go
            # to -inf: the limit, the most probable token (shared among exact ties). Divided in float64: a T
            # below float32's smallest (1.4e-45) would be 0 there, and 0 / 0 NaN.
            shifted = (lprobs - lprobs.max(dim=1, keepdim=True).values).double()
            logits = (shifted / self.temperature).to(lprobs.dtype)
        inf = float("-inf")
        if self.kind == "topk":
            k = min(int(self.value), logits.size(1))
            kth = logits.topk(k, dim=1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, inf)  # ties at the K-th value all stay
        else:
            ranked, order = logits.sort(dim=1, descending=True, stable=True)
            probs = ranked.softmax(dim=1)
            before = probs.cumsum(dim=1) - probs  # the mass of the tokens ranked above each
            cut = before >= self.value
            # The most probable token always stays: the comparison is in float32, where a P below 1.4e-45 is 0.
            cut[:, 0] = False
            ranked = ranked.masked_fill(cut, inf)
            logits = torch.full_like(logits, inf).scatter(1, order, ranked)
        return logits.softmax(dim=1)

    def keys(
        self, sources: Sequence[Sequence[int]], samples: int, seeds: Sequence[int | None] | None = None
    ) -> np.ndarray:
        """One 64-bit stream key per (source, sample), in that order: a hash of the seed, the source's ids and
        the sample's number, so that nothing else (the batch) enters it. `seeds`: per source, a seed of its own
        (None: self.seed), as serve gives each request's sentences theirs."""
        keys = np.empty(len(sources) * samples, dtype=np.uint64)
        for s, ids in enumerate(sources):
            seed = self.seed if seeds is None or seeds[s] is None else seeds[s]
            text = f"{seed}|{','.join(map(str, ids))}|".encode()
            for i in range(samples):
                digest = hashlib.blake2b(text + str(i).encode(), digest_size=8).digest()
                keys[s * samples + i] = np.frombuffer(digest, dtype=np.uint64)[0]
        return keys


def uniforms(keys: np.ndarray, step: int) -> np.ndarray:
    """Per key, a number in [0, 1) for decoder step `step`: splitmix64 of key + (step + 1) x its increment, its top
    53 bits (a float64 holds them exactly)."""
    # Array arithmetic on uint64 wraps around, as splitmix64 means it to (a scalar's would warn: reduced here).
    x = keys + np.uint64((step + 1) * _GOLDEN % 2**64)
    x = (x ^ (x >> np.uint64(30))) * _MIX[0]
    x = (x ^ (x >> np.uint64(27))) * _MIX[1]
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: per row the token whose cumulative probability interval holds u x the row's total
    (float64, so that rounding never lands on a token of probability 0, and no renormalising is needed)."""
    cum = probs.double().cumsum(dim=1)  # (R, V)
    token = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True).squeeze(1)
    token = token.clamp(max=probs.size(1) - 1)
    # u x total can round up to the total (once in 2**53): then the last token of non-zero probability.
    zero = probs.gather(1, token[:, None]).squeeze(1) <= 0
    return torch.where(zero, (cum < cum[:, -1:]).sum(dim=1).clamp(max=probs.size(1) - 1), token)


def sample_search(
    model,
    src: torch.Tensor,
    settings: SearchSettings,
    prefixes: Sequence[Sequence[int]] | None = None,
    seeds: Sequence[int | None] | None = None,
) -> SearchResult:
    """settings.nbest samples for each source row of `src` (B, S), drawn as settings.sample, .temperature and .seed
    say (module docstring), best first; SearchResult's steps count the decoder calls, and a row's sentence_steps
    those of its longest sample. `seeds`: per row, a seed of its own (None: settings.seed)."""
    rows, samples, sampler = src.size(0), settings.nbest, Sampler.of(settings)
    # A sample has no stop rule: the EOS forced at the length limit keeps its log-probability (not "hf"'s 0).
    settings = replace(settings, stop=DecodeConfig.stop)
    if sampler.greedy:  # every sample of a source is its greedy output: searched once, by greedy search itself
        with evaluating(model):
            found = greedy_search(model, src, settings, forced=ForcedPrefix.of(prefixes, src))
        hypotheses = [[replace(h) for _ in range(samples)] for h in found.best()]
        return SearchResult(hypotheses, found.steps, found.sentence_steps)
    sources = [[t for t in row if t != model.specials.pad] for row in src.tolist()]
    keys = sampler.keys(sources, samples, seeds)
    if samples > 1:  # one row per sample: row b*samples + i is source b's i-th
        src = src.index_select(0, device_index([b for b in range(rows) for _ in range(samples)], src.device))
        prefixes = None if prefixes is None else [p for p in prefixes for _ in range(samples)]

    def pick(lprobs: torch.Tensor, t: int, alive: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        u = torch.from_numpy(uniforms(keys[alive], t))
        if lprobs.device.type != "cpu":  # from pinned memory without waiting for the GPU (search.device_index)
            u = u.pin_memory().to(lprobs.device, non_blocking=True)
        token = draw(sampler.distribution(lprobs), u)
        return lprobs.gather(1, token[:, None]).squeeze(1), token

    forced = ForcedPrefix.of(prefixes, src)
    with evaluating(model):
        found = greedy_search(model, src, settings, forced=forced, pick=pick)
    hypotheses: list[list[Hypothesis]] = []
    sentence_steps = []
    for b in range(rows):
        drawn = [h[0] for h in found.hypotheses[b * samples : (b + 1) * samples]]
        hypotheses.append(sorted(drawn, key=lambda h: h.score, reverse=True))
        sentence_steps.append(max(found.sentence_steps[b * samples : (b + 1) * samples]))
    return SearchResult(hypotheses, found.steps, sentence_steps)
