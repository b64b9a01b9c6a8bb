"""Greedy and beam search over a trained Transformer: batched over sentences and beams, with a KV cache.

Conventions shared by both searches:
- `src` is (B, S) source ids as the model was trained on them (subwords + EOS, right-padded with PAD);
  its mask comes from `padding_mask`, the only source-mask builder.
- A sentence's output may hold at most max_len = src_len + max_len_offset tokens, where src_len counts
  its non-PAD source positions (EOS included), capped so decoder positions stay below max_positions.
  At that length EOS is forced, so every hypothesis ends with EOS.
- `Hypothesis.tokens` excludes BOS and EOS; `score` is the sum of the token log-probabilities, EOS
  included, divided by the GNMT length penalty ((5 + len) / 6) ** alpha with len = tokens + 1 (greedy:
  no penalty, i.e. alpha = 0).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from transformer.batch import causal_mask, padding_mask
from transformer.vocab import BOS_ID, EOS_ID, PAD_ID


@dataclass
class Hypothesis:
    tokens: list[int]  # output ids without BOS/EOS
    score: float


def length_penalty(length, alpha: float):
    """GNMT (Wu et al. 2016): lp = ((5 + length) / 6) ** alpha; works on floats and tensors."""
    return ((5.0 + length) / 6.0) ** alpha


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Dropout off while searching, then the caller's mode back (the trainer decodes mid-training)."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


def _max_lengths(model, src_mask: torch.Tensor, max_len_offset: int) -> torch.Tensor:
    """(B,) output-length limits; BOS + max_len tokens are the decoder positions that get embedded."""
    src_len = src_mask.view(src_mask.size(0), -1).sum(dim=1)  # (B, 1, 1, S) -> (B,)
    return (src_len + max_len_offset).clamp(max=model.cfg.max_positions - 1)


class _Stepper:
    """One decoder step for the newest token of every row, cached or (for tests) from scratch."""

    def __init__(self, model, memory: torch.Tensor, memory_mask: torch.Tensor, use_cache: bool):
        self.model = model
        self.memory, self.memory_mask = memory, memory_mask  # (R, S, C), (R, 1, 1, S)
        self.cache = model.new_cache() if use_cache else None

    def log_probs(self, prefix: torch.Tensor) -> torch.Tensor:
        """prefix (R, t+1) = BOS + tokens so far -> log p(next token) (R, V) in float32."""
        if self.cache is not None:
            logits = self.model.decode(prefix[:, -1:], self.memory, self.memory_mask, None, self.cache)
        else:
            mask = causal_mask(prefix.size(1), prefix.device)
            logits = self.model.decode(prefix, self.memory, self.memory_mask, mask)
        lprobs = F.log_softmax(logits[:, -1].float(), dim=-1)
        lprobs[:, PAD_ID] = float("-inf")  # never emitted by training targets
        lprobs[:, BOS_ID] = float("-inf")
        return lprobs

    def keep_rows(self, index: torch.Tensor, memory_changed: bool = True) -> None:
        """Keep rows `index` of the cache (and of the memory and cross-attention K/V when the set
        of sentences, or the rows per sentence, changed)."""
        if self.cache is not None:
            self.cache.reorder(index, cross=memory_changed)
        if memory_changed:
            if self.cache is None or self.cache.length == 0:  # once cached, cross K/V replace the memory
                self.memory = self.memory.index_select(0, index)
            self.memory_mask = self.memory_mask.index_select(0, index)


def _force_eos(lprobs: torch.Tensor, at_limit: torch.Tensor) -> torch.Tensor:
    """Rows at their length limit may only emit EOS."""
    if not bool(at_limit.any()):  # the common case: skip a full (rows, vocab) rewrite
        return lprobs
    not_eos = torch.ones(lprobs.size(1), dtype=torch.bool, device=lprobs.device)
    not_eos[EOS_ID] = False
    return lprobs.masked_fill(at_limit[:, None] & not_eos[None, :], float("-inf"))


def greedy_search(model, src: torch.Tensor, max_len_offset: int = 50, use_cache: bool = True) -> list[Hypothesis]:
    """Most probable next token at each step; one Hypothesis per source row, in input order."""
    with _eval_mode(model):
        src_mask = padding_mask(src)
        stepper = _Stepper(model, model.encode(src, src_mask), src_mask, use_cache)
        max_len = _max_lengths(model, src_mask, max_len_offset)  # (B,)
        alive = list(range(src.size(0)))                         # original index of each row
        prefix = torch.full((src.size(0), 1), BOS_ID, dtype=torch.long, device=src.device)  # (R, t+1)
        scores = torch.zeros(src.size(0), device=src.device)
        out: list[Optional[Hypothesis]] = [None] * src.size(0)
        t = 0
        while alive:
            lprobs = _force_eos(stepper.log_probs(prefix), t >= max_len)
            best, token = lprobs.max(dim=-1)  # (R,)
            scores = scores + best
            prefix = torch.cat([prefix, token[:, None]], dim=1)
            done = token == EOS_ID
            if done.any():
                rows = done.nonzero().view(-1)
                for row, row_tokens, total in zip(rows.tolist(), prefix[rows, 1:-1].tolist(), scores[rows].tolist()):
                    out[alive[row]] = Hypothesis(row_tokens, total)
                keep_list = (~done).nonzero().view(-1).tolist()
                if not keep_list:
                    break
                keep = torch.tensor(keep_list, dtype=torch.long, device=src.device)
                alive = [alive[row] for row in keep_list]
                prefix, scores, max_len = prefix[keep], scores[keep], max_len[keep]
                stepper.keep_rows(keep)
            t += 1
        return out  # type: ignore[return-value]


def beam_search(model, src: torch.Tensor, beam: int = 4, lenpen: float = 0.6, max_len_offset: int = 50,
                nbest: int = 1, use_cache: bool = True) -> list[list[Hypothesis]]:
    """Beam search with the GNMT length penalty; per source row, its `nbest` best hypotheses, best first.

    Each step ranks 2*beam candidates per sentence: the best `beam` that do not end in EOS stay alive, and
    an EOS candidate is finished only when it ranks within the top `beam` (so beam 1 is exactly greedy
    with lenpen 0). A sentence stops once its nbest-th finished score beats any possible continuation.
    """
    if beam < 1 or not 1 <= nbest <= beam:
        raise ValueError(f"need beam >= 1 and 1 <= nbest <= beam, got beam={beam}, nbest={nbest}")
    with _eval_mode(model):
        return _beam_search(model, src, beam, lenpen, max_len_offset, nbest, use_cache)


def _beam_search(model, src, beam, lenpen, max_len_offset, nbest, use_cache) -> list[list[Hypothesis]]:
    device, k = src.device, beam
    inf = float("-inf")
    src_mask = padding_mask(src)
    # Encoded once per sentence; rows are copied per beam after the first step.
    stepper = _Stepper(model, model.encode(src, src_mask), src_mask, use_cache)
    max_len = _max_lengths(model, src_mask, max_len_offset)  # (B,) per live sentence
    # The best score a live hypothesis can still reach: its sum only falls, its penalty grows at most to max_len + 1.
    best_lp = length_penalty(max_len.double() + 1, lenpen).tolist()
    alive = list(range(src.size(0)))  # original index of each live sentence
    finished: list[list[Hypothesis]] = [[] for _ in alive]  # by original index
    n = 1  # rows per live sentence: one (just BOS) before the first step, then `beam`
    prefix = torch.full((src.size(0), 1), BOS_ID, dtype=torch.long, device=device)  # (B*n, t+1)
    scores = torch.zeros(src.size(0), device=device)  # (B*n,) summed log-probabilities
    rank = torch.arange(2 * k, device=device)
    t = 0
    while alive:
        b = len(alive)
        lprobs = stepper.log_probs(prefix)  # (B*n, V)
        vocab = lprobs.size(1)
        at_limit = (t >= max_len).repeat_interleave(n)  # (B,) -> (B*n,)
        cand = (scores[:, None] + _force_eos(lprobs, at_limit)).view(b, n * vocab)  # (B*n, V) -> (B, n*V)
        if cand.size(1) < 2 * k:  # vocabulary smaller than 2*beam: pad with impossible candidates
            cand = F.pad(cand, (0, 2 * k - cand.size(1)), value=inf)
        top_scores, top_idx = cand.topk(2 * k, dim=1)  # (B, 2k), best first
        origin = (top_idx // vocab).clamp(max=n - 1)  # the beam each candidate extends
        token = top_idx % vocab
        is_eos = token == EOS_ID

        # Finish EOS candidates ranked within the top k (host side: only these few rows are copied).
        finishing = is_eos & (rank < k) & (top_scores > inf)
        if finishing.any():
            sent, pos = finishing.nonzero(as_tuple=True)
            rows = sent * n + origin[sent, pos]
            penalty = length_penalty(t + 1, lenpen)
            for s, row_tokens, total in zip(sent.tolist(), prefix[rows, 1:].tolist(), top_scores[sent, pos].tolist()):
                finished[alive[s]].append(Hypothesis(row_tokens, total / penalty))

        # The k best non-EOS candidates stay alive (there are at least k: each beam adds one EOS at most).
        order = (is_eos.long() * (2 * k) + rank).argsort(dim=1)[:, :k]  # (B, k) positions among the 2k
        scores = top_scores.gather(1, order)  # (B, k)
        parent = torch.arange(b, device=device)[:, None] * n + origin.gather(1, order)  # (B, k) row indices
        new_token = token.gather(1, order)  # (B, k)

        # Stop a sentence at its length limit, or when no live hypothesis can beat its nbest-th finished one.
        best_live, limit_hit = scores[:, 0].tolist(), (t >= max_len).tolist()
        keep = []
        for s in range(b):
            hyps = finished[alive[s]]
            done = limit_hit[s]
            if not done and len(hyps) >= nbest:
                kth = sorted((h.score for h in hyps), reverse=True)[nbest - 1]
                done = kth >= best_live[s] / (best_lp[alive[s]] if lenpen > 0 else 1.0)
            if done:
                hyps.sort(key=lambda h: h.score, reverse=True)
                del hyps[nbest:]
            else:
                keep.append(s)
        if not keep:
            break
        sentence_set_changed = len(keep) < b
        if sentence_set_changed:
            alive = [alive[s] for s in keep]
            keep_t = torch.tensor(keep, dtype=torch.long, device=device)
            scores, parent, new_token, max_len = scores[keep_t], parent[keep_t], new_token[keep_t], max_len[keep_t]
        index = parent.reshape(-1)  # (B', k) -> (B'*k,)
        prefix = torch.cat([prefix.index_select(0, index), new_token.reshape(-1, 1)], dim=1)  # (B'*k, t+2)
        scores = scores.reshape(-1)
        # Rows of one sentence share its memory: copy memory only when sentences or rows per sentence change.
        stepper.keep_rows(index, memory_changed=sentence_set_changed or n != k)
        n = k
        t += 1
    return finished
