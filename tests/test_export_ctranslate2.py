"""The CTranslate2 export computes our model: same token log-probabilities, same greedy translations."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.trainutil import ROOT, tiny_config
from transformer.batch import causal_mask, pad_sequences, padding_mask
from transformer.checkpoint import load_model
from transformer.config import from_dict
from transformer.search import greedy_search
from transformer.train import train
from transformer.vocab import BOS_ID, EOS_ID

ctranslate2 = pytest.importorskip("ctranslate2")
sys.path.insert(0, str(ROOT / "scripts"))
from export_ctranslate2 import export  # noqa: E402

SOURCES = ["der mann sitzt auf dem haus", "eine katze", "ein kind spielt im haus mit dem hund", "rot"]


@pytest.mark.parametrize("model_overrides", [
    {},                                                                          # post-norm, all shared
    {"norm": "pre", "share_embeddings": False, "tie_output": False},
], ids=["post_shared", "pre_unshared"])
def test_exported_model_scores_and_translates_like_ours(tmp_path, model_overrides):
    raw = tiny_config(tmp_path, model=model_overrides, train={"max_steps": 30, "valid_every": 100})
    run_dir = train(from_dict(raw), quiet=True)
    model, vocab, _ = load_model(run_dir)
    model.eval()
    out = export(run_dir, tmp_path / "ct2")
    translator = ctranslate2.Translator(str(out), device="cpu", compute_type="float32")
    src_ids = vocab.encode(SOURCES)
    src = pad_sequences([s + [EOS_ID] for s in src_ids])  # (B, S)

    # Scoring: CTranslate2's per-token log-probabilities of our greedy outputs equal ours.
    ours = greedy_search(model, src, max_len_offset=10)
    targets = [h.tokens for h in ours]
    scored = translator.score_batch([vocab.pieces(s) for s in src_ids], [vocab.pieces(t) for t in targets])
    with torch.no_grad():
        tgt_in = pad_sequences([[BOS_ID] + t for t in targets])  # (B, T)
        T = tgt_in.size(1)
        logits = model(src, tgt_in, padding_mask(src), padding_mask(tgt_in) & causal_mask(T))  # (B, T, V)
        log_probs = torch.log_softmax(logits.float(), dim=-1)
    for row, (t, result) in enumerate(zip(targets, scored)):
        gold = t + [EOS_ID]
        expected = log_probs[row, torch.arange(len(gold)), torch.tensor(gold)]
        assert torch.allclose(torch.tensor(result.log_probs), expected, atol=1e-4), row

    # Greedy search: the same output tokens. One call per sentence, because CTranslate2's length limit is
    # per call and ours per sentence (source length with EOS + offset); a barely trained model may hit it.
    for s, t in zip(src_ids, targets):
        result = translator.translate_batch([vocab.pieces(s)], beam_size=1, max_decoding_length=len(s) + 1 + 10)
        assert result[0].hypotheses[0] == vocab.pieces(t)
    assert (out / "spm.model").read_bytes() == vocab.proto
