"""`transformer export hf`: the MarianMTModel directory loads offline, computes our model's function (the permuted
residual stream), generates our search's tokens, tokenizes as we do, and is written only where an export may go."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import sentences, translation_config, write_copying_checkpoint
from transformer.config import from_dict, to_dict
from transformer.data.batch import Batch, prepare_sources
from transformer.data.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID, train_vocab
from transformer.inference.hf_export import export_hf
from transformer.inference.search import length_penalty, search
from transformer.inference.settings import SearchSettings
from transformer.model import positions
from transformer.model.checkpoint import load_checkpoint, load_model, save_checkpoint
from transformer.model.transformer import Transformer

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
LINES = sentences(7, 24)  # the source sentences every comparison translates
OFFSET = 4  # translation_config's decode.max_len_offset


pytestmark = pytest.mark.usefixtures("hf_offline")  # every load here reads the export alone


@pytest.fixture(scope="module", params=["shared", "separate_output", "separate"])
def exported(request, copy_model, tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, export directory) of a model that copies by construction: one embedding for both sides and the
    output (copy_model), one embedding for both sides and its own output matrix, or three matrices of their own."""
    root = tmp_path_factory.mktemp(f"hf_{request.param}")
    if request.param == "shared":
        checkpoint = copy_model
    elif request.param == "separate_output":
        checkpoint = write_copying_checkpoint(root / "model.pt", tie_output=False)
    else:
        checkpoint = write_copying_checkpoint(root / "model.pt", share_embeddings=False, tie_output=False)
    return checkpoint, export_hf(checkpoint, root / "hf")


def marian(directory: Path):
    return transformers.MarianMTModel.from_pretrained(directory).eval()


def generate(hf, source_ids: list[int], beam: int, lenpen: float, **kwargs):
    """generate() for one source with our search's limits: source + EOS, at most source length + OFFSET tokens
    before the EOS that is forced there (max_length counts the start token and EOS)."""
    src, _ = prepare_sources([source_ids], 40)
    return hf.generate(
        input_ids=src,
        attention_mask=torch.ones_like(src),
        num_beams=beam,
        length_penalty=lenpen,
        max_length=src.size(1) + OFFSET + 2,
        do_sample=False,
        **kwargs,
    )


def tokens(sequence) -> list[int]:
    """generate()'s output ids without the start token, EOS and padding: our Hypothesis.tokens."""
    ids = sequence.tolist()
    assert ids[0] == BOS_ID  # decoding started with our BOS (decoder_start_token_id), not Marian's pad
    return [t for t in ids[1:] if t not in (EOS_ID, PAD_ID)]


def test_the_permutation_is_marians_sinusoid_layout():
    """Our table with its columns in Positions.marian_order is the table a new MarianMTModel computes itself; the
    "marian" kind is that table exactly (computed as Marian computes it), in the identity order."""
    for d_model in (32, 512):
        config = transformers.MarianConfig(
            vocab_size=8,
            d_model=d_model,
            encoder_layers=1,
            decoder_layers=1,
            encoder_ffn_dim=8,
            decoder_ffn_dim=8,
            encoder_attention_heads=1,
            decoder_attention_heads=1,
            max_position_embeddings=64,
            pad_token_id=0,
            decoder_start_token_id=2,
        )
        theirs = transformers.MarianMTModel(config).model.encoder.embed_positions.weight.detach()
        cfg = from_dict(
            {"model": {"d_model": d_model, "n_heads": 1, "max_positions": 64}, "data": {"max_len": 8}}
        ).model
        sinusoidal = positions.module(cfg)
        ours = sinusoidal.table[:, sinusoidal.marian_order()]
        assert torch.allclose(ours, theirs, atol=2e-5), (ours - theirs).abs().max()
        marian = positions.module(dataclasses.replace(cfg, positions="marian"))
        assert torch.equal(marian.table[:, marian.marian_order()], theirs)


def test_the_export_computes_our_function(exported):
    checkpoint, directory = exported
    model, vocab, cfg = load_model(checkpoint)
    hf = marian(directory)
    bias = model.output.bias.detach() if cfg.model.output_bias else torch.zeros(len(vocab))
    assert torch.equal(hf.final_logits_bias, bias.reshape(1, -1))
    pairs = [(s, s[::-1]) for s in vocab.encode(LINES[:8])]
    batch = Batch.from_pairs(pairs)
    with torch.no_grad():
        ours = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
        theirs = hf(
            input_ids=batch.src, attention_mask=(batch.src != PAD_ID).long(), decoder_input_ids=batch.tgt_in
        ).logits
    real = batch.tgt_out != PAD_ID  # Marian attends to padded decoder positions' own keys; ours are never read
    assert (ours - theirs)[real].abs().max() < 1e-4


def test_greedy_generate_gives_our_search_tokens(exported):
    checkpoint, directory = exported
    model, vocab, cfg = load_model(checkpoint)
    hf = marian(directory)
    for source in vocab.encode(LINES):
        src, _ = prepare_sources([source], cfg.model.max_positions)
        ours = search(model, src, SearchSettings(beam=1, max_len_offset=OFFSET)).best()[0].tokens
        assert tokens(generate(hf, source, 1, 0.0)[0]) == ours, source


@pytest.fixture(scope="module")
def endless(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, export) of an untrained model that never writes EOS (its row of the output matrix is zero: logit
    0 against peaky others), so that every output runs to the length limit."""
    root = tmp_path_factory.mktemp("endless")
    vocab = train_vocab(sentences(0, 300), vocab_size=80)
    cfg = from_dict(translation_config(root, root))
    cfg = from_dict({**to_dict(cfg), "model": {**to_dict(cfg)["model"], "tie_output": False}})
    torch.manual_seed(3)
    model = Transformer(cfg.model, len(vocab))
    with torch.no_grad():
        model.output.weight.mul_(3.0)
        model.output.weight[EOS_ID] = 0.0
    save_checkpoint({"config": to_dict(cfg), "vocab": vocab.proto, "model": model.state_dict()}, root / "model.pt")
    return root / "model.pt", export_hf(root / "model.pt", root / "hf")


def test_greedy_generate_gives_our_tokens_at_our_length_limit(endless):
    """Our limit is per sentence (source length + decode.max_len_offset, at most max_positions - 1 tokens before the
    EOS), generate's one per call: with max_new_tokens = len(input_ids) + max_len_offset + 1 (the forced EOS is one of
    them), as fine-tuning.md says, every output is ours; with the exported defaults (max_length = max_positions + 1),
    those whose limit is the model's own (long sources, truncated as ours with truncation=True) are."""
    checkpoint, directory = endless
    model, vocab, cfg = load_model(checkpoint)
    hf, m = marian(directory), cfg.model
    tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    short = LINES[:12]
    long = [" ".join(LINES[i : i + 8]) for i in range(4)]  # long enough that the limit is max_positions - 1
    same = {"per sentence": 0, "defaults": 0}
    for text in short + long:
        input_ids = tokenizer([text], return_tensors="pt", truncation=True).input_ids
        source = vocab.encode([text])[0]
        src, _ = prepare_sources([source], m.max_positions)
        assert input_ids[0].tolist() == src[0].tolist()  # truncated as ours: at most max_positions - 2 pieces + EOS
        ours = search(model, src, SearchSettings(beam=1, max_len_offset=OFFSET)).best()[0].tokens
        limit = min(src.size(1) + OFFSET, m.max_positions - 1)
        assert len(ours) == limit  # the model never stops by itself: every output runs to the limit
        assert (limit == m.max_positions - 1) == (text in long)
        max_new_tokens = min(input_ids.size(1) + cfg.decode.max_len_offset + 1, m.max_positions)
        ids = {"per sentence": input_ids, "defaults": input_ids}
        for way, kwargs in (("per sentence", {"max_new_tokens": max_new_tokens}), ("defaults", {})):
            out = hf.generate(input_ids=ids[way], attention_mask=torch.ones_like(input_ids), num_beams=1, **kwargs)
            same[way] += tokens(out[0]) == ours
    assert same == {"per sentence": len(short) + len(long), "defaults": len(long)}


def token_log_probs(model, source: list[int], output: list[int]) -> list[float]:
    """log p of each token of output + EOS given the source, under our model (float64 sums of float32 values)."""
    batch = Batch.from_pairs([(source, output)])
    with torch.no_grad():
        logits = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
    lprobs = torch.log_softmax(logits[0].double(), dim=-1)
    return lprobs.gather(1, batch.tgt_out[0][:, None]).squeeze(1).tolist()


def generate_summed(model, source: list[int], output: list[int]) -> float:
    """The summed log-probability generate() gives a hypothesis: ours, except that an EOS forced at the length limit
    counts 0 there (ForcedEOSTokenLogitsProcessor sets its score to 0; our search keeps its log-probability)."""
    lprobs = token_log_probs(model, source, output)
    return sum(lprobs[:-1]) if len(output) == len(source) + 1 + OFFSET else sum(lprobs)


def test_beam_search_without_length_penalty_gives_our_tokens(exported):
    """Beam 4 with lenpen 0: both rank finished hypotheses by their summed log-probability, and their early_stopping
    "never" is our exact stop rule, so the outputs agree token for token; except where a hypothesis runs to the length
    limit, whose forced EOS costs its log-probability here and nothing in generate(): there the scores are checked."""
    checkpoint, directory = exported
    model, vocab, cfg = load_model(checkpoint)
    hf = marian(directory)
    compared = 0
    for source in vocab.encode(LINES):
        src, _ = prepare_sources([source], cfg.model.max_positions)
        ours = search(model, src, SearchSettings(beam=4, lenpen=0.0, max_len_offset=OFFSET)).best()[0]
        out = generate(hf, source, 4, 0.0, early_stopping="never", output_scores=True, return_dict_in_generate=True)
        theirs, limit = tokens(out.sequences[0]), len(source) + 1 + OFFSET
        assert math.isclose(out.sequences_scores.item(), generate_summed(model, source, theirs), rel_tol=1e-4)
        if limit not in (len(theirs), len(ours.tokens)):
            assert theirs == ours.tokens, source
            compared += 1
    assert compared >= len(LINES) // 2


def test_beam_scores_differ_only_by_the_length_normalisation(copy_model, tmp_path):
    """With lenpen a > 0 generate divides a hypothesis's summed log-probability s by L ** a, we by ((5 + L) / 6) ** a
    (L: tokens + EOS, the same count on both sides), so the two searches may pick different hypotheses: each score
    here is checked to be s under our model divided by that side's own normalisation."""
    model, vocab, cfg = load_model(copy_model)
    directory = export_hf(copy_model, tmp_path / "hf")
    hf = marian(directory)
    differ = 0
    for source in vocab.encode(LINES[:10]):
        src, _ = prepare_sources([source], cfg.model.max_positions)
        ours = search(model, src, SearchSettings(beam=4, lenpen=0.6, max_len_offset=OFFSET)).best()[0]
        out = generate(hf, source, 4, 0.6, early_stopping="never", output_scores=True, return_dict_in_generate=True)
        theirs = tokens(out.sequences[0])
        assert math.isclose(
            out.sequences_scores.item(), generate_summed(model, source, theirs) / (len(theirs) + 1) ** 0.6, rel_tol=1e-4
        )
        assert math.isclose(
            ours.score,
            sum(token_log_probs(model, source, ours.tokens)) / length_penalty(len(ours.tokens) + 1, 0.6),
            rel_tol=1e-4,
        )
        differ += theirs != ours.tokens
    print(f"beam 4, lenpen 0.6: {differ} of 10 outputs differ")


def test_the_tokenizer_gives_our_pieces_and_ids(copy_model, tmp_path):
    model, vocab, cfg = load_model(copy_model)
    directory = export_hf(copy_model, tmp_path / "hf")
    tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    known = 0
    for text in LINES + ["Zoë läuft über die Straße, 3 € später.", "  zwei   leerzeichen  "]:
        ids = vocab.encode([text])[0]
        assert tokenizer(text).input_ids == ids + [EOS_ID]  # Marian's source ends with EOS, as ours
        if UNK_ID in ids:  # an unknown character: its piece is the character there, <unk> here, the id the same;
            continue  # decoded, it is dropped as a special token there and " ⁇ " here
        assert tokenizer.tokenize(text) == vocab.pieces(ids)
        assert tokenizer.decode(ids + [EOS_ID], skip_special_tokens=True) == vocab.decode([ids])[0]
        known += 1
    assert known == len(LINES) + 1


def test_text_that_spells_a_special_token_is_tokenized_as_ours(copy_model, tmp_path):
    """A literal <unk>, </s> or <pad> in a sentence is text to our tokenizer; MarianTokenizer took it as the special
    token (an EOS in the middle of a source) until the export wrote split_special_tokens. A leading >>xx<< is still
    Marian's language code (one token, unknown to our vocabulary): documented, with a space before it as the remedy."""
    _, vocab, _ = load_model(copy_model)
    tokenizer = transformers.MarianTokenizer.from_pretrained(export_hf(copy_model, tmp_path / "hf"))
    for text in ("ein <unk> hund </s> spielt <pad>", "</s>", "<pad> <unk>", "der >>de<< hund", " >>de<< ein hund"):
        assert tokenizer(text).input_ids == vocab.encode([text])[0] + [EOS_ID], text
    assert tokenizer(">>de<< ein hund").input_ids[0] == UNK_ID != vocab.encode([">>de<< ein hund"])[0][0]


def test_the_files_say_what_transformers_needs(copy_model, tmp_path):
    directory = export_hf(copy_model, tmp_path / "hf")
    cfg = from_dict(load_checkpoint(copy_model)["config"])
    generation = json.loads((directory / "generation_config.json").read_text())
    assert (generation["num_beams"], generation["length_penalty"]) == (cfg.decode.beam, cfg.decode.lenpen)
    assert generation["decoder_start_token_id"] == BOS_ID and generation["max_length"] == cfg.model.max_positions + 1
    config = json.loads((directory / "config.json").read_text())
    assert (config["activation_function"], config["scale_embedding"]) == ("relu", True)
    assert (
        (directory / "source.spm").read_bytes()
        == (directory / "target.spm").read_bytes()
        == load_checkpoint(copy_model)["vocab"]
    )
    assert transformers.GenerationConfig.from_pretrained(directory).num_beams == cfg.decode.beam
    modes = {p.name: p.stat().st_mode & 0o777 for p in directory.iterdir()}
    assert len(set(modes.values())) == 1, modes  # every file as readable as the others (none private)


@pytest.mark.skipif(
    TRANSFORMERS_MAJOR >= 5,
    reason="transformers 5 removed the translation pipeline (tokenizer + generate is the way there)",
)
def test_the_translation_pipeline_translates(copy_model, tmp_path):
    model, vocab, cfg = load_model(copy_model)
    directory = export_hf(copy_model, tmp_path / "hf")
    translate = transformers.pipeline("translation", model=str(directory))
    hf = marian(directory)
    tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    for text in LINES[:4]:
        inputs = tokenizer([text], return_tensors="pt")
        expected = tokenizer.decode(hf.generate(**inputs)[0], skip_special_tokens=True)
        assert translate(text)[0]["translation_text"] == expected


def test_a_pre_norm_model_is_refused_naming_the_setting(tmp_path, call):
    vocab = train_vocab(sentences(0, 300), vocab_size=80)
    raw = translation_config(tmp_path, tmp_path)
    raw["model"]["norm"] = "pre"
    cfg = from_dict(raw)
    save_checkpoint(
        {"config": to_dict(cfg), "vocab": vocab.proto, "model": Transformer(cfg.model, 80).state_dict()},
        tmp_path / "pre.pt",
    )
    status, out, err = call("export", "hf", tmp_path / "pre.pt", tmp_path / "hf")
    assert status == 2 and "model.norm is 'pre'" in err and "post-norm" in err
    assert not (tmp_path / "hf").exists()


def test_the_command_writes_replaces_only_its_own_and_refuses_the_rest(copy_model, tmp_path, call):
    out = tmp_path / "hf"
    status, stdout, err = call("export", "hf", copy_model, out)
    assert status == 0 and stdout.strip() == f"wrote {out}"
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "vocab.json",
        "source.spm",
        "target.spm",
        "generation_config.json",
        "transformer-export.json",
    }
    status, _, err = call("export", "hf", copy_model, out)
    assert status == 2 and "add --force" in err
    assert call("export", "hf", copy_model, out, "--force")[0] == 0
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    status, _, err = call("export", "hf", copy_model, foreign, "--force")
    assert status == 2 and "never replaced" in err and (foreign / "notes.txt").read_text() == "keep me"
    status, _, err = call("export", "hf", copy_model, tmp_path / "q", "--quantization", "int8")
    assert status == 2 and "ctranslate2 only" in err


def test_without_transformers_the_command_says_how_to_install_it(copy_model, tmp_path, call, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    status, _, err = call("export", "hf", copy_model, tmp_path / "hf")
    assert status == 2 and "pip install 'transformer[hf]'" in err
