"""Ensembles (ensemble.py, search.EnsembleDecoder): an ensemble of one model is that model and one of two copies
gives its outputs, bit for bit; a hypothesis's score is the mean of the members'; vocabularies must agree; the
command line takes several run directories or a repeated --checkpoint."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import SENTENCES, sampling_settings, sentences, translation_config, write_checkpoint
from tests.inference.test_search import CFG, VOCAB, as_batch, make_sources
from transformer.config import ModelConfig
from transformer.data.batch import causal_mask, padding_mask
from transformer.data.vocab import BOS_ID, EOS_ID, train_vocab
from transformer.errors import UserError
from transformer.inference.ensemble import Ensemble
from transformer.inference.sampling import Sampler, sample_search
from transformer.inference.search import length_penalty, search
from transformer.inference.settings import SearchFlags, SearchSettings
from transformer.inference.translator import Translator
from transformer.model.transformer import Transformer


def model(seed: int, cfg: ModelConfig = CFG) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(cfg, VOCAB)
    with torch.no_grad():
        m.output.weight.mul_(3.0)
    return m.eval()


def lists(found) -> list[list[tuple[list[int], float]]]:
    return [[(h.tokens, h.score) for h in hyps] for hyps in found.hypotheses]


@pytest.mark.parametrize("beam", [1, 4])
def test_an_ensemble_of_one_model_is_that_model_and_of_two_copies_gives_its_outputs(beam):
    one = model(1)
    src = as_batch(make_sources(3))
    alone = lists(search(one, src, SearchSettings(beam=beam, lenpen=0.6, max_len_offset=8, nbest=beam)))
    assert (
        lists(search(Ensemble([one]), src, SearchSettings(beam=beam, lenpen=0.6, max_len_offset=8, nbest=beam)))
        == alone
    )
    assert (
        lists(
            search(
                Ensemble([one, copy.deepcopy(one)]),
                src,
                SearchSettings(beam=beam, lenpen=0.6, max_len_offset=8, nbest=beam),
            )
        )
        == alone
    )
    sampler = Sampler("topp", 0.9, seed=4)
    drawn = lists(sample_search(one, src, sampling_settings(sampler, lenpen=0.6, max_len_offset=8, nbest=2)))
    assert (
        lists(
            sample_search(
                Ensemble([one, copy.deepcopy(one)]),
                src,
                sampling_settings(sampler, lenpen=0.6, max_len_offset=8, nbest=2),
            )
        )
        == drawn
    )


def forced_score(m: Transformer, source: list[int], tokens: list[int]) -> float:
    src = torch.tensor([source])
    tgt = torch.tensor([[BOS_ID] + tokens])
    with torch.no_grad():
        logits = m(src, tgt, padding_mask(src), causal_mask(tgt.size(1)))
    lprobs = F.log_softmax(logits[0].float(), dim=-1)
    return lprobs[torch.arange(len(tokens) + 1), torch.tensor(tokens + [EOS_ID])].sum().item()


def test_a_hypothesis_score_is_the_mean_of_the_members_scores_and_their_shapes_may_differ():
    """Log-probabilities averaged per step: a hypothesis's summed score is the mean of each member's summed
    score of it. Members of other widths and depths share the vocabulary; the ensemble takes the smallest
    max_positions."""
    small = ModelConfig(d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32, max_positions=40)
    members = [model(1), model(2, small)]
    ensemble = Ensemble(members)
    assert ensemble.cfg.max_positions == 40 and ensemble.cfg.d_model == CFG.d_model
    sources = make_sources(5, n=4)
    found = search(ensemble, as_batch(sources), SearchSettings(beam=3, lenpen=0.6, max_len_offset=6, nbest=2))
    for source, hyps in zip(sources, found.hypotheses):
        for h in hyps:
            mean = sum(forced_score(m, source, h.tokens) for m in members) / len(members)
            assert h.score == pytest.approx(mean / length_penalty(len(h.tokens) + 1, 0.6), abs=1e-4)
    hyps = [h for hyps in found.hypotheses for h in hyps]
    assert sum(len(h.tokens) > 0 for h in hyps) >= len(hyps) // 2  # not only the empty output


def test_the_translator_loads_an_ensemble_and_refuses_other_vocabularies(run, tmp_path):
    members = [run / "step_00000100.pt", run / "step_00000200.pt"]
    ensemble = Translator(members, "cpu", SearchFlags(dtype="fp32"))
    assert isinstance(ensemble.model, Ensemble) and len(ensemble.model) == 2
    one = Translator(members[0], "cpu", SearchFlags(dtype="fp32"))
    assert ensemble.parameters == 2 * one.parameters
    assert Translator([members[0]], "cpu").translate(SENTENCES) == one.translate(SENTENCES)
    vocab = train_vocab(sentences(9, 300), vocab_size=70)
    write_checkpoint(tmp_path / "other.pt", translation_config(tmp_path, tmp_path), vocab, seed=1)
    with pytest.raises(UserError, match=r"^ensemble: .*other\.pt has a vocabulary of 70 pieces .* one vocabulary$"):
        Translator([members[0], tmp_path / "other.pt"], "cpu")
    with pytest.raises(UserError, match="^an ensemble runs on --engine ours only"):
        Translator(members, "cpu", SearchFlags(engine="ctranslate2"))


def test_the_command_line_takes_several_runs_or_a_repeated_checkpoint(run, call, tmp_path):
    a, b = run / "step_00000100.pt", run / "step_00000200.pt"
    expected = Translator([a, b], "cpu", SearchFlags(dtype="fp32")).translate(SENTENCES)
    status, out, err = call("translate", a, b, *SENTENCES, "--dtype", "fp32")
    assert status == 0, err
    assert out.splitlines() == expected
    status, out, err = call("translate", "--checkpoint", a, "--checkpoint", b, *SENTENCES, "--dtype", "fp32")
    assert status == 0 and out.splitlines() == expected, err
    # A sentence that is not a checkpoint stays a sentence, even when it names a file.
    (tmp_path / "notes.txt").write_text("x\n")
    status, out, err = call("translate", a, tmp_path / "notes.txt", "--dtype", "fp32")
    assert status == 0 and len(out.splitlines()) == 1, err
    status, out, err = call("evaluate", a, b, "--split", "test", "--dtype", "fp32")
    assert status == 0, err
    record = json.loads((run / "eval" / "step_00000100.test.beam3.lp0.6.ensemble2.json").read_text())
    assert record["ensemble"] == [str(a), str(b)]
