"""The walk through one sentence: every value a frame draws is the model's own (each stage computed here directly from
the weights, the attention the model records, the translation `translate` gives), for every kind of position, pre-
and post-norm, an imported OPUS-MT model, fp32 and bf16; the frames cut a long sentence with a note."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.helpers import sentences
from transformer.config import POSITION_KINDS, from_dict
from transformer.data.vocab import train_vocab
from transformer.errors import UserError
from transformer.inference.search import length_penalty
from transformer.inference.settings import SearchFlags, SearchSettings
from transformer.inference.translator import Translator
from transformer.model.positions import sinusoid_table
from transformer.model.transformer import Transformer
from transformer.visualize.attention import collect_attention, source_ids
from transformer.visualize.walkthrough import FILL_FRAMES, fill_steps, frames, telling_head, walk

SENTENCE = "der mann sitzt auf dem roten haus"
SETTINGS = SearchSettings(beam=1, max_len_offset=4)


@pytest.fixture(scope="module")
def vocab():
    return train_vocab(sentences(0, 300), vocab_size=80)


def model_of(vocab, positions: str = "sinusoidal", norm: str = "post", seed: int = 0) -> Transformer:
    """4 heads of 8 dimensions, 2 layers a side, untrained, with peaky outputs (so that steps choose differently)."""
    torch.manual_seed(seed)
    shape = {"d_model": 32, "n_heads": 4, "n_encoder_layers": 2, "n_decoder_layers": 2, "d_ff": 64, "dropout": 0.0}
    cfg = from_dict(
        {"model": {**shape, "max_positions": 40, "positions": positions, "norm": norm}, "data": {"max_len": 20}}
    )
    model = Transformer(cfg.model, len(vocab)).eval()
    with torch.no_grad():
        model.output.weight.mul_(3.0)
    return model


def direct(model: Transformer, ids: list[int], head: int) -> dict[str, np.ndarray]:
    """Encoder layer 1's self-attention on `ids` as the paper writes it, from the weights alone (sinusoids)."""
    d, s = model.cfg.d_model, len(ids)
    attention, d_k = model.encoder_layers[0].self_attn, d // model.cfg.n_heads
    with torch.no_grad():
        embedded = model.src_embed.weight[ids] * math.sqrt(d)
        x = embedded + sinusoid_table(d, s)
        h = model.encoder_layers[0].sub_attn.norm(x) if model.cfg.norm == "pre" else x

        def project(linear, i):
            rows = slice(i * d_k, (i + 1) * d_k)
            return h @ linear.weight[rows].T + linear.bias[rows]

        heads = []
        for i in range(model.cfg.n_heads):
            q, k, v = project(attention.q_proj, i), project(attention.k_proj, i), project(attention.v_proj, i)
            scores = q @ k.T
            weights = torch.softmax(scores / math.sqrt(d_k), dim=-1)
            heads.append({"q": q, "k": k, "v": v, "scores": scores, "weights": weights, "z": weights @ v})
        joined = torch.cat([one["z"] for one in heads], dim=1)
        output = joined @ attention.out_proj.weight.T + attention.out_proj.bias
    return {
        **{name: value.numpy() for name, value in heads[head - 1].items()},
        "embedded": embedded.numpy(),
        "stream": x.numpy(),
        "reads": h.numpy(),
        "joined": joined.numpy(),
        "output": output.numpy(),
    }


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_each_stage_of_the_encoder_is_the_paper_computed_from_the_weights(vocab, norm):
    model = model_of(vocab, norm=norm)
    e = walk(model, vocab, SENTENCE, SETTINGS, layer=1, head=2, only="encoder").encoder
    want = direct(model, vocab.encode([SENTENCE])[0] + [model.specials.eos], head=2)
    assert e.pieces == [*vocab.pieces(vocab.encode([SENTENCE])[0]), "</s>"] and e.scale == math.sqrt(32)
    got = {
        "embedded": e.embedded,
        "stream": e.stream,
        "reads": e.reads,
        "q": e.q,
        "k": e.k,
        "v": e.v,
        "scores": e.scores,
        "weights": e.weights,
        "z": e.head_output,
        "joined": e.joined_heads,
        "output": e.output,
    }
    for name, value in got.items():
        np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(e.position_rows, sinusoid_table(32, len(e.pieces)).numpy(), atol=1e-6)
    np.testing.assert_allclose(e.scaled, want["scores"] / math.sqrt(8), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(e.weights.sum(axis=1), 1.0, atol=1e-6)
    assert not e.rotated and e.pre_norm == (norm == "pre") and (e.layer, e.head, e.d_k) == (1, 2, 8)


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("kind", POSITION_KINDS)
def test_the_weights_drawn_are_the_ones_the_model_applied(vocab, kind, norm):
    """For every kind of position, pre- and post-norm: the followed layer's softmax rows, every head's, the decoder's
    self-attention and attention over the source are what the model records in its own forward pass."""
    model = model_of(vocab, kind, norm)
    w = walk(model, vocab, SENTENCE, SETTINGS)
    e, d = w.encoder, w.decoder
    src = source_ids(model, vocab, SENTENCE)
    tgt = torch.tensor([[model.specials.bos, *d.chosen[:-1]]])
    _, recorded = collect_attention(model, src, tgt)
    assert (e.layer, d.layer) == (2, 2)  # the last layers by default
    np.testing.assert_allclose(e.all_weights, recorded["encoder"][1, 0].numpy(), atol=1e-6)
    np.testing.assert_allclose(e.weights, e.all_weights[e.head - 1], atol=0)
    np.testing.assert_allclose(d.self_weights, recorded["decoder"][1, 0, d.head - 1].numpy(), atol=1e-6)
    np.testing.assert_allclose(d.cross_weights, recorded["cross"][1, 0, d.head - 1].numpy(), atol=1e-6)
    np.testing.assert_allclose(e.stream, e.embedded + e.position_rows, atol=1e-5)  # what layer 1 read: their sum
    assert e.rotated == (kind == "rotary") and (kind != "rotary" or not e.position_rows.any())
    assert e.head == telling_head(e.all_weights) and d.head == telling_head(recorded["cross"][1, 0].numpy())


@pytest.mark.parametrize("beam", [1, 3])
def test_the_decoder_writes_the_translation_translate_gives(run, beam):
    translator = Translator(run, "cpu", SearchFlags(beam=beam, dtype="fp32"))
    for sentence in sentences(3, 4):
        d = walk(translator.model, translator.vocab, sentence, translator.settings, only="decoder").decoder
        assert d.translation == translator.translate([sentence])[0]
        assert d.chosen[-1] == translator.model.specials.eos and d.read[0] == "<s>" and len(d.read) == len(d.chosen)
        assert d.read[1:] == d.chosen_pieces[:-1] and d.beam == beam
        if beam == 1:  # greedy: the most probable at every step (EOS forced at the limit), the score their sum
            steps = len(d.chosen) - d.at_limit
            assert [row[0] for row in d.top_ids.tolist()][:steps] == d.chosen[:steps]
            score = translator.translate_nbest([sentence], 1)[0][0][0]
            penalty = length_penalty(len(d.chosen), translator.settings.lenpen, translator.settings.lenpen_kind)
            assert np.log(d.probs).sum() / penalty == pytest.approx(score, abs=1e-4)
        assert (np.diff(d.top_probs, axis=1) <= 0).all() and (d.top_probs <= 1).all()


def test_the_frames_draw_the_walks_values_stage_by_stage(vocab):
    model = model_of(vocab)
    w = walk(model, vocab, SENTENCE, SETTINGS)
    e, d = w.encoder, w.decoder
    shown = frames(w, max_pieces=40)  # all of it
    s = len(e.pieces)
    encoder = [f for f in shown if f.scene != "step"]
    assert len(encoder) == 10 + 2 * (len(fill_steps(s)) - 1) and len(fill_steps(s)) <= FILL_FRAMES
    assert len(shown) == len(encoder) + len(d.chosen) + 1  # a frame per decoder step, and the translation
    filling = [f for f in encoder if f.scene == "scores" and "row by row" in f.title]
    for frame, filled in zip(filling, fill_steps(s)):
        np.testing.assert_array_equal(frame.values["scores"][:filled], e.scores[:filled])
        assert np.isnan(frame.values["scores"][filled:]).all()
    scaled = next(f for f in encoder if "divided by" in f.title)
    np.testing.assert_array_equal(scaled.values["scores"], e.scaled)
    last = [f for f in encoder if f.scene == "softmax"][-1]
    np.testing.assert_array_equal(last.values["weights"], e.weights)
    np.testing.assert_array_equal(last.values["z"], e.head_output)
    assert encoder[0].labels["source"] == e.pieces and np.isnan(encoder[0].values["embedded"]).all()
    for t, frame in enumerate(f for f in shown if f.scene == "step" and f.current is not None):
        np.testing.assert_array_equal(frame.values["self"][t], d.self_weights[t])
        np.testing.assert_array_equal(frame.values["cross"][: t + 1], d.cross_weights[: t + 1])
        assert np.isnan(frame.values["self"][t + 1 :]).all()
        top = frame.values["top"]
        assert frame.labels["top"][int(frame.values["chosen"][0])] == d.chosen_pieces[t]
        np.testing.assert_array_equal(top[: len(d.top_probs[t])], d.top_probs[t])
    assert shown[-1].title == f"The translation: {d.translation}" and shown[-1].hold > 1
    assert all(not f.note for f in shown)


def test_a_sentence_longer_than_a_frame_shows_is_cut_with_a_note(vocab):
    model = model_of(vocab)
    w = walk(model, vocab, SENTENCE, SETTINGS)
    cut = frames(w, max_pieces=4)
    for frame in cut:
        assert frame.note and "only the first 4 are shown" in frame.note
        for name, value in frame.values.items():
            rows = value.shape[1] if name == "heads" else value.shape[0]  # heads: (heads, rows, columns)
            assert rows <= 4 or name in ("top", "chosen", "head_starts"), name
    assert all(len(f.labels["source"]) == 4 for f in cut)
    assert len([f for f in cut if f.scene == "step"]) == 5  # 4 steps, then the translation


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"layer": 3}, "--layer 3 is out of range: the encoder has 2 layers, numbered 1..2"),
        ({"layer": 0, "only": "decoder"}, "--layer 0 is out of range: the decoder has 2 layers, numbered 1..2"),
        ({"head": 5}, "--head 5 is out of range: the encoder has 4 heads, numbered 1..4"),
        ({"source": "   "}, "the source sentence is empty"),
        ({"source": "der " * 60}, "the source sentence is 60 pieces long; this model accepts at most"),
    ],
)
def test_bad_input_is_one_line(vocab, kwargs, message):
    model = model_of(vocab)
    source = kwargs.pop("source", SENTENCE)
    with pytest.raises(UserError, match=f"^{message}"):
        walk(model, vocab, source, SETTINGS, **kwargs)


def test_bf16_draws_what_bf16_computes(run):
    translator = Translator(run, "cpu", SearchFlags(beam=1, dtype="bf16"))
    w = walk(translator.model, translator.vocab, SENTENCE, translator.settings)
    e, d = w.encoder, w.decoder
    assert d.translation == translator.translate([SENTENCE])[0]
    for value in (e.embedded, e.q, e.scores, e.weights, e.output, d.self_weights, d.probs):
        assert value.dtype == np.float32 and np.isfinite(value).all()
    np.testing.assert_allclose(e.weights.sum(axis=1), 1.0, atol=2e-2)  # summed in bf16
    src = source_ids(translator.model, translator.vocab, SENTENCE)
    _, recorded = collect_attention(translator.model, src, torch.tensor([[translator.model.specials.bos]]))
    np.testing.assert_allclose(e.all_weights, recorded["encoder"][-1, 0].float().numpy(), atol=1e-2)


def test_an_imported_opus_mt_model(marian_dir, tmp_path, hf_offline):
    pytest.importorskip("transformers")
    from transformer.inference.hf_import import import_hf

    run, _ = import_hf(marian_dir, tmp_path / "run")
    translator = Translator(run, "cpu", SearchFlags(beam=2, dtype="fp32"))
    sentence = "der mann sitzt auf dem haus"
    w = walk(translator.model, translator.vocab, sentence, translator.settings)
    assert w.decoder.translation == translator.translate([sentence])[0]
    assert w.encoder.pieces[-1] == "</s>" and not w.encoder.rotated and w.encoder.position_rows.any()
    assert len(frames(w)) > 10
