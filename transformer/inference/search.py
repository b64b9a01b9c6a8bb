"""Search over a trained Transformer: one `search()` entry for greedy (beam 1) and beam search, batched over
sentences and beams with a KV cache, with a choice of stop rule; n-best hypotheses with scores.

Conventions:
- `src` is (B, S) source ids as the model was trained on them (subwords + EOS, right-padded with PAD:
  batch.prepare_sources builds it); its mask comes from `padding_mask`, the only source-mask builder.
- A sentence's output may hold at most max_len = src_len + max_len_offset tokens, where src_len counts
  its non-PAD source positions (EOS included), capped so decoder positions stay below max_positions.
  At that length EOS is forced, so every hypothesis ends with EOS.
- `Hypothesis.tokens` excludes BOS and EOS; `score` is the sum of the token log-probabilities, EOS
  included, divided by the length penalty lp(len) (GNMT's ((5 + len) / 6) ** lenpen unless lenpen_kind
  says otherwise) with len = tokens + 1.

Stop rules (beam > 1; `stop`):
- "exact": a sentence stops when no live hypothesis can still reach a score above its nbest-th finished
  one, so the n-best list is the one the beam would hold if it ran to the length limit. A live hypothesis
  with summed log-probability s < 0 can only add log-probabilities <= 0, and lp grows with the length
  (lenpen >= 0), so the best normalised score it can reach is s / lp(max_len + 1): dividing a negative sum
  by the largest penalty it can get. That bound is attained when every further token has probability ~1
  and EOS comes at the limit, so without a bound on the model's probabilities no tighter exact rule
  exists. (Hugging Face's `early_stopping=False` divides by lp at the *current* length instead: with
  lenpen > 0 that is smaller than the reachable best, so it stops early and is not exact.) With lenpen 0
  the bound is s itself, so a sentence stops as soon as its nbest-th finished score beats the best live
  sum: CTranslate2's early exit without a length penalty.
- "early": fairseq's rule: a sentence is done once `beam` hypotheses have finished, and its n-best list is
  drawn from the first `beam` to finish: earlier steps first, and within the step that reaches the count
  the better summed scores first (at one step they have one length, so that is also the better normalised
  score); the others finishing at that step are dropped, as fairseq drops them. May miss a longer
  hypothesis that would have scored higher. CTranslate2 (patience 1, with a length penalty) stops at the
  same step but keeps every hypothesis finished there, up to 2*beam-1. The exact bound ends a sentence
  too when it is met first (common with lenpen 0, where it needs only the best candidate to be EOS):
  whatever the beam would still finish scores at most the bound, at most the nbest-th kept score, so it
  could not enter the n-best ahead of a hypothesis kept already (a tie keeps the earlier one, as a stable
  sort does); the outputs are fairseq's and the steps never more than either rule's alone.
- "hf": transformers' generate() with its default early_stopping=False: a sentence stops once `beam`
  hypotheses have finished and the `beam`-th best of them scores at least the best live summed
  log-probability divided by the penalty at the live hypotheses' *current* length (a heuristic: with
  lenpen > 0 a live hypothesis may still reach more, see "exact"). The EOS forced at the length limit
  counts 0 there, as generate's ForcedEOSTokenLogitsProcessor makes it, where the other rules keep its
  log-probability. With lenpen_kind "length" (generate's length ** lenpen) and the same length limit, the
  outputs are generate()'s (tests/inference/test_hf_import.py); generate's renormalize_logits (OPUS-MT's
  generation_config sets it) rescales each step's log-probabilities by 1 - p(<pad>), which this search does
  not (docs/opus-mt.md).
Greedy search (beam 1) ends a sentence at its first EOS under every rule: with one hypothesis the first
to finish is the answer, as the early rule says.

Length penalties (`lenpen_kind`): "gnmt", lp(len) = ((5 + len) / 6) ** lenpen (Wu et al. 2016, the default);
"length", lp(len) = len ** lenpen (transformers' and CTranslate2's length_penalty). Both grow with the length
for lenpen >= 0, which is all the exact bound needs.

Every search takes its SearchSettings whole (settings.py): the beam, the length penalty and its form, the stop
rule, the length limit, the n-best; what a step allows (`next_log_probs`: the EOS forced at the limit, no repeated
n-gram, a forced prefix) is applied in one place for greedy, beam, sampling (sampling.py) and constrained
(constraints.py) search.

No repeated n-gram (`no_repeat_ngram_size` N > 0; fairseq's, CTranslate2's and transformers' option of that name): a
token that would end an N-gram the hypothesis holds already gets log-probability -inf, so no N-gram occurs twice in
an output. EOS is never banned (no N-gram before it holds it), nor a forced prefix's token: the prefix is kept as
given, and its N-grams count as held for what follows.

Special ids (BOS, EOS, PAD) are the model's vocabulary's (`model.specials`): ours, or an imported Marian
vocabulary's, whose BOS is its PAD.

A forced target prefix (`prefixes`, per source row a list of target ids, possibly empty): until a row's prefix is
emitted, every other token's log-probability is -inf at its steps (ForcedPrefix), so every hypothesis starts with
the prefix and its score is the model's, the prefix's tokens included. Beam search then holds one live hypothesis
per sentence until the prefix ends. The stop rules are unchanged and keep their guarantee: under "exact" the
n-best list is the one the beam would hold at the length limit, among hypotheses that start with the prefix.
A row's output limit is at least its prefix's length (then EOS is forced right after it).

An ensemble (ensemble.Ensemble) searches as one model: each member encodes the source and keeps its own KV
cache, and a step's log-probabilities are the mean of the members' (EnsembleDecoder), each <= 0, so the stop
rules' bound holds as it is; a hypothesis's score is the mean of its members' scores of it.

Tracing (`trace`, a list): search() appends one TraceStep per decoder step, for showing the search at work
(`transformer serve`'s page). It only reads what the search computed; without a trace nothing extra is done.

The host and the device: what the search decides in Python (which hypotheses finish, which sentences stop) it
reads from the device once per decoder step, in one copy (`to_host`); on CUDA every read is a synchronisation
that leaves the GPU idle until the host has queued the next step, and a step used to make four to seven of them.
The length limits live on the host from the start, and row indices go to the device from pinned memory without
waiting. On a CPU the reads are the tensors' own memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from transformer.config import DecodeConfig
from transformer.data.batch import causal_mask, padding_mask
from transformer.inference.ensemble import Ensemble
from transformer.inference.settings import LenpenKind, SearchSettings
from transformer.model.transformer import evaluating


@dataclass
class Hypothesis:
    tokens: list[int]  # output ids without BOS/EOS
    score: float
    # With alignments asked for: per output id, the source position it attends to most (alignment.py).
    alignment: list[int] | None = None


@dataclass
class SearchResult:
    """What search() found: per source row its n-best hypotheses (best first), and the decoder work it took."""

    hypotheses: list[list[Hypothesis]]
    steps: int  # decoder calls for the whole batch (one per output position with the cache)
    sentence_steps: list[int]  # per source row, the decoder steps it took part in
    # Rows whose constraints could not all be met: their hypotheses are unconstrained (batched.run_search).
    unmet: list[int] = field(default_factory=list)

    def best(self) -> list[Hypothesis]:
        return [hyps[0] for hyps in self.hypotheses]


@dataclass
class TraceStep:
    """One decoder step of a traced search, per source row (an empty list for a row with nothing to show)."""

    alive: list[list[Hypothesis]]  # hypotheses that go on after this step, best first; score = summed log-prob
    finished: list[list[Hypothesis]]  # hypotheses that ended with EOS at this step; score as in the n-best lists


def length_penalty(length, alpha: float, kind: LenpenKind = DecodeConfig.lenpen_kind):
    """What a hypothesis's summed log-probability is divided by: GNMT's (Wu et al. 2016) ((5 + length) / 6) ** alpha,
    or with kind "length" length ** alpha (transformers', CTranslate2's); works on floats and tensors."""
    if kind == "length":
        return length**alpha
    return ((5.0 + length) / 6.0) ** alpha


def penalty(settings: SearchSettings, length):
    """The length penalty of `settings` at `length` (floats and tensors)."""
    return length_penalty(length, settings.lenpen, settings.lenpen_kind)


DEFAULTS = SearchSettings()  # config.py's DecodeConfig defaults: beam 4, lenpen 0.6, exact


def search(
    model,
    src: torch.Tensor,
    settings: SearchSettings = DEFAULTS,
    use_cache: bool = True,
    trace: list[TraceStep] | None = None,
    prefixes: Sequence[Sequence[int]] | None = None,
) -> SearchResult:
    """Translate source rows `src` (B, S): per row its settings.nbest best hypotheses, best first.

    beam 1 is greedy search (the most probable token at each step). Beam search ranks 2*beam candidates
    per sentence at each step: the best `beam` that do not end in EOS stay alive, and an EOS candidate
    finishes only when it ranks within the top `beam`. settings.stop picks when a sentence is done (module
    docstring), settings.lenpen and lenpen_kind the length penalty. use_cache=False recomputes every step from
    scratch (for tests). `trace`, when given, receives a TraceStep per decoder step; a sentence has no live
    hypotheses at the step it is done. `prefixes`: per row, target ids its hypotheses must start with (module
    docstring); None or all empty: none. settings.sample is sampling.py's: it is not read here.
    """
    if not 1 <= settings.nbest <= settings.beam:
        raise ValueError(f"need 1 <= nbest <= beam, got beam={settings.beam}, nbest={settings.nbest}")
    forced = ForcedPrefix.of(prefixes, src)
    with evaluating(model):  # dropout off while searching; the trainer decodes mid-training
        if settings.beam == 1:
            return greedy_search(model, src, settings, use_cache, trace, forced)
        return _beam_search(model, src, settings, use_cache, trace, forced)


Also = Callable[[], torch.Tensor] | None  # per source, the ids a shortlist must keep (B, L), -1 padded


def new_decoder(model, src: torch.Tensor, use_cache: bool, also: Also = None) -> Decoder | EnsembleDecoder:
    """The decoder side of a search over `model`: one model's, or an ensemble's. `also`: per source, the target ids
    a shortlist must keep (a forced prefix's, constraints'), made only where the model has one (a device sync)."""
    if isinstance(model, Ensemble):
        return EnsembleDecoder(model, src, use_cache, also)
    return Decoder(model, src, use_cache, also)


class Decoder:
    """The decoder side of a search: the source encoded once, then one step for the newest token of every
    live row; with the cache (which owns the encoder K/V and the memory mask), or from scratch for tests. With a
    shortlist (model.shortlist), each step scores the batch's candidates only, a row's softmax over its source's."""

    def __init__(self, model, src: torch.Tensor, use_cache: bool, also: Also = None):
        src_mask = padding_mask(src, model.specials.pad)
        memory = model.encode(src, src_mask)  # (B, S, C)
        self.model, self.steps, self.eos = model, 0, model.specials.eos
        self.never = sorted({model.specials.pad, model.specials.bos})  # never emitted: not training targets
        self.cache = model.new_cache(memory, src_mask) if use_cache else None
        # Uncached only: the memory and its mask, kept in row order here since no cache holds them.
        self.memory, self.memory_mask = (None, None) if use_cache else (memory, src_mask)
        self.candidates = self.project = self.columns = self.off = None
        self.eos_column = self.eos
        if model.shortlist is not None:  # columns: each id's, -1 off the list (BOS); off: per source, others' columns
            restricted = model.shortlist.restrict(src, model.output, memory.dtype, also)
            self.candidates, self.project, self.columns, self.off = restricted
            self.eos_column = int(self.columns[self.eos])
            self.never = [int(c) for c in self.columns[self.never].tolist() if c >= 0]

    def log_probs(self, prefix: torch.Tensor) -> torch.Tensor:
        """prefix (R, t+1) = BOS + tokens so far -> log p(next token) (R, V) in float32; with a shortlist (R, K),
        a column per candidate (`token` maps columns to ids, `column` ids to columns)."""
        self.steps += 1
        step = self.model.decode if self.project is None else self.model.decode_states
        if self.cache is not None:
            out = step(prefix[:, -1:], cache=self.cache)
        else:
            mask = causal_mask(prefix.size(1), prefix.device)
            out = step(prefix, self.memory, self.memory_mask, mask)
        # (R, V) logits, or (R, K) over a shortlist's candidates (the projection's own): fp32, else a copy
        rows = (out[:, -1] if self.project is None else self.project(out[:, -1])).float()
        if self.off is not None:  # rows come grouped by source (DecoderCache.keep_rows): each group gets its own
            rows.view(len(self.off), -1, rows.size(1)).masked_fill_(self.off[:, None], float("-inf"))
        if rows.device.type == "cpu" and not rows.requires_grad:
            # Over the logits, which nothing else reads: no new (R, V) tensor a step, the same values (log.md)
            lprobs = torch.log_softmax(rows, dim=-1, out=rows)
        else:
            lprobs = F.log_softmax(rows, dim=-1)
        for column in self.never:  # one int each: a list index would be copied to the GPU, a sync every step
            lprobs[:, column] = float("-inf")
        return lprobs

    def token(self, columns: torch.Tensor) -> torch.Tensor:
        """The ids of log_probs' columns (themselves without a shortlist)."""
        return columns if self.candidates is None else self.candidates[columns]

    def column(self, ids: torch.Tensor) -> torch.Tensor:
        """The columns of ids in log_probs (-1: not a candidate)."""
        return ids if self.columns is None else self.columns[ids]

    def widen(self, lprobs: torch.Tensor) -> torch.Tensor:
        """log_probs' rows over the whole vocabulary (-inf off the shortlist), for a search that ranks by ids."""
        if self.candidates is None:
            return lprobs
        full = lprobs.new_full((lprobs.size(0), self.model.vocab_size), float("-inf"))
        return full.index_copy_(1, self.candidates, lprobs)

    def keep_rows(self, index: torch.Tensor, sources: torch.Tensor | None = None) -> None:
        """Keep rows `index`; `sources`: the sentences that stay when some leave (DecoderCache.keep_rows)."""
        self.off = self.off if self.off is None or sources is None else self.off.index_select(0, sources)
        if self.cache is not None:
            self.cache.keep_rows(index, sources)
        else:
            self.memory = self.memory.index_select(0, index)
            self.memory_mask = self.memory_mask.index_select(0, index)


class EnsembleDecoder:
    """An ensemble's decoder side: each member's own Decoder (its encoder output and KV cache), and per step the
    mean of their log-probabilities (module docstring). Summed in member order and divided once: one member gives
    its own values exactly, and two copies of one model give them too (a + a and the halving are exact)."""

    def __init__(self, ensemble: Ensemble, src: torch.Tensor, use_cache: bool, also: Also = None):
        self.members = [Decoder(model, src, use_cache, also) for model in ensemble.models]
        self.steps, self.eos = 0, ensemble.specials.eos
        first = self.members[0]  # one vocabulary and one list: every member's columns are the first's
        self.eos_column, self.token, self.column, self.widen = first.eos_column, first.token, first.column, first.widen

    def log_probs(self, prefix: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        total = self.members[0].log_probs(prefix)
        for member in self.members[1:]:
            total = total + member.log_probs(prefix)
        return total / len(self.members)

    def keep_rows(self, index: torch.Tensor, sources: torch.Tensor | None = None) -> None:
        for member in self.members:
            member.keep_rows(index, sources)


class ForcedPrefix:
    """Target ids each source row's hypotheses must start with (module docstring), as a (rows, longest) table
    padded with -1 (nothing forced), kept in step with the rows that stay (`keep`)."""

    def __init__(self, prefixes: Sequence[Sequence[int]], device: torch.device):
        self.length = max(len(p) for p in prefixes)  # steps that force anything
        table = torch.full((len(prefixes), self.length), -1, dtype=torch.long)
        for row, ids in enumerate(prefixes):
            table[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
        lengths = torch.tensor([len(p) for p in prefixes])  # (rows,)
        if device.type != "cpu":  # from pinned memory without waiting (device_index)
            table, lengths = (t.pin_memory().to(device, non_blocking=True) for t in (table, lengths))
        self.table, self.lengths = table, lengths

    @staticmethod
    def of(prefixes: Sequence[Sequence[int]] | None, src: torch.Tensor) -> ForcedPrefix | None:
        """The prefixes of src's rows, or None when no row has one (nothing extra is done then)."""
        if prefixes is None or not any(len(p) for p in prefixes):
            return None
        if len(prefixes) != src.size(0):
            raise ValueError(f"{len(prefixes)} prefixes for {src.size(0)} source rows")
        return ForcedPrefix(prefixes, src.device)

    def ids(self) -> torch.Tensor:
        """Each row's forced ids, -1 padded (its shortlist keeps them)."""
        return self.table

    def keep(self, index: torch.Tensor) -> None:
        """Keep the rows `index` of the sentences that stay, in order."""
        self.table, self.lengths = self.table[index], self.lengths[index]

    def forcing(self, t: int, group: int = 1) -> torch.Tensor | None:
        """(rows * group,) whether each row's token at step t is forced; None: no row's is."""
        if t >= self.length:
            return None
        forced = self.table[:, t] >= 0
        return forced.repeat_interleave(group) if group > 1 else forced

    def apply(self, lprobs: torch.Tensor, t: int, group: int = 1, column=lambda ids: ids) -> torch.Tensor:
        """lprobs (rows * group, V) of step t -> the same with each forced row's other tokens at -inf. `column`:
        where an id is among lprobs' columns (a shortlist's decoder.column)."""
        if t >= self.length:
            return lprobs
        forced = self.table[:, t]
        forced = torch.where(forced >= 0, column(forced.clamp(min=0)), forced)
        if group > 1:
            forced = forced.repeat_interleave(group)
        token = forced.clamp(min=0)[:, None]
        only = torch.full_like(lprobs, float("-inf")).scatter_(1, token, lprobs.gather(1, token))
        return torch.where((forced >= 0)[:, None], only, lprobs)


def max_output_lengths(src_lengths: torch.Tensor, max_len_offset: int, max_positions: int) -> torch.Tensor:
    """(B,) source lengths (non-PAD positions, EOS included) -> (B,) output-length limits in tokens (EOS
    excluded): max_len_offset more than the source, capped so that BOS + max_len tokens, the decoder positions
    that get embedded, fit in max_positions. Every engine's limit (module docstring)."""
    return (src_lengths + max_len_offset).clamp(max=max_positions - 1)


def max_lengths(model, src: torch.Tensor, max_len_offset: int, forced: ForcedPrefix | None = None) -> torch.Tensor:
    """(B,) output-length limits of src's rows: max_output_lengths, and at least a forced prefix's length."""
    src_len = padding_mask(src, model.specials.pad).view(src.size(0), -1).sum(dim=1)  # (B, 1, 1, S) -> (B,)
    limits = max_output_lengths(src_len, max_len_offset, model.cfg.max_positions)
    if forced is None:
        return limits
    return torch.maximum(limits, forced.lengths).clamp(max=model.cfg.max_positions - 1)


def to_host(*tensors: torch.Tensor) -> list[np.ndarray]:
    """The tensors as numpy arrays of their own dtypes, read from a GPU in one copy (one synchronisation; float64
    holds token ids and float32 scores exactly); on a CPU, views of the tensors' memory."""
    if tensors[0].device.type == "cpu":
        return [t.detach().numpy() for t in tensors]
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors]).cpu().numpy()
    out, start = [], 0
    for t in tensors:
        dtype = torch.empty(0, dtype=t.dtype).numpy().dtype
        out.append(flat[start : start + t.numel()].reshape(tuple(t.shape)).astype(dtype))
        start += t.numel()
    return out


def device_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices chosen on the host, as a tensor on `device` (device_tensor)."""
    return device_tensor(rows, device)


def device_tensor(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Values chosen on the host, as a tensor on `device`; to a GPU from pinned memory without waiting (a copy
    from ordinary host memory waits until the GPU has done its queued work)."""
    values = torch.tensor(values, dtype=dtype)
    return values if device.type == "cpu" else values.pin_memory().to(device, non_blocking=True)


def force_eos(lprobs: torch.Tensor, at_limit: torch.Tensor | None, eos: int, free: bool = False) -> torch.Tensor:
    """Rows at their length limit may only emit EOS; at_limit None: no row is (known on the host). free: that EOS
    costs nothing (log-probability 0, as generate() forces it: the "hf" stop rule)."""
    if at_limit is None:  # the common case: skip a full (rows, vocab) rewrite
        return lprobs
    not_eos = torch.ones(lprobs.size(1), dtype=torch.bool, device=lprobs.device)
    not_eos[eos] = False
    forced = lprobs.masked_fill(at_limit[:, None] & not_eos[None, :], float("-inf"))
    if free:
        forced[:, eos] = torch.where(at_limit, 0.0, forced[:, eos])
    return forced


def next_log_probs(
    decoder: Decoder | EnsembleDecoder,
    prefix: torch.Tensor,
    t: int,
    settings: SearchSettings,
    at_limit: torch.Tensor | None,
    forced: ForcedPrefix | None,
    group: int = 1,
) -> torch.Tensor:
    """log p(next token) (R, V) of the rows `prefix` (R, t+1) at step t, with what the settings and the rows allow:
    only EOS at a row's length limit (force_eos; free under the "hf" rule), no token that repeats an n-gram
    (ban_repeats), only its prefix's token while a row is forced (`group`: rows per sentence). With a shortlist,
    (R, K): a column per candidate, which decoder.token maps to ids."""
    lprobs = force_eos(decoder.log_probs(prefix), at_limit, decoder.eos_column, settings.stop == "hf")
    if settings.no_repeat_ngram_size:
        spared = None if forced is None else forced.forcing(t, group)
        lprobs = ban_repeats(lprobs, decoder.column(prefix), settings.no_repeat_ngram_size, spared)
    if forced is not None:
        lprobs = forced.apply(lprobs, t, group, decoder.column)
    return lprobs


def ban_repeats(lprobs: torch.Tensor, prefix: torch.Tensor, size: int, spared: torch.Tensor | None) -> torch.Tensor:
    """lprobs (R, V) with -inf, in place, for each token that would end an n-gram of `size` tokens its row's prefix
    (R, t+1) holds already (the module docstring's rule); `spared` (R,): rows left alone (a forced prefix's step).
    On the device, without a read to the host: every n-gram of each row compared with its last size - 1 tokens."""
    length = prefix.size(1)
    if length < size:  # no n-gram held yet
        return lprobs
    grams = prefix.unfold(1, size, 1)  # (R, W, size): every n-gram of each row
    last = prefix[:, length - size + 1 :].unsqueeze(1)  # (R, 1, size - 1)
    held = (grams[:, :, :-1] == last).all(dim=2)  # (R, W)
    if spared is not None:
        held &= ~spared[:, None]
    ending = grams[:, :, -1]  # a shortlist's columns: -1 is BOS, which is no candidate and bans nothing
    held &= ending >= 0
    ending = ending.clamp(min=0)
    # Each window's last token gets -inf where its first size - 1 tokens are the row's last ones; the others +inf,
    # which the minimum leaves as they were.
    banned = torch.full(held.shape, float("inf"), dtype=lprobs.dtype, device=lprobs.device)
    banned.masked_fill_(held, float("-inf"))
    return lprobs.scatter_reduce_(1, ending, banned, reduce="amin")


def new_step(rows: int) -> TraceStep:
    return TraceStep([[] for _ in range(rows)], [[] for _ in range(rows)])


def most_probable(lprobs: torch.Tensor, t: int, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy search's choice: per row, (the best log-probability, its token)."""
    return lprobs.max(dim=-1)


def greedy_search(
    model,
    src: torch.Tensor,
    settings: SearchSettings,
    use_cache: bool = True,
    trace: list[TraceStep] | None = None,
    forced: ForcedPrefix | None = None,
    pick=most_probable,
) -> SearchResult:
    """One hypothesis per row: at each step the token `pick` chooses (the most probable; sampling.py draws
    one); finished rows leave the batch. pick(lprobs (R, V), step, rows' indices in src) -> (the chosen
    tokens' log-probabilities (R,), the tokens (R,))."""
    bos, eos = model.specials.bos, model.specials.eos
    decoder = new_decoder(model, src, use_cache, None if forced is None else forced.ids)
    max_len = max_lengths(model, src, settings.max_len_offset, forced)  # (B,)
    limits = to_host(max_len)[0]  # the same on the host
    alive = list(range(src.size(0)))  # original index of each row
    prefix = torch.full((src.size(0), 1), bos, dtype=torch.long, device=src.device)  # (R, t+1)
    scores = torch.zeros(src.size(0), device=src.device)
    out: list[list[Hypothesis] | None] = [None] * src.size(0)
    sentence_steps = [0] * src.size(0)
    t = 0
    while alive:
        at_limit = (t >= max_len) if t >= limits.min() else None
        lprobs = next_log_probs(decoder, prefix, t, settings, at_limit, forced)
        best, token = pick(lprobs, t, alive)  # (R,)
        token = decoder.token(token)  # a shortlist's columns -> ids
        if at_limit is not None:
            # A row at its limit ends there whatever pick made of it (a sampled distribution gone NaN draws
            # anything): no output may run past model.max_positions.
            token = token.masked_fill(at_limit, eos)
            best = torch.where(at_limit, lprobs[:, decoder.eos_column], best)
        scores = scores + best
        prefix = torch.cat([prefix, token[:, None]], dim=1)
        tokens, totals, prefixes = to_host(token, scores, prefix)  # the step's one read
        done = tokens == eos
        if trace is not None:
            trace.append(_greedy_step(src.size(0), alive, prefixes, totals, done, penalty(settings, t + 1)))
        if done.any():
            rows = np.flatnonzero(done)
            divisor = penalty(settings, t + 1)
            for row, row_tokens, total in zip(rows.tolist(), prefixes[rows, 1:-1].tolist(), totals[rows].tolist()):
                out[alive[row]] = [Hypothesis(row_tokens, total / divisor)]
                sentence_steps[alive[row]] = t + 1
            keep_list = np.flatnonzero(~done).tolist()
            if not keep_list:
                break
            keep = device_index(keep_list, src.device)
            alive = [alive[row] for row in keep_list]
            prefix, scores, max_len, limits = prefix[keep], scores[keep], max_len[keep], limits[keep_list]
            if forced is not None:
                forced.keep(keep)
            decoder.keep_rows(keep, keep)
        t += 1
    return SearchResult(out, decoder.steps, sentence_steps)  # type: ignore[arg-type]


def _greedy_step(
    rows: int, alive: list[int], prefix: np.ndarray, scores: np.ndarray, done: np.ndarray, penalty: float
) -> TraceStep:
    """The trace of one greedy step: each row's one hypothesis, alive or finished (prefix (R, t+2) from BOS)."""
    step = new_step(rows)
    for row, row_tokens, total, ended in zip(alive, prefix[:, 1:].tolist(), scores.tolist(), done.tolist()):
        if ended:
            step.finished[row].append(Hypothesis(row_tokens[:-1], total / penalty))
        else:
            step.alive[row].append(Hypothesis(row_tokens, total))
    return step


def still_searching(
    alive: list[int],
    finished: list[list[Hypothesis]],
    best_live: list[float],
    limit_hit: list[bool],
    best_lp: list[float],
    now_lp: float,
    settings: SearchSettings,
    sentence_steps: list[int],
    steps: int,
) -> list[int]:
    """Positions in `alive` of the sentences that search on; a sentence stops at its length limit or when its
    stop rule says so, and then keeps its settings.nbest best finished hypotheses, best first, and records
    `steps`. now_lp: the penalty at the live hypotheses' length (the "hf" rule's divisor)."""
    k, nbest, rules = settings.beam, settings.nbest, settings
    keep = []
    for s, index in enumerate(alive):
        hyps = finished[index]
        done = limit_hit[s] or (rules.stop == "early" and len(hyps) >= k)
        if not done and rules.stop == "hf" and len(hyps) >= k:  # generate's heuristic
            kth = sorted((h.score for h in hyps), reverse=True)[k - 1]
            done = kth >= best_live[s] / now_lp
        elif not done and rules.stop != "hf" and len(hyps) >= nbest:  # the exact bound; it can settle "early" sooner
            kth = sorted((h.score for h in hyps), reverse=True)[nbest - 1]
            done = kth >= best_live[s] / (best_lp[index] if rules.lenpen > 0 else 1.0)
        if done:
            hyps.sort(key=lambda h: h.score, reverse=True)
            del hyps[nbest:]
            sentence_steps[index] = steps
        else:
            keep.append(s)
    return keep


@dataclass
class Sentences:
    """What a beam search keeps per sentence: which ones it still searches (by original index), their length
    limits, the exact rule's divisor, the hypotheses each has finished and the decoder steps it took."""

    settings: SearchSettings
    max_len: torch.Tensor  # (B,) output-length limit of each live sentence
    limits: np.ndarray  # the same on the host
    best_lp: list[float]  # by original index: the largest penalty a live hypothesis can reach (module docstring)
    alive: list[int]  # original index of each live sentence
    finished: list[list[Hypothesis]]  # by original index
    sentence_steps: list[int]  # by original index

    @classmethod
    def start(cls, model, src: torch.Tensor, settings: SearchSettings, forced: ForcedPrefix | None) -> Sentences:
        """Every sentence of `src` live, none finished, each with its output-length limit."""
        max_len = max_lengths(model, src, settings.max_len_offset, forced)
        limits, best_lp = to_host(max_len, penalty(settings, max_len.double() + 1))
        rows = src.size(0)
        return cls(
            settings=settings,
            max_len=max_len,
            limits=limits,
            best_lp=best_lp.tolist(),
            alive=list(range(rows)),
            finished=[[] for _ in range(rows)],
            sentence_steps=[0] * rows,
        )

    def at_limit(self, t: int, n: int) -> torch.Tensor | None:
        """(B*n,) whether each of the n rows per sentence is at its length limit at step t; None: none is."""
        return (t >= self.max_len).repeat_interleave(n) if t >= self.limits.min() else None

    def finish(
        self,
        finishing: np.ndarray,
        scores: np.ndarray,
        origin: np.ndarray,
        prefix: np.ndarray,
        n: int,
        t: int,
        step: TraceStep | None,
    ) -> None:
        """Finish the EOS candidates marked in `finishing` (B, 2k) (those ranked within the top k; on the host, as
        scores, origin and the prefixes (B*n, t+1) they extend); under "early" only until k have finished
        (module docstring). nonzero() gives them by sentence, then by rank: the better summed score first."""
        sent, pos = np.nonzero(finishing)
        rows = sent * n + origin[sent, pos]
        divisor = penalty(self.settings, t + 1)
        for s, row_tokens, total in zip(sent.tolist(), prefix[rows, 1:].tolist(), scores[sent, pos].tolist()):
            if self.settings.stop == "early" and len(self.finished[self.alive[s]]) >= self.settings.beam:
                continue
            hyp = Hypothesis(row_tokens, total / divisor)
            self.finished[self.alive[s]].append(hyp)
            if step is not None:
                step.finished[self.alive[s]].append(hyp)

    def searching(self, best_live: list[float], t: int) -> list[int]:
        """Positions in `alive` of the sentences that search on after step t (still_searching)."""
        return still_searching(
            self.alive,
            self.finished,
            best_live,
            (t >= self.limits).tolist(),
            self.best_lp,
            penalty(self.settings, t + 1),
            self.settings,
            self.sentence_steps,
            t + 1,
        )

    def keep(self, keep: list[int], forced: ForcedPrefix | None) -> torch.Tensor | None:
        """Search on with the sentences at positions `keep` of `alive` only -> their index on the device, or None
        when every sentence goes on."""
        if len(keep) == len(self.alive):
            return None
        index = device_index(keep, self.max_len.device)
        self.alive = [self.alive[s] for s in keep]
        self.max_len, self.limits = self.max_len[index], self.limits[keep]
        if forced is not None:
            forced.keep(index)
        return index


def _top_candidates(lprobs: torch.Tensor, scores: torch.Tensor, b: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """Each of `b` sentences' 2k best (row, token) candidates, from its `n` rows' log-probabilities lprobs (b*n, V)
    and summed scores (b*n,): their summed scores (b, 2k) best first, the row among the sentence's n each extends,
    and the token. A sentence's 2k best are among each of its rows' 2k best tokens: those are ranked, rather than
    every row's score added to all V log-probabilities and n*V ranked per sentence."""
    per_row = min(2 * k, lprobs.size(1))
    row_lprobs, row_tokens = lprobs.topk(per_row, dim=1)  # (B*n, per_row)
    cand = (scores[:, None] + row_lprobs).view(b, n * per_row)  # -> (B, n*per_row)
    row_tokens = row_tokens.view(b, n * per_row)
    if cand.size(1) < 2 * k:  # vocabulary smaller than 2*beam: pad with impossible candidates
        cand = F.pad(cand, (0, 2 * k - cand.size(1)), value=float("-inf"))
        row_tokens = F.pad(row_tokens, (0, 2 * k - row_tokens.size(1)), value=lprobs.size(1) - 1)  # any column
    top_scores, top_idx = cand.topk(2 * k, dim=1)  # (B, 2k), best first
    origin = (top_idx // per_row).clamp(max=n - 1)  # the beam each candidate extends
    return top_scores, origin, row_tokens.gather(1, top_idx)


def _beam_search(
    model,
    src: torch.Tensor,
    settings: SearchSettings,
    use_cache: bool,
    trace: list[TraceStep] | None = None,
    forced: ForcedPrefix | None = None,
) -> SearchResult:
    device, k, eos = src.device, settings.beam, model.specials.eos
    # Encoded once per sentence; rows are copied per beam after the first step.
    decoder = new_decoder(model, src, use_cache, None if forced is None else forced.ids)
    sentences = Sentences.start(model, src, settings, forced)
    n = 1  # rows per live sentence: one (just BOS) before the first step, then `beam`
    prefix = torch.full((src.size(0), 1), model.specials.bos, dtype=torch.long, device=device)  # (B*n, t+1)
    scores = torch.zeros(src.size(0), device=device)  # (B*n,) summed log-probabilities
    rank = torch.arange(2 * k, device=device)
    host_rank = np.arange(2 * k)
    t = 0
    while sentences.alive:
        b = len(sentences.alive)
        step = new_step(src.size(0)) if trace is not None else None
        lprobs = next_log_probs(decoder, prefix, t, settings, sentences.at_limit(t, n), forced, n)  # (B*n, V)
        top_scores, origin, token = _top_candidates(lprobs, scores, b, n, k)
        token = decoder.token(token)  # a shortlist's columns -> ids

        # The k best non-EOS candidates stay alive (there are at least k: each beam adds one EOS at most).
        order = ((token == eos).long() * (2 * k) + rank).argsort(dim=1)[:, :k]  # (B, k) positions among the 2k
        scores = top_scores.gather(1, order)  # (B, k)
        parent = torch.arange(b, device=device)[:, None] * n + origin.gather(1, order)  # (B, k) row indices
        new_token = token.gather(1, order)  # (B, k)

        # The step's one read: the candidates, the prefixes they extend, each sentence's best live score.
        host_scores, host_token, host_origin, host_prefix, best_live = to_host(
            top_scores, token, origin, prefix, scores[:, 0]
        )
        finishing = (host_token == eos) & (host_rank < k) & (host_scores > float("-inf"))
        if finishing.any():
            sentences.finish(finishing, host_scores, host_origin, host_prefix, n, t, step)
        keep = sentences.searching(best_live.tolist(), t)
        if step is not None:
            for s in keep:  # (k, t+1): each kept hypothesis's tokens so far, without BOS
                tokens = torch.cat([prefix[parent[s], 1:], new_token[s, :, None]], dim=1)
                step.alive[sentences.alive[s]] = [
                    Hypothesis(h, total) for h, total in zip(tokens.tolist(), scores[s].tolist())
                ]
            trace.append(step)
        if not keep:
            break
        kept = sentences.keep(keep, forced)
        if kept is not None:
            scores, parent, new_token = scores[kept], parent[kept], new_token[kept]
        index = parent.reshape(-1)  # (B', k) -> (B'*k,)
        prefix = torch.cat([prefix.index_select(0, index), new_token.reshape(-1, 1)], dim=1)  # (B'*k, t+2)
        scores = scores.reshape(-1)
        # Rows of one sentence share its source: the encoder K/V move only when sentences leave.
        decoder.keep_rows(index, kept)
        n = k
        t += 1
    return SearchResult(sentences.finished, decoder.steps, sentences.sentence_steps)
