"""Behaviour of greedy and beam search on tiny seeded models (random, peaky, and briefly trained)."""

import pytest
import torch

from transformer.batch import Batch, pad_sequences
from transformer.config import ModelConfig
from transformer.model import Transformer
from transformer.search import Hypothesis, beam_search, greedy_search, length_penalty
from transformer.vocab import EOS_ID, PAD_ID

VOCAB = 24
CFG = ModelConfig(d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=64,
                  dropout=0.0, max_positions=64)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: a second intra-op thread only adds spin-waiting, badly so on a loaded 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_sources(seed: int, n: int = 6, lo: int = 2, hi: int = 9) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(4, VOCAB, (length,), generator=g).tolist() + [EOS_ID] for length in lengths]


def as_batch(sources: list[list[int]]) -> torch.Tensor:
    return pad_sequences(sources, pad_id=PAD_ID)  # (B, S)


@pytest.fixture(scope="module")
def trained():
    """A copy-task model after a few hundred updates: peaky, and it emits EOS at varied lengths."""
    torch.manual_seed(0)
    model = Transformer(CFG, VOCAB)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(150):
        lengths = torch.randint(2, 9, (32,), generator=g).tolist()
        seqs = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]
        batch = Batch.from_pairs([(s, s) for s in seqs])
        logits = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch.tgt_out, ignore_index=PAD_ID)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def peaky():
    """Random weights with scaled-up logits, so the argmax is rarely a near-tie."""
    torch.manual_seed(3)
    model = Transformer(CFG, VOCAB)
    with torch.no_grad():
        model.output.weight.mul_(4.0)
    return model.eval()


@pytest.fixture(params=["trained", "peaky"])
def model(request):
    return request.getfixturevalue(request.param)


def test_trained_fixture_stops_at_varied_lengths(trained):
    out = greedy_search(trained, as_batch(make_sources(5, n=8)), max_len_offset=20)
    lengths = {len(h.tokens) for h in out}
    assert len(lengths) > 1 and max(lengths) < 8 + 1 + 20  # EOS reached before the limit, not a constant


def test_beam_one_equals_greedy(model):
    src = as_batch(make_sources(11))
    greedy = greedy_search(model, src, max_len_offset=10)
    beam = beam_search(model, src, beam=1, lenpen=0.0, max_len_offset=10)
    assert [h.tokens for h in greedy] == [b[0].tokens for b in beam]
    assert [h.score for h in greedy] == pytest.approx([b[0].score for b in beam], abs=1e-5)


@pytest.mark.parametrize("beam", [1, 3])
def test_cached_equals_uncached(model, beam):
    src = as_batch(make_sources(12))
    if beam == 1:
        cached, plain = greedy_search(model, src, 8), greedy_search(model, src, 8, use_cache=False)
    else:
        cached = [h for hs in beam_search(model, src, beam, 0.6, 8, nbest=beam) for h in hs]
        plain = [h for hs in beam_search(model, src, beam, 0.6, 8, nbest=beam, use_cache=False) for h in hs]
    assert [h.tokens for h in cached] == [h.tokens for h in plain]
    assert [h.score for h in cached] == pytest.approx([h.score for h in plain], abs=1e-4)


def test_larger_length_penalty_never_shortens(trained):
    src = as_batch(make_sources(13, n=10))
    lengths = [[len(hs[0].tokens) for hs in beam_search(trained, src, 4, alpha, 15)] for alpha in (0.0, 0.3, 0.6, 1.0, 2.0)]
    for shorter_alpha, longer_alpha in zip(lengths, lengths[1:]):
        assert all(a <= b for a, b in zip(shorter_alpha, longer_alpha))
    assert lengths[0] != lengths[-1]  # the penalty did change some choice: the check above was not vacuous


@pytest.mark.parametrize("beam", [1, 4])
def test_batched_equals_one_at_a_time(model, beam):
    sources = make_sources(14, n=7, lo=1, hi=12)  # very different lengths: lots of padding
    batched = beam_search(model, as_batch(sources), beam, 0.6, 10, nbest=beam)
    single = [beam_search(model, as_batch([s]), beam, 0.6, 10, nbest=beam)[0] for s in sources]
    for b, s in zip(batched, single):
        assert [h.tokens for h in b] == [h.tokens for h in s]
        assert [h.score for h in b] == pytest.approx([h.score for h in s], abs=1e-4)
    g_batched = greedy_search(model, as_batch(sources), 10)
    g_single = [greedy_search(model, as_batch([s]), 10)[0] for s in sources]
    assert [h.tokens for h in g_batched] == [h.tokens for h in g_single]


def test_nbest_sorted_distinct_and_scored(trained):
    src = as_batch(make_sources(15))
    for hyps in beam_search(trained, src, beam=5, lenpen=0.6, max_len_offset=10, nbest=3):
        assert len(hyps) == 3
        assert all(isinstance(h, Hypothesis) for h in hyps)
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == 3
        assert all(EOS_ID not in h.tokens and PAD_ID not in h.tokens for h in hyps)


def test_beam_not_worse_than_greedy_under_its_objective(trained):
    """With lenpen 0 the beam's score is a log-probability, so a wider beam can only find better ones."""
    src = as_batch(make_sources(16, n=8))
    greedy = greedy_search(trained, src, 10)
    beam = beam_search(trained, src, beam=4, lenpen=0.0, max_len_offset=10)
    assert all(b[0].score >= g.score - 1e-5 for g, b in zip(greedy, beam))


class ForcedLength(Transformer):
    """Logits overridden after the real decoder ran: EOS is certain at output step `eos_at`, impossible
    before it (eos_at=None: never)."""

    eos_at = None

    def decode(self, tgt, memory, memory_mask, tgt_mask=None, cache=None):
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


@pytest.mark.parametrize("use_cache", [True, False])
def test_stops_at_eos(forced, use_cache):
    forced.eos_at = 3
    src = as_batch(make_sources(17))
    assert all(len(h.tokens) == 3 for h in greedy_search(forced, src, 20, use_cache))
    for hyps in beam_search(forced, src, 3, 0.6, 20, nbest=3, use_cache=use_cache):
        assert [len(h.tokens) for h in hyps] == [3, 3, 3]


@pytest.mark.parametrize("offset", [1, 5])
def test_length_limit_is_source_length_plus_offset(forced, offset):
    forced.eos_at = None
    sources = make_sources(18, n=5)
    src = as_batch(sources)
    assert [len(h.tokens) for h in greedy_search(forced, src, offset)] == [len(s) + offset for s in sources]
    for s, hyps in zip(sources, beam_search(forced, src, 2, 1.0, offset, nbest=2)):
        assert [len(h.tokens) for h in hyps] == [len(s) + offset] * 2


def test_length_limit_respects_max_positions(forced):
    forced.eos_at = None
    src = as_batch(make_sources(19, n=2))
    for h in greedy_search(forced, src, max_len_offset=500):
        assert len(h.tokens) == CFG.max_positions - 1  # BOS + tokens fill the position table


def test_one_encoder_pass_and_one_new_token_per_step(trained, monkeypatch):
    calls = {"encode": 0, "decode": []}
    encode, decode = trained.encode, trained.decode

    def counting_encode(*args, **kwargs):
        calls["encode"] += 1
        return encode(*args, **kwargs)

    def recording_decode(tgt, memory, memory_mask, tgt_mask=None, cache=None):
        calls["decode"].append((tgt.size(1), tgt_mask is None, cache is not None))
        return decode(tgt, memory, memory_mask, tgt_mask, cache)

    monkeypatch.setattr(trained, "encode", counting_encode)
    monkeypatch.setattr(trained, "decode", recording_decode)
    src = as_batch(make_sources(20))
    out = beam_search(trained, src, beam=4, lenpen=0.0, max_len_offset=10)
    assert calls["encode"] == 1
    assert all(call == (1, True, True) for call in calls["decode"])
    assert len(calls["decode"]) >= max(len(h[0].tokens) for h in out) + 1


def test_restores_training_mode(trained):
    trained.train()
    try:
        greedy_search(trained, as_batch(make_sources(21)), 5)
        assert trained.training
    finally:
        trained.eval()


def test_length_penalty_is_gnmt():
    assert length_penalty(1, 0.6) == pytest.approx(1.0)
    assert length_penalty(7, 1.0) == pytest.approx(2.0)
    assert length_penalty(100, 0.0) == 1.0
