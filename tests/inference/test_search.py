"""Behaviour of search() (greedy and beam, both stop rules) on tiny seeded models (random, peaky, and one that
copies by construction), against a plain reference implementation of the rules."""

import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import WORDS, copying_model
from transformer.config import ModelConfig
from transformer.data.batch import causal_mask, pad_sequences, padding_mask
from transformer.data.vocab import BOS_ID, EOS_ID, PAD_ID
from transformer.errors import UserError
from transformer.inference.search import (
    Hypothesis,
    SearchResult,
    _beam_search,
    greedy_search,
    length_penalty,
    max_lengths,
    new_decoder,
    search,
)
from transformer.inference.settings import SearchFlags, SearchSettings
from transformer.inference.translator import Translator
from transformer.model.transformer import Transformer

VOCAB = 24
CFG = ModelConfig(d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=64, dropout=0.0, max_positions=64)


def make_sources(seed: int, n: int = 6, lo: int = 2, hi: int = 9) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(4, VOCAB, (length,), generator=g).tolist() + [EOS_ID] for length in lengths]


def as_batch(sources: list[list[int]]) -> torch.Tensor:
    return pad_sequences(sources, pad_id=PAD_ID)  # (B, S)


def greedy(model, src, offset, use_cache=True) -> list[Hypothesis]:
    return search(model, src, SearchSettings(beam=1, lenpen=0.0, max_len_offset=offset), use_cache=use_cache).best()


def nbest_lists(model, src, beam, lenpen, offset, nbest=1, stop="exact", use_cache=True) -> list[list[Hypothesis]]:
    return search(
        model,
        src,
        SearchSettings(beam=beam, lenpen=lenpen, max_len_offset=offset, nbest=nbest, stop=stop),
        use_cache=use_cache,
    ).hypotheses


@pytest.fixture(scope="module")
def trained():
    """A model that copies its source by construction (helpers.copying_model), so it emits EOS at varied lengths,
    with ending early the cheapest choice after the copy: a search meets short hypotheses first, and the stop
    rules differ."""
    return copying_model(VOCAB, CFG.max_positions, ending_early=3.0)


def peaky_model() -> Transformer:
    """Random weights with scaled-up logits, so the argmax is rarely a near-tie."""
    torch.manual_seed(3)
    model = Transformer(CFG, VOCAB)
    with torch.no_grad():
        model.output.weight.mul_(4.0)
    return model.eval()


@pytest.fixture(scope="module")
def peaky():
    return peaky_model()


@pytest.fixture(params=["trained", "peaky"])
def model(request):
    return request.getfixturevalue(request.param)


def reference_search(
    model,
    source: list[int],
    beam: int,
    lenpen: float,
    offset: int,
    nbest: int,
    stop: str,
    keep_all: bool = False,
    prefix: tuple[int, ...] = (),
    no_repeat: int = 0,
) -> list[Hypothesis]:
    """The stop rules written plainly: one sentence, every hypothesis's prefix decoded from scratch each step.

    Each step ranks the 2*beam best (hypothesis, token) extensions; an EOS among the first `beam` finishes,
    the first `beam` others stay alive. exact: stop once the nbest-th finished score >= the best live sum
    divided by the largest penalty it can reach, lp(max_len + 1); early: once `beam` have finished, keeping
    the first `beam` to finish, in rank order within a step (fairseq's finalize_hypos); keep_all: every one
    finished at the stopping step (the rule before, and CTranslate2's); prefix: at step t < len(prefix) only
    prefix[t] may be emitted, and the length limit is at least len(prefix); no_repeat N: after the prefix, no
    token that ends an N-gram the hypothesis (BOS first) holds already.
    """
    src = torch.tensor([source])  # (1, S)
    mask = padding_mask(src)
    memory = model.encode(src, mask)
    max_len = max(min(len(source) + offset, model.cfg.max_positions - 1), len(prefix))
    vocab = model.output.out_features
    live = [([], torch.tensor(0.0))]  # (tokens, summed log-probability as float32, as search.py keeps it)
    finished: list[Hypothesis] = []
    for t in range(max_len + 1):
        prefixes = torch.tensor([[BOS_ID] + tokens for tokens, _ in live])  # (k, t+1)
        logits = model.decode(
            prefixes, memory.expand(len(live), -1, -1), mask.expand(len(live), -1, -1, -1), causal_mask(t + 1)
        )
        lprobs = F.log_softmax(logits[:, -1].float(), dim=-1)
        lprobs[:, [PAD_ID, BOS_ID]] = float("-inf")
        if t == max_len:
            lprobs[:, [i for i in range(vocab) if i != EOS_ID]] = float("-inf")
        if t < len(prefix):
            lprobs[:, [i for i in range(vocab) if i != prefix[t]]] = float("-inf")
        elif no_repeat:
            for b, (tokens, _) in enumerate(live):
                seq = [BOS_ID] + tokens
                for i in range(len(seq) - no_repeat + 1):
                    if seq[i : i + no_repeat - 1] == seq[len(seq) - no_repeat + 1 :]:
                        lprobs[b, seq[i + no_repeat - 1]] = float("-inf")
        candidates = [
            (total + lprobs[b, tok], tokens, tok) for b, (tokens, total) in enumerate(live) for tok in range(vocab)
        ]
        candidates = sorted(candidates, key=lambda c: -c[0].item())[: 2 * beam]
        for score, tokens, tok in candidates[:beam]:
            if stop == "early" and not keep_all and len(finished) >= beam:
                break
            if tok == EOS_ID and score.item() > float("-inf"):
                finished.append(Hypothesis(tokens, score.item() / length_penalty(t + 1, lenpen)))
        live = [(tokens + [tok], score) for score, tokens, tok in candidates if tok != EOS_ID][:beam]
        ranked = sorted((h.score for h in finished), reverse=True)
        if stop == "early":
            done = len(finished) >= beam
        else:
            done = len(ranked) >= nbest and ranked[nbest - 1] >= live[0][1].item() / length_penalty(max_len + 1, lenpen)
        if done or t == max_len:
            break
    return sorted(finished, key=lambda h: -h.score)[:nbest]


def assert_same(found: list[list[Hypothesis]], expected: list[list[Hypothesis]]) -> None:
    for f, e in zip(found, expected, strict=True):
        assert [h.tokens for h in f] == [h.tokens for h in e]
        assert [h.score for h in f] == pytest.approx([h.score for h in e], abs=1e-4)


def test_trained_fixture_stops_at_varied_lengths(trained):
    out = greedy(trained, as_batch(make_sources(5, n=8)), 20)
    lengths = {len(h.tokens) for h in out}
    assert len(lengths) > 1 and max(lengths) < 8 + 1 + 20  # EOS reached before the limit, not a constant


@pytest.mark.parametrize("stop", ["exact", "early"])
@pytest.mark.parametrize("beam,lenpen", [(2, 0.0), (4, 0.6), (5, 1.0)])
def test_beam_search_equals_the_reference(model, stop, beam, lenpen):
    """exact: today's outputs (the rule search.py has always used); early: fairseq's rule."""
    sources = make_sources(31, n=6, lo=1, hi=10)
    found = nbest_lists(model, as_batch(sources), beam, lenpen, 8, nbest=beam, stop=stop)
    assert_same(found, [reference_search(model, s, beam, lenpen, 8, beam, stop) for s in sources])


def test_the_rules_disagree_somewhere_so_the_reference_tests_tell_them_apart(trained):
    sources = make_sources(31, n=6, lo=1, hi=10)
    exact = [reference_search(trained, s, 5, 1.0, 8, 5, "exact") for s in sources]
    early = [reference_search(trained, s, 5, 1.0, 8, 5, "early") for s in sources]
    assert [[h.tokens for h in hs] for hs in exact] != [[h.tokens for h in hs] for hs in early]


def test_greedy_equals_the_reference(model):
    sources = make_sources(11)
    assert_same(
        [[h] for h in greedy(model, as_batch(sources), 10)],
        [reference_search(model, s, 1, 0.0, 10, 1, "early") for s in sources],
    )


@pytest.mark.parametrize("lenpen", [0.0, 0.6])
def test_early_rule_beam_one_equals_greedy(model, lenpen):
    """search() runs beam 1 as greedy; the beam machinery under the early rule must agree with it."""
    src = as_batch(make_sources(11))
    fast = search(model, src, SearchSettings(beam=1, lenpen=lenpen, max_len_offset=10))
    beam = _beam_search(model.eval(), src, SearchSettings(beam=1, lenpen=lenpen, stop="early", max_len_offset=10), True)
    assert_same(fast.hypotheses, beam.hypotheses)
    assert fast.sentence_steps == beam.sentence_steps


def random_model(seed: int) -> Transformer:
    """A small random model of a random shape, its logits scaled and EOS favoured by random amounts, so that
    sentences finish at varied steps, several at once, or only at the length limit."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda *options: options[torch.randint(len(options), (1,), generator=g).item()]  # noqa: E731
    cfg = ModelConfig(
        d_model=pick(16, 32),
        n_heads=pick(2, 4),
        n_encoder_layers=pick(1, 2),
        n_decoder_layers=pick(1, 2),
        d_ff=pick(32, 64),
        dropout=0.0,
        max_positions=pick(12, 64),
        norm=pick("pre", "post"),
    )
    torch.manual_seed(seed)
    model = Transformer(cfg, pick(12, 24, 40))
    with torch.no_grad():
        w = model.output.weight
        w.mul_(1.0 + 3.0 * torch.rand((), generator=g).item())
        w[EOS_ID] *= w.norm(dim=1).mean() / w[EOS_ID].norm() * (1.0 + 2.0 * torch.rand((), generator=g).item())
    return model.eval()


def random_sources(seed: int, vocab: int, n: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(4, vocab, (int(length),), generator=g).tolist() + [EOS_ID]
        for length in torch.randint(1, 9, (n,), generator=g)
    ]


def test_early_rule_keeps_at_most_beam_finished_and_equals_the_reference(random_seed):
    """A property over random small models, beams, n-best sizes and length penalties: under --stop early a
    sentence's n-best list comes from at most `beam` finished hypotheses (the trace shows every one kept), and
    equals fairseq's rule written plainly. At beam 1, search() runs greedy search: it equals the rule too, and
    so does the beam machinery with one beam."""
    rng = torch.Generator().manual_seed(random_seed)
    for trial in range(12):
        model = random_model(random_seed + trial)
        beam = int(torch.randint(1, 5, (1,), generator=rng))
        nbest = int(torch.randint(1, beam + 1, (1,), generator=rng))
        lenpen = (0.0, 0.6, 1.0, 2.0)[int(torch.randint(4, (1,), generator=rng))]
        sources = random_sources(random_seed + 100 + trial, model.output.out_features)
        trace = []
        found = search(
            model,
            as_batch(sources),
            SearchSettings(beam=beam, lenpen=lenpen, max_len_offset=6, nbest=nbest, stop="early"),
            trace=trace,
        ).hypotheses
        assert_same(found, [reference_search(model, s, beam, lenpen, 6, nbest, "early") for s in sources])
        for row, hyps in enumerate(found):
            kept = [h for step in trace for h in step.finished[row]]
            assert len(hyps) == nbest and nbest <= len(kept) <= beam
        if beam == 1:
            assert_same(
                found,
                _beam_search(
                    model,
                    as_batch(sources),
                    SearchSettings(beam=1, lenpen=lenpen, stop="early", max_len_offset=6),
                    True,
                ).hypotheses,
            )


def test_early_rule_drops_what_finishes_beyond_the_beam():
    """The cap at work (fixed models, so that it is sure to be exercised): at beam 3, n-best 3, some lists that
    kept every hypothesis finished at the stopping step (up to 2*beam-1: the rule before, and CTranslate2's)
    differ from fairseq's, and search() gives fairseq's."""
    changed = 0
    for seed in range(10):  # 8 of these 50 lists differ (lenpen 2 favours the longer hypotheses dropped)
        model = random_model(seed)
        sources = random_sources(seed, model.output.out_features)
        found = search(
            model, as_batch(sources), SearchSettings(beam=3, lenpen=2.0, max_len_offset=6, nbest=3, stop="early")
        ).hypotheses
        expected = [reference_search(model, s, 3, 2.0, 6, 3, "early") for s in sources]
        assert_same(found, expected)
        every = [reference_search(model, s, 3, 2.0, 6, 3, "early", keep_all=True) for s in sources]
        changed += sum([h.tokens for h in a] != [h.tokens for h in b] for a, b in zip(every, expected))
    assert changed > 0


@pytest.mark.parametrize("stop", ["exact", "early"])
@pytest.mark.parametrize("beam", [1, 3])
def test_cached_equals_uncached(model, beam, stop):
    src = as_batch(make_sources(12))
    cached = nbest_lists(model, src, beam, 0.6, 8, nbest=beam, stop=stop)
    plain = nbest_lists(model, src, beam, 0.6, 8, nbest=beam, stop=stop, use_cache=False)
    assert_same(cached, plain)


def test_larger_length_penalty_never_shortens():
    """On a copy model unsure of each piece, for which ending at once is the best sentence without a penalty and the
    copy the best with a large one (the scores of the best two differ by 0.04 or more at every penalty)."""
    unsure = copying_model(VOCAB, CFG.max_positions, sure=3.5, ending_early=4.0)
    src = as_batch(make_sources(13, n=10))
    lengths = [
        [len(hs[0].tokens) for hs in nbest_lists(unsure, src, 4, alpha, 15)] for alpha in (0.0, 0.3, 0.6, 1.0, 2.0)
    ]
    for shorter_alpha, longer_alpha in zip(lengths, lengths[1:]):
        assert all(a <= b for a, b in zip(shorter_alpha, longer_alpha))
    assert lengths[0] != lengths[-1]  # the penalty did change some choice: the check above was not vacuous


@pytest.mark.parametrize("stop", ["exact", "early"])
@pytest.mark.parametrize("beam", [1, 4])
def test_batched_equals_one_at_a_time(model, beam, stop):
    sources = make_sources(14, n=7, lo=1, hi=12)  # very different lengths: lots of padding
    batched = search(
        model, as_batch(sources), SearchSettings(beam=beam, lenpen=0.6, max_len_offset=10, nbest=beam, stop=stop)
    )
    single = [
        search(model, as_batch([s]), SearchSettings(beam=beam, lenpen=0.6, max_len_offset=10, nbest=beam, stop=stop))
        for s in sources
    ]
    assert_same(batched.hypotheses, [r.hypotheses[0] for r in single])
    assert batched.sentence_steps == [r.sentence_steps[0] for r in single]


@pytest.mark.parametrize("stop", ["exact", "early"])
def test_nbest_sorted_distinct_and_scored(trained, stop):
    src = as_batch(make_sources(15))
    for hyps in nbest_lists(trained, src, beam=5, lenpen=0.6, offset=10, nbest=3, stop=stop):
        assert len(hyps) == 3
        assert all(isinstance(h, Hypothesis) for h in hyps)
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == 3
        assert all(EOS_ID not in h.tokens and PAD_ID not in h.tokens for h in hyps)


def test_score_is_sum_over_gnmt_penalty(trained):
    """A hypothesis's score, recomputed by teacher forcing: summed log-probabilities (EOS included) / lp."""
    src = as_batch(make_sources(22, n=3))
    for row, hyps in enumerate(nbest_lists(trained, src, 3, 0.6, 10, nbest=3)):
        for h in hyps:
            tgt_in = torch.tensor([[BOS_ID] + h.tokens])
            logits = trained(src[row : row + 1], tgt_in, padding_mask(src[row : row + 1]), causal_mask(tgt_in.size(1)))
            lprobs = F.log_softmax(logits[0].float(), dim=-1)
            total = lprobs[torch.arange(len(h.tokens) + 1), torch.tensor(h.tokens + [EOS_ID])].sum().item()
            assert h.score == pytest.approx(total / length_penalty(len(h.tokens) + 1, 0.6), abs=1e-4)


def test_beam_not_worse_than_greedy_under_its_objective(trained):
    """With lenpen 0 the beam's score is a log-probability, so a wider beam can only find better ones."""
    src = as_batch(make_sources(16, n=8))
    g = greedy(trained, src, 10)
    beam = nbest_lists(trained, src, beam=4, lenpen=0.0, offset=10)
    assert all(b[0].score >= h.score - 1e-5 for h, b in zip(g, beam))


@pytest.mark.parametrize("lenpen", [0.0, 0.6, 1.0])
def test_early_rule_never_takes_more_steps(trained, lenpen):
    src = as_batch(make_sources(17, n=10))
    exact = search(trained, src, SearchSettings(beam=4, lenpen=lenpen, max_len_offset=15, stop="exact"))
    early = search(trained, src, SearchSettings(beam=4, lenpen=lenpen, max_len_offset=15, stop="early"))
    assert all(a <= b for a, b in zip(early.sentence_steps, exact.sentence_steps))
    if lenpen > 0:  # the exact bound divides by the penalty at the length limit: loose, so early gains
        assert sum(early.sentence_steps) < sum(exact.sentence_steps)


class ForcedLength(Transformer):
    """Logits overridden after the real decoder ran: EOS is certain at output step `eos_at`, impossible
    before it (eos_at=None: never)."""

    eos_at = None

    def decode(self, tgt, memory=None, memory_mask=None, tgt_mask=None, cache=None):
        first = cache.length if cache is not None else 0
        logits = super().decode(tgt, memory, memory_mask, tgt_mask, cache).clone()
        step = first + tgt.size(1) - 1  # tokens already generated before the one being predicted
        logits[:, -1, EOS_ID] = -1e4
        if self.eos_at is not None and step == self.eos_at:
            logits[:, -1, EOS_ID] = 1e4
        return logits


@pytest.fixture
def forced():
    torch.manual_seed(4)
    return ForcedLength(CFG, VOCAB).eval()


@pytest.mark.parametrize("stop", ["exact", "early"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_stops_at_eos(forced, use_cache, stop):
    forced.eos_at = 3
    src = as_batch(make_sources(17))
    assert all(len(h.tokens) == 3 for h in greedy(forced, src, 20, use_cache))
    result = search(
        forced, src, SearchSettings(beam=3, lenpen=0.6, max_len_offset=20, nbest=3, stop=stop), use_cache=use_cache
    )
    for hyps in result.hypotheses:
        assert [len(h.tokens) for h in hyps] == [3, 3, 3]
    assert result.sentence_steps == [4] * src.size(0) and result.steps == 4  # 3 tokens + EOS


@pytest.mark.parametrize("offset", [1, 5])
def test_length_limit_is_source_length_plus_offset(forced, offset):
    forced.eos_at = None
    sources = make_sources(18, n=5)
    src = as_batch(sources)
    assert [len(h.tokens) for h in greedy(forced, src, offset)] == [len(s) + offset for s in sources]
    for stop in ("exact", "early"):
        for s, hyps in zip(sources, nbest_lists(forced, src, 2, 1.0, offset, nbest=2, stop=stop)):
            assert [len(h.tokens) for h in hyps] == [len(s) + offset] * 2


def test_length_limit_respects_max_positions(forced):
    forced.eos_at = None
    src = as_batch(make_sources(19, n=2))
    for h in greedy(forced, src, 500):
        assert len(h.tokens) == CFG.max_positions - 1  # BOS + tokens fill the position table


@pytest.mark.parametrize("beam", [1, 4])
def test_one_encoder_pass_one_new_token_per_step_and_steps_counted(trained, monkeypatch, beam):
    calls = {"encode": 0, "decode": []}
    encode, decode = trained.encode, trained.decode

    def counting_encode(*args, **kwargs):
        calls["encode"] += 1
        return encode(*args, **kwargs)

    def recording_decode(tgt, memory=None, memory_mask=None, tgt_mask=None, cache=None):
        calls["decode"].append((tgt.size(1), memory is None and tgt_mask is None, cache is not None))
        return decode(tgt, memory, memory_mask, tgt_mask, cache)

    monkeypatch.setattr(trained, "encode", counting_encode)
    monkeypatch.setattr(trained, "decode", recording_decode)
    src = as_batch(make_sources(20))
    result = search(trained, src, SearchSettings(beam=beam, lenpen=0.0, max_len_offset=10))
    assert calls["encode"] == 1
    assert all(call == (1, True, True) for call in calls["decode"])  # the cache alone feeds cross-attention
    assert result.steps == len(calls["decode"]) == max(result.sentence_steps)
    assert all(n >= len(h[0].tokens) + 1 for n, h in zip(result.sentence_steps, result.hypotheses))


@pytest.mark.parametrize("inference", [True, False])
def test_log_probs_are_the_log_softmax_of_the_newest_logits(trained, inference):
    """Decoder.log_probs writes its log_softmax over the logits on a CPU (no new tensor a step): the values are
    those of log_softmax itself, with BOS and PAD never emitted; with autograd recording, a plain log_softmax."""
    src = as_batch(make_sources(22))
    prefix = torch.tensor([[BOS_ID, 5, 6]] * src.size(0))
    memory_mask = padding_mask(src, PAD_ID)
    with torch.inference_mode(inference), torch.enable_grad():
        logits = trained.decode(prefix, trained.encode(src, memory_mask), memory_mask, causal_mask(3, src.device))
        expected = F.log_softmax(logits[:, -1], dim=-1)
        got = new_decoder(trained, src, use_cache=False).log_probs(prefix)
    assert got.requires_grad is not inference
    expected = expected.detach().clone()
    expected[:, [BOS_ID, PAD_ID]] = float("-inf")
    assert torch.equal(got.detach(), expected)
    assert got[:, 4:].isfinite().all()


def test_restores_training_mode(trained):
    trained.train()
    try:
        greedy(trained, as_batch(make_sources(21)), 5)
        assert trained.training
    finally:
        trained.eval()


def test_bad_arguments_are_errors(trained):
    src = as_batch(make_sources(21))
    for kwargs in ({"stop": "never"}, {"beam": 2, "nbest": 3}, {"beam": 0}):
        with pytest.raises(UserError):  # settings a search cannot run with do not exist
            search(trained, src, SearchSettings(**kwargs))
    with pytest.raises(ValueError):  # more hypotheses than the beam: only sampling's settings may ask for it
        search(trained, src, SearchSettings(beam=2, nbest=3, sample="topk:2"))


def test_result_type_is_the_same_for_every_beam(trained):
    src = as_batch(make_sources(21, n=3))
    for beam in (1, 2):
        result = search(trained, src, SearchSettings(beam=beam, nbest=1))
        assert isinstance(result, SearchResult) and len(result.hypotheses) == 3
        assert all(len(hyps) == 1 and isinstance(hyps[0], Hypothesis) for hyps in result.hypotheses)


def test_length_penalty_is_gnmt():
    assert length_penalty(1, 0.6) == pytest.approx(1.0)
    assert length_penalty(7, 1.0) == pytest.approx(2.0)
    assert length_penalty(100, 0.0) == 1.0


# ----------------------------------------------------------------------------- trace


@pytest.mark.parametrize("stop", ["exact", "early"])
@pytest.mark.parametrize("beam,nbest", [(1, 1), (3, 2), (4, 4)])
def test_trace_leaves_outputs_alone_and_ends_in_the_nbest(model, beam, nbest, stop):
    src = as_batch(make_sources(seed=21, n=5))
    plain = search(model, src, SearchSettings(beam=beam, lenpen=0.6, max_len_offset=5, nbest=nbest, stop=stop))
    trace = []
    traced = search(
        model, src, SearchSettings(beam=beam, lenpen=0.6, max_len_offset=5, nbest=nbest, stop=stop), trace=trace
    )
    assert_same(traced.hypotheses, plain.hypotheses)
    assert (traced.steps, traced.sentence_steps) == (plain.steps, plain.sentence_steps)
    assert len(trace) == plain.steps  # one entry per decoder step
    for row, hyps in enumerate(plain.hypotheses):
        # Every hypothesis the search finished is in the trace; the best nbest of them are what it returned.
        finished = [h for step in trace for h in step.finished[row]]
        assert_same([sorted(finished, key=lambda h: h.score, reverse=True)[:nbest]], [hyps])
        # The row takes part until its last step and no longer; live hypotheses grow by one token a step.
        last = plain.sentence_steps[row]
        assert not any(step.alive[row] or step.finished[row] for step in trace[last:])
        assert not trace[last - 1].alive[row]
        for t, step in enumerate(trace[: last - 1]):
            assert 1 <= len(step.alive[row]) <= beam
            assert all(len(h.tokens) == t + 1 for h in step.alive[row])
            scores = [h.score for h in step.alive[row]]
            assert scores == sorted(scores, reverse=True) and all(s <= 0 for s in scores)


def test_trace_steps_extend_earlier_live_hypotheses(trained):
    """Each live hypothesis (and each finished one) continues one that was alive the step before."""
    src = as_batch(make_sources(seed=22, n=3))
    trace = []
    search(trained, src, SearchSettings(beam=3, lenpen=0.6, max_len_offset=5, nbest=2), trace=trace)
    for before, after in zip(trace, trace[1:]):
        for row in range(src.size(0)):
            prefixes = {tuple(h.tokens) for h in before.alive[row]}
            assert all(tuple(h.tokens[:-1]) in prefixes for h in after.alive[row])
            assert all(tuple(h.tokens) in prefixes for h in after.finished[row])


# ----------------------------------------------------------------------------- a forced target prefix


def random_prefixes(seed: int, vocab: int, n: int, longest: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(4, vocab, (int(k),), generator=g).tolist()
        for k in torch.randint(0, longest + 1, (n,), generator=g)
    ]


@pytest.mark.parametrize("stop", ["exact", "early"])
def test_a_forced_prefix_starts_every_output_and_the_search_equals_the_reference(random_seed, stop):
    """Random models, beams, n-best sizes and prefixes (some empty): every hypothesis starts with its row's prefix,
    and the n-best lists are the plainly written rules' with the prefix forced (so "exact" keeps its guarantee
    among the hypotheses that start with the prefix)."""
    rng = torch.Generator().manual_seed(random_seed)
    for trial in range(6):
        model = random_model(random_seed + trial)
        beam = int(torch.randint(1, 5, (1,), generator=rng))
        nbest = int(torch.randint(1, beam + 1, (1,), generator=rng))
        sources = random_sources(random_seed + 50 + trial, model.output.out_features)
        prefixes = random_prefixes(random_seed + trial, model.output.out_features, len(sources))
        for use_cache in (True, False):
            found = search(
                model,
                as_batch(sources),
                SearchSettings(beam=beam, lenpen=0.6, max_len_offset=4, nbest=nbest, stop=stop),
                use_cache=use_cache,
                prefixes=prefixes,
            )
            for hyps, prefix in zip(found.hypotheses, prefixes):
                assert len(hyps) == nbest and all(h.tokens[: len(prefix)] == prefix for h in hyps)
        expected = [
            reference_search(model, s, beam, 0.6, 4, nbest, stop, prefix=tuple(p)) for s, p in zip(sources, prefixes)
        ]
        if beam > 1:  # greedy search: one hypothesis, EOS at its first chance; compared in the test below
            assert_same(found.hypotheses, expected)


def test_a_prefix_that_is_greedy_searchs_own_start_changes_nothing(model):
    src = as_batch(make_sources(23, n=8))
    plain = search(model, src, SearchSettings(beam=1, lenpen=0.6, max_len_offset=10))
    for cut in (1, 2, 100):
        prefixes = [h.tokens[:cut] for h in plain.best()]
        forced = search(model, src, SearchSettings(beam=1, lenpen=0.6, max_len_offset=10), prefixes=prefixes)
        assert [h.tokens for h in forced.best()] == [h.tokens for h in plain.best()]
        assert [h.score for h in forced.best()] == [h.score for h in plain.best()]


def test_no_prefix_is_the_plain_search_bit_for_bit(model):
    src = as_batch(make_sources(24))
    for beam in (1, 3):
        plain = search(model, src, SearchSettings(beam=beam, lenpen=0.6, max_len_offset=8, nbest=beam))
        for none in (None, [[] for _ in range(src.size(0))]):
            same = search(
                model, src, SearchSettings(beam=beam, lenpen=0.6, max_len_offset=8, nbest=beam), prefixes=none
            )
            assert [[(h.tokens, h.score) for h in hyps] for hyps in same.hypotheses] == [
                [(h.tokens, h.score) for h in hyps] for hyps in plain.hypotheses
            ]


def test_a_prefix_longer_than_the_length_limit_raises_it(forced):
    """The limit is at least the prefix: a prefix is never cut, and EOS is forced right after it when the source's
    own limit has passed."""
    forced.eos_at = None
    sources = make_sources(25, n=3, lo=2, hi=3)  # 2 pieces + EOS: a limit of 3 + offset 1 = 4
    prefixes = [[5] * 9, [6, 7], []]
    for beam in (1, 2):
        found = search(
            forced, as_batch(sources), SearchSettings(beam=beam, lenpen=0.6, max_len_offset=1), prefixes=prefixes
        )
        assert [h.tokens[:9] for h in found.best()][0] == [5] * 9
        assert [len(h.tokens) for h in found.best()] == [9, 4, 4]


def test_a_row_at_its_limit_ends_whatever_its_pick_chose(peaky):
    """The forced EOS at the limit is taken even from a pick that never chooses it (as a sampled distribution
    gone NaN once drew anything), so no output runs past model.max_positions."""

    def never_eos(lprobs, t, rows):
        return lprobs[:, 5], torch.full((lprobs.size(0),), 5)

    src = as_batch(make_sources(19, n=3))
    for offset in (2, 500):
        found = greedy_search(peaky, src, SearchSettings(beam=1, lenpen=0.0, max_len_offset=offset), pick=never_eos)
        limits = max_lengths(peaky, src, offset).tolist()
        assert [h.tokens for h in found.best()] == [[5] * n for n in limits]


# --------------------------------------------------------------------------- no repeated n-gram


def repeats(tokens: list[int], size: int) -> int:
    """How many of the n-grams of `size` tokens in `tokens` occur there before."""
    grams = [tuple(tokens[i : i + size]) for i in range(len(tokens) - size + 1)]
    return len(grams) - len(set(grams))


@pytest.mark.parametrize("stop", ["exact", "early"])
def test_no_repeated_ngram_is_the_plainly_written_rule(random_seed, stop):
    """Random models, beams, sizes and prefixes (some empty): the n-best lists are the plain rules' with every token
    that would repeat an n-gram ruled out after the prefix; greedy search is beam 1 under the early rule; an output
    without a prefix holds no n-gram twice."""
    rng = torch.Generator().manual_seed(random_seed)
    for trial in range(6):
        model = random_model(random_seed + 200 + trial)
        beam, size = int(torch.randint(1, 4, (1,), generator=rng)), int(torch.randint(1, 4, (1,), generator=rng))
        sources = random_sources(random_seed + 300 + trial, model.output.out_features)
        prefixes = random_prefixes(random_seed + 400 + trial, model.output.out_features, len(sources), longest=2)
        settings = SearchSettings(beam=beam, lenpen=0.6, max_len_offset=6, nbest=beam, stop=stop)
        found = search(model, as_batch(sources), replace(settings, no_repeat_ngram_size=size), prefixes=prefixes)
        rule = stop if beam > 1 else "early"
        expected = [
            reference_search(model, s, beam, 0.6, 6, beam, rule, prefix=tuple(p), no_repeat=size)
            for s, p in zip(sources, prefixes)
        ]
        assert_same(found.hypotheses, expected)
        for hyps, prefix in zip(found.hypotheses, prefixes):
            assert all(h.tokens[: len(prefix)] == prefix for h in hyps)
            assert prefix or all(repeats(h.tokens, size) == 0 for h in hyps)


@pytest.mark.parametrize("beam", [1, 3])
def test_a_copy_that_would_repeat_an_ngram_cannot(beam):
    """The copying model's output is its source: a source that repeats a phrase has a copy that repeats it, and
    with no_repeat_ngram_size the search gives the best output that does not; a source with nothing to repeat is
    copied as before, and 0 is off."""
    copier = copying_model(VOCAB, CFG.max_positions)
    sources = [[5, 6, 7, 5, 6, 8, 5, 6, 9, EOS_ID], [4, 4, 4, 4, EOS_ID], [9, 10, 11, 12, EOS_ID]]
    src = as_batch(sources)
    settings = SearchSettings(beam=beam, nbest=beam, max_len_offset=4)
    plain = search(copier, src, settings)
    assert [h.tokens for h in plain.best()] == [s[:-1] for s in sources]
    assert search(copier, src, replace(settings, no_repeat_ngram_size=0)).hypotheses == plain.hypotheses
    for size in (1, 2, 3):
        found = search(copier, src, replace(settings, no_repeat_ngram_size=size))
        for source, hyps in zip(sources, found.hypotheses):
            assert all(repeats(h.tokens, size) == 0 for h in hyps), (size, source, hyps)
            copy = source[:-1]
            assert (hyps[0].tokens == copy) == (repeats(copy, size) == 0), (size, source, hyps[0])
        if size == 2 and beam == 1:  # greedy copies until the copy would repeat (5, 6), then takes another piece
            assert found.best()[0].tokens[:4] == [5, 6, 7, 5] and found.best()[0].tokens[4] != 6


def repeating_lines(n: int) -> list[str]:
    """Sentences of the copying checkpoint's words that repeat a phrase: a copy repeats it."""
    rng = random.Random(3)
    lines = []
    for _ in range(n):
        phrase = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 2)))
        between = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 2)))
        lines.append(" ".join(f"{phrase} {between} {phrase}".split()))
    return lines


@pytest.mark.parametrize("beam", [1, 3])
def test_ctranslate2_keeps_the_same_ngrams_out(ctranslate2, copy_model, beam):
    """CTranslate2's no_repeat_ngram_size on the same checkpoint: greedy outputs and scores are ours. Its beam ranks
    by scores renormalised over the tokens left (a logits processor), so it may keep another beam: where it gives
    our output its score is ours (scored again), and elsewhere ours scores at least as well; neither holds an
    n-gram twice."""
    lines = repeating_lines(30)
    for size in (2, 3):
        flags = {"beam": beam, "nbest": beam, "lenpen": 0.0, "no_repeat_ngram_size": size}
        ours = Translator(copy_model, "cpu", SearchFlags(**flags, stop="exact"))
        theirs = Translator(copy_model, "cpu", SearchFlags(**flags, engine="ctranslate2"))
        ids = ours.encode(lines)
        mine, other = ours.search(ids), theirs.search(ids)
        assert sum(a[0].tokens != s for a, s in zip(mine, ids)) >= len(lines) // 2  # the option did change copies
        same = 0
        for a, b in zip(mine, other):
            assert all(repeats(h.tokens, size) == 0 for h in a + b)
            if a[0].tokens == b[0].tokens:
                same += 1
                assert a[0].score == pytest.approx(b[0].score, abs=1e-3)
            else:
                assert b[0].score <= a[0].score + 1e-3
        assert same == len(lines) if beam == 1 else same >= len(lines) // 3  # measured at beam 3: 17 of 30
