"""The lexical shortlist (shortlist.py): lists ranked by co-occurrence, the vmap file both ways, a search that
scores only a batch's candidates (a list of the whole vocabulary changes nothing, a piece left out is never emitted,
a forced prefix's and a constraint's pieces are kept), `transformer shortlist` and --shortlist on both engines."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import sentences, write_copying_checkpoint
from tests.inference.test_search import as_batch, random_model, random_sources
from transformer.data.vocab import EOS_ID, UNK_ID
from transformer.errors import UserError
from transformer.inference.constraints import constrained_search
from transformer.inference.ensemble import Ensemble
from transformer.inference.sampling import sample_search
from transformer.inference.search import search
from transformer.inference.settings import SearchFlags, SearchSettings, generate_keywords
from transformer.inference.shortlist import Shortlist, ShortlistOutput, build, load, save
from transformer.inference.translator import Translator
from transformer.model.transformer import Transformer
from transformer.run_dir import RunDir


def whole(vocab: int) -> Shortlist:
    """A list that leaves nothing out."""
    return Shortlist(np.arange(vocab), np.zeros(vocab + 1, np.int64), np.zeros(0, np.int64))


def only(vocab: int, allowed: list[int]) -> Shortlist:
    """A list whose candidates are `allowed` (and EOS, UNK) whatever the source."""
    return Shortlist(np.unique([EOS_ID, UNK_ID, *allowed]), np.zeros(vocab + 1, np.int64), np.zeros(0, np.int64))


def restricted(model, shortlist: Shortlist):
    model.shortlist = ShortlistOutput(shortlist, model.output.weight, model.output.bias)
    return model


def another(model: Transformer, seed: int) -> Transformer:
    """A model of `model`'s shape and vocabulary with other weights: an ensemble's second member."""
    torch.manual_seed(seed)
    other = Transformer(model.cfg, model.output.out_features)
    with torch.no_grad():
        other.output.weight.mul_(3.0)
    return other.eval()


def lists(found) -> list[list[tuple[list[int], float]]]:
    return [[(h.tokens, h.score) for h in hyps] for hyps in found.hypotheses]


def test_build_ranks_the_pieces_seen_together_and_drops_a_pair_seen_once():
    # Piece 10 is always translated with 20, half the time with 21 too; 11 with 22; 23 appears once beside 10;
    # 24 twice beside 10, as 21 is, but also without it (a lower Dice), so third: cut by per_piece.
    pairs = [([10, 5], [20, 21, 6]), ([10], [20]), ([10, 11], [20, 22, 21]), ([11], [22]), ([10], [20, 23])]
    pairs += [([10], [20, 24]), ([10], [20, 24]), ([12], [24])]
    table = build(pairs, vocab_size=30, always=[EOS_ID], frequent=1, per_piece=2, min_pairs=2)
    of = {s: table.targets[table.starts[s] : table.starts[s + 1]].tolist() for s in range(30)}
    assert of[10] == [20, 21]  # best first; 22 and 23 (once each) are not kept, 24 (third) is cut
    wider = build(pairs, vocab_size=30, always=[EOS_ID], frequent=1, per_piece=3, min_pairs=2)
    assert wider.targets[wider.starts[10] : wider.starts[11]].tolist() == [20, 21, 24]
    assert of[11] == [22]
    assert of[5] == []  # seen once with each target piece
    assert table.always.tolist() == [EOS_ID, 20]  # the one most frequent target piece, and the specials


def test_build_counts_in_chunks_as_at_once(monkeypatch):
    """Counted as it goes (memory follows the distinct piece pairs): chunks of one pair give the same list."""
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(4, 40, rng.integers(1, 8)), rng.integers(4, 40, rng.integers(1, 8))) for _ in range(300)]
    at_once = build(pairs, 40, [EOS_ID], frequent=3, per_piece=4)
    monkeypatch.setattr("transformer.inference.shortlist.CHUNK", 1)
    chunked = build(pairs, 40, [EOS_ID], frequent=3, per_piece=4)
    assert len(at_once.targets) > 40
    for name in ("always", "starts", "targets"):
        assert np.array_equal(getattr(chunked, name), getattr(at_once, name)), name


def test_the_vmap_file_reads_back_as_written_in_ctranslate2s_format(tmp_path):
    # Lines end at "\n" and pieces at " " only, as CTranslate2 reads them: other spaces belong to a piece.
    pieces = [f"p{i}" for i in range(10)] + ["p\u2028x", "p\x85y"]
    pairs = [([4, 5], [6, 7]), ([4], [6]), ([5], [7, 8]), ([5, 4], [7, 6]), ([10, 11], [11, 10])] + [([10], [11])]
    table = build(pairs, 12, [EOS_ID], frequent=1)
    assert table.targets[table.starts[10] : table.starts[11]].tolist() == [11]  # both odd pieces in the file
    path = tmp_path / "shortlist.txt"
    save(table, pieces, path)
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]
    assert lines[0].startswith("\t")  # the empty key: the pieces every batch scores
    assert all(line.count("\t") == 1 and " " not in line.split("\t")[0] for line in lines)
    again = load(path, {p: i for i, p in enumerate(pieces)}, [EOS_ID])
    for name in ("always", "starts", "targets"):
        assert np.array_equal(getattr(again, name), getattr(table, name)), name


def test_a_list_for_another_vocabulary_or_a_torn_line_is_one_line_error(tmp_path):
    piece_ids = {"a": 0, "b": 1}
    path = tmp_path / "shortlist.txt"
    path.write_text("a\tb zz\n", encoding="utf-8")
    with pytest.raises(UserError, match="'zz' is not a piece"):
        load(path, piece_ids, [])
    path.write_text("a b\n", encoding="utf-8")
    with pytest.raises(UserError, match="line 1: expected"):
        load(path, piece_ids, [])
    # CTranslate2 keeps a repeated piece's last line, a union would keep both: refused, so both engines agree.
    path.write_text("\ta\na\tb\nb\ta\na\ta\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"line 4: 'a' has a line already \(line 2\)"):
        load(path, piece_ids, [])
    with pytest.raises(UserError, match="transformer shortlist"):
        load(tmp_path / "none.txt", piece_ids, [])


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("variant", ["plain", "no repeats", "prefix", "ensemble"])
def test_a_list_of_the_whole_vocabulary_changes_nothing(beam, variant, random_seed):
    """Its columns are the ids in order: every rule that maps ids to columns (n-gram bans, a forced prefix, an
    ensemble's members) must give the same hypotheses and scores as no list."""
    model = random_model(random_seed)
    vocab = model.output.out_features
    src = as_batch(random_sources(random_seed, vocab, n=6))
    repeats = 2 if variant == "no repeats" else 0
    settings = SearchSettings(beam=beam, lenpen=0.6, max_len_offset=6, nbest=beam, no_repeat_ngram_size=repeats)
    prefixes = [[5, 4][: i % 3] for i in range(src.size(0))] if variant == "prefix" else None
    searched = Ensemble([model, another(model, random_seed + 1)]) if variant == "ensemble" else model
    plain = lists(search(searched, src, settings, prefixes=prefixes))
    for member in searched.models if variant == "ensemble" else [model]:
        restricted(member, whole(vocab))
    assert lists(search(searched, src, settings, prefixes=prefixes)) == plain


def test_sampling_from_a_list_of_the_whole_vocabulary_draws_the_same(random_seed):
    model = random_model(random_seed)
    vocab = model.output.out_features
    src = as_batch(random_sources(random_seed, vocab, n=6))
    settings = SearchSettings(beam=1, lenpen=0.6, max_len_offset=6, nbest=3, sample="topk:5", seed=7)
    plain = lists(sample_search(model, src, settings))
    assert lists(sample_search(restricted(model, whole(vocab)), src, settings)) == plain


@pytest.mark.parametrize("beam", [1, 4])
def test_a_piece_left_out_is_never_emitted_and_the_candidates_share_all_probability(beam, random_seed):
    model = random_model(random_seed)
    vocab = model.output.out_features
    src = as_batch(random_sources(random_seed + 1, vocab, n=6))
    settings = SearchSettings(beam=beam, lenpen=0.6, max_len_offset=6, nbest=beam)
    emitted = {t for hyps in search(model, src, settings).hypotheses for h in hyps for t in h.tokens}
    allowed = sorted(emitted)[: max(1, len(emitted) // 2)]  # half of what it says unrestricted
    restricted(model, only(vocab, allowed))
    found = search(model, src, settings)
    said = {t for hyps in found.hypotheses for h in hyps for t in h.tokens}
    assert said <= {*allowed, UNK_ID, EOS_ID}  # what only() lists
    from transformer.inference.search import Decoder

    decoder = Decoder(model, src, use_cache=True)
    lprobs = decoder.log_probs(torch.full((src.size(0), 1), model.specials.bos))
    assert lprobs.shape == (src.size(0), len(decoder.candidates))  # a column per candidate
    assert torch.allclose(lprobs.exp().sum(dim=1), torch.ones(src.size(0)), atol=1e-5)
    assert torch.equal(decoder.token(torch.arange(len(decoder.candidates))), decoder.candidates)
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[decoder.candidates] = False
    assert torch.isinf(decoder.widen(lprobs)[:, outside]).all()


def per_source(vocab: int) -> Shortlist:
    """A list under which each source piece s brings s + 1 and s + 2: sentences of other pieces, other candidates."""
    targets = np.array([[(s + 1) % vocab, (s + 2) % vocab] for s in range(vocab)], np.int64).ravel()
    return Shortlist(np.array([EOS_ID, UNK_ID]), np.arange(0, 2 * vocab + 1, 2, dtype=np.int64), targets)


@pytest.mark.parametrize("beam", [1, 4])
def test_a_sentence_scores_its_own_candidates_whatever_its_batch_mates(beam, random_seed):
    """The batch shares one projection onto the union of its sources' candidates, but each sentence's softmax is
    over its own: it emits only those, and its first step's distribution is the one it gets alone."""
    model = random_model(random_seed)
    vocab = model.output.out_features
    table = per_source(vocab)
    # Two sources of one piece each, 4 and 9, whose lists (5, 6 and 10, 11) no other piece of theirs brings: their
    # own candidates are fewer than the batch's by construction.
    src = as_batch(random_sources(random_seed + 3, vocab, n=6) + [[4, EOS_ID], [9, EOS_ID]])
    restricted(model, table)
    found = search(model, src, SearchSettings(beam=beam, lenpen=0.6, max_len_offset=6, nbest=beam))
    from transformer.inference.search import Decoder

    together = Decoder(model, src, use_cache=True)
    first = together.widen(together.log_probs(torch.full((src.size(0), 1), model.specials.bos)))
    for i, hyps in enumerate(found.hypotheses):
        own = set(table.candidates(src[i : i + 1])[0].tolist())
        assert {t for h in hyps for t in h.tokens} <= own
        alone = Decoder(model, src[i : i + 1], use_cache=True)
        assert len(alone.candidates) <= len(together.candidates)
        assert len(alone.candidates) < len(together.candidates) or i < src.size(0) - 2
        mine = alone.widen(alone.log_probs(torch.full((1, 1), model.specials.bos)))[0]
        assert torch.equal(torch.isinf(first[i]), torch.isinf(mine))
        assert torch.allclose(first[i][~torch.isinf(mine)], mine[~torch.isinf(mine)], atol=1e-5)


class OffTheList(torch.nn.Module):
    """An output projection whose logits are -inf off `allowed`: a model without a list that means the list."""

    def __init__(self, output: torch.nn.Linear, allowed: list[int]):
        super().__init__()
        self.inner, self.out_features = output, output.out_features
        self.register_buffer("off", torch.ones(output.out_features, dtype=torch.bool))
        self.off[allowed] = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).masked_fill(self.off, float("-inf"))


@pytest.mark.parametrize("variant", ["plain", "no repeats", "prefix", "ensemble", "length limit", "hf", "sampling"])
def test_a_list_that_leaves_pieces_out_searches_as_a_model_that_gives_them_no_probability(variant, random_seed):
    """The oracle for the columns: with a list that leaves pieces out, every rule that maps ids to columns (n-gram
    bans, EOS and the length limit, a forced prefix, an ensemble, sampling's draws) gives what the same models give
    without a list when the pieces off it get -inf logits."""
    model = random_model(random_seed)
    vocab = model.output.out_features
    allowed = [EOS_ID, UNK_ID, *range(4, vocab, 2)]
    src = as_batch(random_sources(random_seed + 4, vocab, n=6))
    settings = SearchSettings(
        beam=1 if variant == "sampling" else 3,
        lenpen=0.6,
        max_len_offset=1 if variant == "length limit" else 6,
        nbest=3,
        no_repeat_ngram_size=2 if variant == "no repeats" else 0,
        stop="hf" if variant == "hf" else "exact",
        sample="topk:5" if variant == "sampling" else None,
        seed=7 if variant == "sampling" else None,
    )
    prefixes = [[4, 6][: i % 3] for i in range(src.size(0))] if variant == "prefix" else None
    members = [model, another(model, random_seed + 1)] if variant == "ensemble" else [model]

    def run(models):
        searched = models[0] if len(models) == 1 else Ensemble(models)
        if variant == "sampling":
            return lists(sample_search(searched, src, settings))
        return lists(search(searched, src, settings, prefixes=prefixes))

    import copy

    oracles = [copy.deepcopy(m) for m in members]
    for oracle in oracles:
        oracle.output = OffTheList(oracle.output, allowed)
    expected = run(oracles)
    got = run([restricted(m, only(vocab, allowed)) for m in members])
    assert [[tokens for tokens, _ in hyps] for hyps in got] == [[tokens for tokens, _ in hyps] for hyps in expected]
    for hyps, wanted in zip(got, expected):
        assert np.allclose([score for _, score in hyps], [score for _, score in wanted], atol=1e-4)


def test_a_forced_prefix_and_a_constraint_outside_the_list_are_still_met(random_seed):
    model = random_model(random_seed)
    vocab = model.output.out_features
    src = as_batch(random_sources(random_seed + 2, vocab, n=4))
    restricted(model, only(vocab, [4, 5, 6]))
    prefix, phrase = [vocab - 1, vocab - 2], [vocab - 3, vocab - 4]  # none of them on the list
    settings = SearchSettings(beam=3, lenpen=0.6, max_len_offset=8)
    forced = search(model, src, settings, prefixes=[prefix] * 4)
    assert all(h.tokens[:2] == prefix and h.score > float("-inf") for h in forced.best())
    constrained = constrained_search(model, src, [[phrase]] * 4, settings)
    for hyps in constrained.hypotheses:
        assert hyps, "every sentence has room for the phrase"
        tokens = hyps[0].tokens
        assert any(tokens[i : i + 2] == phrase for i in range(len(tokens) - 1))


def copy_run(tmp_path):
    """A copying model's run directory with train and valid splits whose targets are their sources: each piece's
    list holds the piece itself."""
    checkpoint = write_copying_checkpoint(tmp_path / "final.pt")
    for split, seed, n in (("train", 1, 200), ("valid", 2, 20)):
        text = "\n".join(sentences(seed, n)) + "\n"
        for lang in ("de", "en"):
            (tmp_path / f"{split}.{lang}").write_text(text, encoding="utf-8")
    return checkpoint


def test_the_command_writes_the_list_and_a_copying_model_translates_the_same_with_it(tmp_path, call):
    checkpoint = copy_run(tmp_path)
    status, out, err = call("translate", checkpoint, "--shortlist", "--dtype", "fp32", stdin="der hund\n")
    assert status == 2 and "transformer shortlist" in err
    status, out, _ = call("shortlist", tmp_path, "--frequent", "5")
    assert status == 0 and "100.0% of its reference's pieces" in out
    assert (tmp_path / RunDir.SHORTLIST).is_file()
    lines = sentences(3, 8)
    plain = Translator(checkpoint, "cpu", SearchFlags(dtype="fp32")).translate(lines)
    for dtype in ("fp32", "bf16", "int8"):
        short = Translator(checkpoint, "cpu", SearchFlags(dtype=dtype, shortlist=True))
        assert short.translate(lines) == plain, dtype


def test_ctranslate2_reads_the_list_as_its_vocabulary_map(tmp_path, ctranslate2):
    checkpoint = copy_run(tmp_path)
    flags = SearchFlags(dtype="fp32", engine="ctranslate2", shortlist=True)
    with pytest.raises(UserError, match="transformer shortlist"):
        Translator(checkpoint, "cpu", flags)
    assert not (tmp_path / RunDir.CT2).exists()  # said before converting
    from transformer.inference.shortlist import write_shortlist

    write_shortlist(str(tmp_path), None, None, frequent=5)
    lines = sentences(4, 8)
    ct2 = Translator(checkpoint, "cpu", flags, keep_model=True)
    assert (tmp_path / RunDir.CT2 / "final" / "vmap.txt").is_file()
    assert ct2.model.shortlist is not None  # the copy serve keeps for its traces searches as CTranslate2 does
    assert ct2.translate(lines) == Translator(checkpoint, "cpu", SearchFlags(dtype="fp32")).translate(lines)


def test_the_setting_names_its_results_and_generate_refuses_it():
    assert SearchSettings(shortlist=True).describe().endswith(".shortlist")
    assert SearchSettings().describe() == "beam4.lp0.6"
    with pytest.raises(UserError, match="no lexical shortlist"):
        generate_keywords(SearchSettings(shortlist=True))


@pytest.mark.parametrize("engine", ["ours", "ctranslate2"])
def test_a_list_that_leaves_pieces_out_keeps_them_out_of_the_output_on_both_engines(tmp_path, engine):
    if engine == "ctranslate2":
        pytest.importorskip("ctranslate2")
    checkpoint = copy_run(tmp_path)
    plain = Translator(checkpoint, "cpu", SearchFlags(dtype="fp32"))
    pieces = plain.vocab.pieces(range(len(plain.vocab)))
    lines = sentences(6, 8)
    copied = sorted({p for ids in plain.encode(lines) for p in plain.vocab.pieces(ids)})
    allowed = copied[::2]  # half of the pieces a copy needs
    (tmp_path / RunDir.SHORTLIST).write_text("\t" + " ".join(allowed) + "\n", encoding="utf-8")
    short = Translator(checkpoint, "cpu", SearchFlags(dtype="fp32", engine=engine, shortlist=True))
    sources = plain.encode(lines)
    found = [hyps[0].tokens for hyps in short.search(sources)]
    assert {p for tokens in found for p in plain.vocab.pieces(tokens)} <= {*allowed, pieces[UNK_ID]}
    assert found != [hyps[0].tokens for hyps in plain.search(sources)]
