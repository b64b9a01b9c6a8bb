"""`transformer import hf`: a MarianMTModel directory built here as OPUS-MT's are (two SentencePiece models and a
vocab.json made from a corpus, swish, a non-zero final_logits_bias, saved with save_pretrained) becomes a run whose
logits, greedy and beam outputs are transformers' own; what cannot be honoured is refused in one line; the files it
writes are only ever its own."""

from __future__ import annotations

import json
import os
import re
import threading
import tracemalloc
from pathlib import Path

import pytest
import torch

from scripts.make_marian_dir import CODES as MARIAN_CODES
from tests.helpers import marian_sentences, write_marian_dir
from transformer.data.batch import Batch, prepare_sources
from transformer.data.vocab import MarianVocab
from transformer.errors import UserError
from transformer.inference.hf_export import export_hf
from transformer.inference.hf_import import import_hf
from transformer.inference.search import search
from transformer.inference.settings import SearchSettings
from transformer.model.checkpoint import load_checkpoint, load_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.usefixtures("hf_offline")
LINES = marian_sentences(7, 24)
OFFSET = 6  # the searches' max_len_offset here: about half the outputs end before it


@pytest.fixture(scope="module")
def imported(marian_dir, tmp_path_factory) -> Path:
    out, _ = import_hf(marian_dir, tmp_path_factory.mktemp("imported") / "run")
    return out


def marian(directory: Path):
    return transformers.MarianMTModel.from_pretrained(directory).eval()


def hf_copy(marian_dir: Path, directory: Path, config: dict | None = None, generation: dict | None = None) -> Path:
    """A copy of marian_dir with keys of its config.json and generation_config.json changed."""
    directory.mkdir()
    for p in marian_dir.iterdir():
        (directory / p.name).write_bytes(p.read_bytes())
    for name, change in (("config.json", config), ("generation_config.json", generation)):
        if change:
            (directory / name).write_text(json.dumps({**json.loads((directory / name).read_text()), **change}))
    return directory


def refused(call, hf_dir: Path, run: Path) -> str:
    """`import hf`'s one-line refusal (exit status 2, nothing written)."""
    status, _, err = call("import", "hf", hf_dir, run)
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert not run.exists()
    return err


def generate(hf, src: torch.Tensor, pad: int, beam: int, **kwargs) -> list[int]:
    """generate() for one source row (ids + EOS) with our search's limit: at most source length + OFFSET tokens
    before the EOS forced there (max_length counts the start token and EOS); the output without start, EOS, pad."""
    out = hf.generate(
        input_ids=src,
        attention_mask=(src != pad).long(),
        num_beams=beam,
        max_length=src.size(1) + OFFSET + 2,
        do_sample=False,
        renormalize_logits=False,
        **kwargs,
    )
    return [t for t in out[0, 1:].tolist() if t not in (pad, hf.config.eos_token_id)]


def test_the_tokenizer_and_ours_split_and_number_alike(marian_dir):
    """Sources by source.spm, targets by target.spm, ids from vocab.json; a leading >>xx<< code is one piece; decoded
    text is the tokenizer's with skip_special_tokens (which, in transformers 5, joins with source.spm)."""
    tokenizer = transformers.MarianTokenizer.from_pretrained(marian_dir)
    vocab = MarianVocab.load(marian_dir)
    assert (vocab.specials.eos, vocab.specials.unk, vocab.specials.pad) == (0, 1, len(vocab) - 1)
    assert vocab.specials.bos == vocab.specials.pad  # Marian's decoder starts from <pad>
    sources = LINES + [f"{MARIAN_CODES[0]} {LINES[0]}", "Zoë xyz", ""]
    for text in sources:
        assert tokenizer(text).input_ids == vocab.encode([text])[0] + [0], text
    assert vocab.pieces(vocab.encode([sources[-3]])[0])[0] == MARIAN_CODES[0]
    targets = marian_sentences(8, 10, target=True)
    assert [tokenizer(text_target=t).input_ids[:-1] for t in targets] == vocab.encode_target(targets)
    assert vocab.encode_target(targets) != vocab.encode(targets)  # the two sides' models split differently
    ids = vocab.encode_target(targets)
    assert vocab.decode(ids) == tokenizer.batch_decode(ids, skip_special_tokens=True, use_source_tokenizer=False)


def test_logits_are_transformers_own(imported, marian_dir):
    model, vocab, cfg = load_model(imported)
    assert (cfg.model.activation, cfg.model.positions, cfg.model.output_bias) == ("swish", "marian", True)
    hf = marian(marian_dir)
    targets = vocab.encode_target(marian_sentences(9, len(LINES), target=True))
    batch = Batch.from_pairs(list(zip(vocab.encode(LINES), targets)), specials=vocab.specials)
    with torch.no_grad():
        ours = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
        theirs = hf(
            input_ids=batch.src,
            attention_mask=(batch.src != vocab.specials.pad).long(),
            decoder_input_ids=batch.tgt_in,
        ).logits
    real = batch.tgt_out != vocab.specials.pad  # Marian attends to padded decoder positions' own keys; ours not read
    difference = (ours - theirs)[real].abs().max().item()
    print(f"max logit difference over {int(real.sum())} positions: {difference:.2e}")
    assert difference < 1e-4


def test_greedy_outputs_are_generates(imported, marian_dir):
    model, vocab, cfg = load_model(imported)
    hf = marian(marian_dir)
    pad = vocab.specials.pad
    for source in vocab.encode(LINES):
        src, _ = prepare_sources([source], cfg.model.max_positions, vocab.specials)
        ours = search(model, src, SearchSettings(beam=1, max_len_offset=OFFSET)).best()[0].tokens
        assert generate(hf, src, pad, 1) == ours, source
        assert pad not in ours  # <pad> starts the decoder and is never produced
    print(f"greedy: {len(LINES)} of {len(LINES)} identical")


@pytest.mark.parametrize("lenpen", [1.0, 0.6])
def test_beam_outputs_are_generates_under_its_rules(imported, marian_dir, lenpen):
    """decode.stop hf and lenpen_kind length (what the import sets) are generate()'s early_stopping=False and
    length ** length_penalty: beam 4 gives its outputs, sentence for sentence."""
    model, vocab, cfg = load_model(imported)
    assert (cfg.decode.stop, cfg.decode.lenpen_kind, cfg.decode.beam) == ("hf", "length", 4)
    hf = marian(marian_dir)
    same = 0
    for source in vocab.encode(LINES):
        src, _ = prepare_sources([source], cfg.model.max_positions, vocab.specials)
        ours = (
            search(
                model,
                src,
                SearchSettings(beam=4, lenpen=lenpen, max_len_offset=OFFSET, stop="hf", lenpen_kind="length"),
            )
            .best()[0]
            .tokens
        )
        theirs = generate(hf, src, vocab.specials.pad, 4, length_penalty=lenpen, early_stopping=False)
        same += ours == theirs
    print(f"beam 4, lenpen {lenpen}, stop hf: {same} of {len(LINES)} identical")
    assert same == len(LINES)


def test_beam_outputs_agree_where_the_rules_agree(imported, marian_dir):
    """Without a length penalty our exact rule is generate's early_stopping "never": the same best hypothesis, except
    where one of them runs to the length limit, whose forced EOS costs its log-probability here and nothing there
    (the "hf" rule counts it as generate does)."""
    model, vocab, cfg = load_model(imported)
    hf = marian(marian_dir)
    same = compared = 0
    for source in vocab.encode(LINES):
        src, _ = prepare_sources([source], cfg.model.max_positions, vocab.specials)
        ours = (
            search(model, src, SearchSettings(beam=4, lenpen=0.0, max_len_offset=OFFSET, stop="exact")).best()[0].tokens
        )
        theirs = generate(hf, src, vocab.specials.pad, 4, length_penalty=0.0, early_stopping="never")
        same += ours == theirs
        if len(source) + 1 + OFFSET not in (len(ours), len(theirs)):
            assert ours == theirs, source
            compared += 1
    print(f"beam 4, lenpen 0, stop exact vs never: {same} of {len(LINES)} identical ({compared} end before the limit)")
    assert compared >= len(LINES) // 3


def test_the_run_directory_holds_the_tokenizer_files_verbatim(imported, marian_dir):
    for name in ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json"):
        assert (imported / name).read_bytes() == (marian_dir / name).read_bytes()
    stored = load_checkpoint(imported / "final.pt")["vocab"]
    assert stored["kind"] == "marian" and stored["files"]["vocab.json"] == (marian_dir / "vocab.json").read_bytes()
    record = json.loads((imported / "transformer-import.json").read_text())
    assert record["format"] == "transformer-hf-import-v1" and set(record["files"]) == {
        p.name for p in imported.iterdir() if p.name != "transformer-import.json"
    }


def test_import_then_export_gives_the_same_model_back(imported, marian_dir, tmp_path):
    from safetensors.torch import load_file

    out = export_hf(imported, tmp_path / "hf")
    for name in ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (marian_dir / name).read_bytes()
    theirs, ours = load_file(marian_dir / "model.safetensors"), load_file(out / "model.safetensors")
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    original, again = marian(marian_dir), marian(out)
    vocab = MarianVocab.load(marian_dir)
    for line in LINES[:6]:  # generation_config.json is ours (max_length: our limit): the same limit given to both
        src = torch.tensor([vocab.encode([line])[0] + [0]])
        for beam in (1, 4):
            first, second = (m.generate(input_ids=src, num_beams=beam, max_length=20) for m in (original, again))
            assert torch.equal(first, second)


def test_ours_exported_and_imported_back_translates_the_same(copy_model, tmp_path):
    """A model of ours (interleaved sinusoids, our special ids) -> export hf -> import hf: the same outputs, the
    weights now in Marian's layout ("marian" positions)."""
    exported = export_hf(copy_model, tmp_path / "hf")
    back, _ = import_hf(exported, tmp_path / "back")
    ours, vocab, _ = load_model(copy_model)
    again, again_vocab, cfg = load_model(back)
    assert cfg.model.positions == "marian" and again_vocab.specials == vocab.specials
    for source in vocab.encode(LINES[:12]):
        assert again_vocab.encode([vocab.decode([source])[0]])[0] == source
        src, _ = prepare_sources([source], 40)
        for beam in (1, 3):
            assert (
                search(ours, src, SearchSettings(beam=beam, lenpen=0.6, max_len_offset=4)).best()[0].tokens
                == search(again, src, SearchSettings(beam=beam, lenpen=0.6, max_len_offset=4)).best()[0].tokens
            )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"activation_function": "gelu"}, "activation_function is 'gelu'"),
        ({"decoder_ffn_dim": 48}, "decoder_ffn_dim is 48"),
        ({"scale_embedding": False}, "scale_embedding is False"),
        ({"decoder_vocab_size": 7}, "decoder_vocab_size is 7"),
        # Values of the wrong type (a TypeError, or read as another value: true as the id 1, <unk>).
        ({"activation_function": ["swish"]}, "activation_function is ['swish']"),
        ({"activation_function": {"swish": 1}}, "activation_function is {'swish': 1}"),
        ({"early_stopping": [True]}, "early_stopping is [True]"),
        ({"early_stopping": {}}, "early_stopping is {}"),
        ({"early_stopping": 0}, "early_stopping is 0"),
        ({"max_position_embeddings": "512"}, "max_position_embeddings is '512'"),
        ({"max_position_embeddings": None}, "max_position_embeddings is None"),
        ({"decoder_start_token_id": True}, "decoder_start_token_id is True"),
        ({"eos_token_id": False}, "eos_token_id is False"),
        ({"d_model": True}, "d_model is True"),
        ({"encoder_layers": 2.0}, "encoder_layers is 2.0"),
        ({"vocab_size": "63"}, "vocab_size is '63'"),
        ({"dropout": "0.1"}, "dropout is '0.1'"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings is 'yes'"),
        ({"encoder_layerdrop": [0]}, "encoder_layerdrop is [0]"),
        # Each key's own value before what it must equal: the key named is the one that is wrong.
        ({"encoder_ffn_dim": -1}, "encoder_ffn_dim is -1"),
        ({"encoder_attention_heads": 0}, "encoder_attention_heads is 0"),
        ({"d_model": 30}, "d_model is 30: it must be a multiple of encoder_attention_heads"),
    ],
)
def test_a_setting_we_cannot_honour_is_refused_in_one_line(marian_dir, tmp_path, call, change, message):
    err = refused(call, hf_copy(marian_dir, tmp_path / "hf", change), tmp_path / "run")
    assert message in err, err


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_beams": 1_000_000}, "num_beams is 1000000: beam must be at most the vocabulary size (63 pieces)"),
        ({"num_beams": True}, "num_beams is True"),
        ({"renormalize_logits": "yes"}, "renormalize_logits is 'yes'"),
        ({"early_stopping": None}, "early_stopping is None"),
    ],
)
def test_a_generation_setting_no_search_of_ours_takes_is_refused_in_one_line(
    marian_dir, tmp_path, call, change, message
):
    """num_beams 1000000 was imported, and every translate of the run then refused it."""
    err = refused(call, hf_copy(marian_dir, tmp_path / "hf", generation=change), tmp_path / "run")
    assert "generation_config.json" in err and message in err, err


@pytest.mark.parametrize(
    "change, key",
    [
        ({"d_model": 8192}, "d_model is 8192"),
        ({"d_model": 16384, "encoder_ffn_dim": 10**9, "decoder_ffn_dim": 10**9}, "d_model is 16384"),
        ({"d_model": 10**9}, "d_model is 1000000000"),
        ({"encoder_ffn_dim": 10**12, "decoder_ffn_dim": 10**12}, "encoder_ffn_dim is 1000000000000"),
        ({"decoder_layers": 10**9}, "decoder_layers is 1000000000"),
        ({"vocab_size": 10**9, "decoder_vocab_size": 10**9}, "vocab_size is 1000000000"),
        ({"max_position_embeddings": 10**9}, "max_position_embeddings is 1000000000"),
    ],
)
def test_sizes_are_checked_against_the_weights_before_a_model_is_built(marian_dir, tmp_path, monkeypatch, change, key):
    """A model was built at config.json's sizes before any weight's shape was compared: d_model 8192 took 6.6 GB and
    27 s to be refused; 16384 or 10**9, allocation failures with tracebacks."""
    from transformer.inference import hf_import

    built = []
    monkeypatch.setattr(hf_import, "Transformer", lambda *args: built.append(args))
    hf_dir = hf_copy(marian_dir, tmp_path / "hf", change)
    with pytest.raises(UserError, match=re.escape(key)) as refusal:
        import_hf(hf_dir, tmp_path / "run")
    assert "\n" not in str(refusal.value) and not built


def test_the_model_of_another_directorys_sizes_is_refused_naming_the_key(marian_dir, tmp_path, call):
    err = refused(call, hf_copy(marian_dir, tmp_path / "hf", {"encoder_layers": 3}), tmp_path / "run")
    assert "encoder_layers is 3 but" in err and "holds 2 encoder layer(s)" in err, err


@pytest.mark.parametrize("name", ["BartConfig", "T5Config", "M2M100Config"])
def test_another_architecture_is_refused_in_one_line(tmp_path, call, name):
    getattr(transformers, name)().save_pretrained(tmp_path / "hf")
    status, _, err = call("import", "hf", tmp_path / "hf", tmp_path / "run")
    assert status == 2 and "model_type is" in err and "MarianMTModel" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_separate_vocabularies_are_refused_in_one_line(marian_dir, tmp_path, call):
    hf_dir = hf_copy(marian_dir, tmp_path / "hf")
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({**config, "separate_vocabs": True}))
    status, _, err = call("import", "hf", hf_dir, tmp_path / "run")
    assert status == 2 and "separate_vocabs" in err and len(err.strip().splitlines()) == 1


def test_an_fp16_checkpoint_imports_to_the_same_model_in_fp32(marian_dir, tmp_path):
    hf = marian(marian_dir).half()
    hf.save_pretrained(tmp_path / "hf16")
    transformers.MarianTokenizer.from_pretrained(marian_dir).save_pretrained(tmp_path / "hf16")
    run, _ = import_hf(tmp_path / "hf16", tmp_path / "run")
    model, _, _ = load_model(run)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.equal(model.src_embed.weight, hf.model.shared.weight.float())


def test_it_writes_only_its_own_directory(marian_dir, tmp_path, call):
    run = tmp_path / "run"
    status, out, err = call("import", "hf", marian_dir, run)
    assert status == 0 and out.strip().endswith(f"wrote {run}") and "renormalize_logits" in err
    status, _, err = call("import", "hf", marian_dir, run)
    assert status == 2 and "add --force" in err
    assert call("import", "hf", marian_dir, run, "--force")[0] == 0
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    status, _, err = call("import", "hf", marian_dir, foreign, "--force")
    assert status == 2 and "never replaced" in err and (foreign / "notes.txt").read_text() == "keep me"
    (run / "eval").mkdir()  # evaluate wrote there since: no longer only the import's
    status, _, err = call("import", "hf", marian_dir, run, "--force")
    assert status == 2 and "never replaced" in err and (run / "final.pt").is_file()


def test_a_missing_directory_or_file_is_named(tmp_path, call, marian_dir):
    status, _, err = call("import", "hf", tmp_path / "nothing", tmp_path / "run")
    assert status == 2 and "is not a directory" in err
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_bytes((marian_dir / "config.json").read_bytes())
    status, _, err = call("import", "hf", partial, tmp_path / "run")
    assert status == 2 and "source.spm" in err


def test_a_real_size_directory_builds(tmp_path):
    """The benchmark's OPUS-MT-sized directory (scripts/make_marian_dir.py) at a small size: it imports."""
    directory = write_marian_dir(tmp_path / "hf", d_model=64, encoder_layers=1, decoder_layers=1)
    run, _ = import_hf(directory, tmp_path / "run")
    assert load_model(run)[2].model.d_model == 64


@pytest.mark.parametrize("content", ["empty", "int", "string", "nested", "no tensors", "an int tensor"])
def test_a_weights_file_that_holds_no_tensors_is_refused_in_one_line(marian_dir, tmp_path, call, content):
    """An empty pytorch_model.bin was an IndexError; one holding an int, a string or a nested dict, AttributeError."""
    from safetensors.torch import load_file

    hf_dir = hf_copy(marian_dir, tmp_path / "hf")
    (hf_dir / "model.safetensors").unlink()
    weights = load_file(marian_dir / "model.safetensors")
    held = {
        "int": 5,
        "string": "weights",
        "nested": {"model": weights},
        "no tensors": {},
        "an int tensor": {**weights, "final_logits_bias": torch.zeros(1, 63, dtype=torch.long)},
    }
    if content == "empty":
        (hf_dir / "pytorch_model.bin").write_bytes(b"")
    else:
        torch.save(held[content], hf_dir / "pytorch_model.bin")
    err = refused(call, hf_dir, tmp_path / "run")
    assert "pytorch_model.bin" in err, err


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_infinite_weights_are_refused_at_import_naming_the_tensor(marian_dir, tmp_path, call, value):
    """They were imported, and every later command refused the run with advice meant for training runs."""
    from safetensors.torch import load_file, save_file

    hf_dir = hf_copy(marian_dir, tmp_path / "hf")
    weights = load_file(hf_dir / "model.safetensors")
    weights["model.decoder.layers.1.fc2.weight"][3, 4] = value
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    err = refused(call, hf_dir, tmp_path / "run")
    assert "model.decoder.layers.1.fc2.weight holds NaN or infinite values" in err and "step_" not in err, err


def _import_in_a_thread(hf_dir: Path, run: Path) -> BaseException | None:
    """import_hf's exception (None: it succeeded), failing the test if it has not returned within 30 s."""
    outcome: list = []

    def target():
        try:
            import_hf(hf_dir, run)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - whatever it raised is the outcome
            outcome.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():  # release a reader waiting on a FIFO: it reads an end of file
        for fifo in (p for p in hf_dir.iterdir() if p.is_fifo()):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(30)
        pytest.fail("import hf waited on a FIFO")
    return outcome[0]


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "vocab.json", "source.spm"])
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_a_fifo_or_a_device_in_place_of_a_file_is_refused_not_read(marian_dir, tmp_path, name, kind):
    """config.json as a FIFO hung for ever; as a link to /dev/zero, it was read until memory ran out."""
    hf_dir = hf_copy(marian_dir, tmp_path / "hf")
    (hf_dir / name).unlink()
    if kind == "fifo":
        os.mkfifo(hf_dir / name)
    else:
        (hf_dir / name).symlink_to("/dev/zero")
    error = _import_in_a_thread(hf_dir, tmp_path / "run")
    assert isinstance(error, UserError) and f"{name} is not a regular file" in str(error), repr(error)


def test_a_json_file_larger_than_any_is_refused_before_it_is_read(marian_dir, tmp_path):
    hf_dir = hf_copy(marian_dir, tmp_path / "hf")
    with open(hf_dir / "config.json", "r+b") as f:
        f.truncate(64 << 20)  # sparse: no disk
    with pytest.raises(UserError, match="config.json is larger than 16 MiB"):
        import_hf(hf_dir, tmp_path / "run")


def test_only_the_files_read_are_hashed_and_none_whole(marian_dir, tmp_path):
    """Every file of the directory was read whole to hash it: a 3 GiB file beside the model took 3.4 GB (30 GiB: a
    MemoryError). Now the files the import read are hashed, block by block; another file is no source."""
    import hashlib

    hf_dir = hf_copy(marian_dir, tmp_path / "hf")
    with open(hf_dir / "tf_model.h5", "wb") as f:  # another framework's copy of the weights (sparse: no disk)
        f.truncate(512 << 20)
    tracemalloc.start()
    try:
        run, _ = import_hf(hf_dir, tmp_path / "run")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 128 << 20, f"{peak / 2**20:.0f} MiB of Python objects at once"
    hashed = json.loads((run / "transformer-import.json").read_text())["source_files"]
    read = {"config.json", "generation_config.json", "model.safetensors", *MarianVocab.load(hf_dir).files}
    assert set(hashed) == read
    for name in read:
        assert hashed[name] == hashlib.sha256((hf_dir / name).read_bytes()).hexdigest()


def test_force_never_replaces_a_file_changed_since_the_import(marian_dir, tmp_path, call):
    """--force replaced a config.yaml the user had edited after the import: the record listed names, not contents."""
    run = tmp_path / "run"
    assert call("import", "hf", marian_dir, run)[0] == 0
    edited = (run / "config.yaml").read_text().replace("beam: 4", "beam: 6")
    (run / "config.yaml").write_text(edited)
    status, _, err = call("import", "hf", marian_dir, run, "--force")
    assert status == 2 and f"{run / 'config.yaml'} was changed since" in err and len(err.splitlines()) == 1, err
    assert (run / "config.yaml").read_text() == edited
    (run / "config.yaml").unlink()  # a file the record lists, removed: nothing of the user's is lost
    assert call("import", "hf", marian_dir, run, "--force")[0] == 0
    assert "beam: 4" in (run / "config.yaml").read_text()
