"""`transformer import hf`: a transformers MarianMTModel directory (an OPUS-MT model, as save_pretrained writes it) as a
run directory that every verb takes; a directory of another architecture, or a setting we cannot honour, is refused.

What an OPUS-MT model differs in from the paper's base model, and the setting each maps to (docs/opus-mt.md):
activation_function "swish" -> model.activation; final_logits_bias -> model.output_bias (kept only where it is not
all zeros); MarianSinusoidalPositionalEmbedding (sines, then cosines) -> model.positions "marian";
max_position_embeddings -> model.max_positions; its vocabulary (source.spm, target.spm, vocab.json, </s> = 0,
<pad> last and the decoder's start) -> the Marian vocabulary kind (data/vocab.py); generate's defaults
(length ** length_penalty, early_stopping False) -> decode.lenpen_kind "length", decode.stop "hf".
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from transformer.config import Config, from_dict, lenpen_problem, positions_problem, save_config, to_dict
from transformer.data.vocab import MARIAN_FILES, MarianVocab
from transformer.errors import UserError, first_line
from transformer.files import JSON_LIMIT, file_sha256, read_regular
from transformer.inference.ctranslate2_export import IMPORT_FORMATS, write_export
from transformer.inference.settings import OPTIONS, beam_above_vocabulary
from transformer.model import positions
from transformer.model.checkpoint import nonfinite, save_checkpoint, weights_checkpoint
from transformer.model.transformer import Transformer
from transformer.run_dir import RunDir

IMPORT_FORMAT = IMPORT_FORMATS[0]
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # the first found is read
# MarianConfig's activation_function -> model.activation (ACT2FN's "swish" and "silu" are one function).
ACTIVATIONS = {"relu": "relu", "swish": "swish", "silu": "swish"}
# generate's early_stopping -> our stop rule: the table's mapping (settings.py), read backwards.
STOP_RULES = {theirs: ours for ours, theirs in OPTIONS["stop"].generate.values.items()}
CONFIG_HEADER = "# The config of a model that `transformer import hf` imported (the source: transformer-import.json)."
POSITIONS_TOLERANCE = 1e-4  # a stored sinusoid table may be fp16: its values within this of the computed one
# Every model of ours computes its sinusoid table whole, max_positions x d_model (in float64 first), when it is built:
# OPUS-MT's models have 512 positions, and transformers 5 saves no table that would bound a larger number.
MAX_POSITIONS = 1 << 14
GENERATION_CONFIG = "generation_config.json"
LAYER_NAME = re.compile(r"model\.(encoder|decoder)\.layers\.(\d+)\.")


def _whole(value) -> bool:
    """A JSON integer (true and false are not: Python counts them as 1 and 0)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _json(path: Path) -> dict:
    data = read_regular(path, JSON_LIMIT, "import hf")
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UserError(f"import hf: {path} is not a JSON file ({first_line(e)})") from None
    if not isinstance(value, dict):
        raise UserError(f"import hf: {path} does not hold a JSON object")
    return value


def marian_settings(config: dict, where: Path) -> dict:
    """model.* for a MarianConfig, or a one-line refusal naming the first setting we cannot honour and its value. Each
    key's own value is checked first (its type, its range), then what keys must agree on: a message names the key
    that is wrong, never one it is compared with."""

    def refuse(key: str, why: str):
        raise UserError(f"import hf: {where}: {key} is {config.get(key)!r}: {why}")

    max_positions = _checked_values(config, refuse)
    activation = _checked_agreement(config, refuse)
    get = config.get
    problem = positions_problem(
        positions.Marian.name, get("d_model"), get("encoder_attention_heads"), ("d_model", "encoder_attention_heads")
    )
    if problem is not None:
        raise UserError(f"import hf: {where}: {problem}")
    return {
        "d_model": get("d_model"),
        "n_heads": get("encoder_attention_heads"),
        "n_encoder_layers": get("encoder_layers"),
        "n_decoder_layers": get("decoder_layers"),
        "d_ff": get("encoder_ffn_dim"),
        "dropout": get("dropout", 0.1),
        "attention_dropout": get("attention_dropout", 0.0),
        "activation_dropout": get("activation_dropout", 0.0),
        "max_positions": max_positions,
        "positions": positions.Marian.name,  # the sinusoids in Marian's layout
        "norm": "post",
        "share_embeddings": get("share_encoder_decoder_embeddings", True),
        "tie_output": get("tie_word_embeddings", True),
        "activation": ACTIVATIONS[activation],
        "layer_norm_eps": 1e-5,  # MarianMTModel's LayerNorms: torch's default
    }


def _checked_values(config: dict, refuse) -> int:
    """Each key's own value checked (its type, its range), refused in one line (`refuse(key, why)`) -> the model's
    positions."""
    get = config.get
    if get("model_type") != "marian":
        refuse(
            "model_type",
            "only transformers MarianMTModel directories (model_type 'marian': OPUS-MT) can be imported; BART, T5, "
            "M2M100 and the others are other architectures",
        )
    if (get("architectures") or ["MarianMTModel"]) != ["MarianMTModel"]:
        refuse("architectures", "only MarianMTModel (an encoder-decoder) can be imported")
    sizes = ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads")
    sizes += ("decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim")
    for key in sizes:
        if not _whole(get(key)) or get(key) < 1:
            refuse(key, "it must be a positive whole number")
    if (
        "decoder_vocab_size" in config
        and get("decoder_vocab_size") is not None
        and not _whole(get("decoder_vocab_size"))
    ):
        refuse("decoder_vocab_size", "it must be a whole number")
    max_positions = get("max_position_embeddings", 512)
    if not _whole(max_positions) or not 3 <= max_positions <= MAX_POSITIONS:
        refuse("max_position_embeddings", f"it must be a whole number from 3 to {MAX_POSITIONS}")
    for key in ("scale_embedding", "share_encoder_decoder_embeddings", "tie_word_embeddings"):
        if key in config and not isinstance(get(key), bool):
            refuse(key, "it must be true or false")
    for key in ("dropout", "attention_dropout", "activation_dropout"):
        if key in config and not (_number(get(key)) and 0 <= get(key) < 1):
            refuse(key, "it must be a number from 0 up to (not including) 1")
    return max_positions


def _checked_agreement(config: dict, refuse) -> str:
    """What we cannot honour (no scaled embeddings, another activation, layer drop), then what keys must agree on,
    now that each holds a value of its kind, refused in one line -> the activation function's name."""
    get = config.get
    activation = get("activation_function", "gelu")
    layerdrop = ("encoder_layerdrop", "decoder_layerdrop")
    checks = [
        ("scale_embedding", get("scale_embedding", False) is True, "our embeddings are always scaled by sqrt(d_model)"),
        (
            "activation_function",
            isinstance(activation, str) and activation in ACTIVATIONS,
            "only relu and swish are supported",
        ),
        *(
            (key, get(key) is None or (_number(get(key)) and get(key) == 0), "layer drop is not supported")
            for key in layerdrop
        ),
        # What keys must agree on, now that each holds a value of its kind.
        (
            "decoder_attention_heads",
            get("decoder_attention_heads") == get("encoder_attention_heads"),
            "the encoder and decoder must have as many heads (model.n_heads)",
        ),
        ("decoder_ffn_dim", get("decoder_ffn_dim") == get("encoder_ffn_dim"), "one model.d_ff for both sides"),
        (
            "decoder_vocab_size",
            get("decoder_vocab_size") in (None, get("vocab_size")),
            "a target vocabulary of another size (separate vocabularies) is not supported",
        ),
        (
            "d_model",
            get("d_model") % get("encoder_attention_heads") == 0,
            f"it must be a multiple of encoder_attention_heads ({get('encoder_attention_heads')})",
        ),
    ]
    for key, ok, why in checks:
        if not ok:
            refuse(key, why)
    return activation


def start_piece(config: dict, vocab: MarianVocab, where: Path) -> str | None:
    """The piece the decoder starts from (config.json's decoder_start_token_id): None for <pad>, OPUS-MT's."""
    start = config.get("decoder_start_token_id", vocab.specials.pad)
    if not _whole(start) or not 0 <= start < len(vocab):
        raise UserError(f"import hf: {where}: decoder_start_token_id is {start!r}: not an id of vocab.json")
    return None if start == vocab.specials.pad else vocab.pieces([start])[0]


def check_special_ids(config: dict, vocab: MarianVocab, where: Path) -> None:
    """config.json's token ids must be the tokenizer's: pad and eos."""
    s = vocab.specials
    for key, expected in (("pad_token_id", s.pad), ("eos_token_id", s.eos)):
        found = config.get(key, expected)
        if not _whole(found) or found != expected:
            raise UserError(
                f"import hf: {where}: {key} is {config.get(key)!r} but the tokenizer's is {expected} "
                f"({vocab.pieces([expected])[0]}): the model and its tokenizer disagree"
            )
    if config.get("vocab_size") != len(vocab):
        raise UserError(
            f"import hf: {where}: vocab_size is {config.get('vocab_size')!r} but vocab.json holds {len(vocab)} pieces"
        )


def decode_settings(generation: dict, config: dict, where: Path, vocab_size: int) -> dict:
    """decode.* that search as generate() would with this directory's generation settings (its generation_config.json,
    else config.json's keys, else generate's defaults), and only settings every later search accepts."""

    def get(key, default):
        return generation.get(key, config.get(key, default))

    beam, lenpen, early = get("num_beams", 1), get("length_penalty", 1.0), get("early_stopping", False)
    if not _whole(beam) or beam < 1:
        raise UserError(f"import hf: {where}: num_beams is {beam!r}: it must be a whole number from 1")
    if beam > vocab_size:  # what search_settings refuses each translate with: refused here once
        raise UserError(f"import hf: {where}: num_beams is {beam}: {beam_above_vocabulary(beam, vocab_size)}")
    problem = lenpen_problem(lenpen, "length_penalty")
    if problem is not None:
        raise UserError(f"import hf: {where}: {problem}")
    if not isinstance(early, (bool, str)) or early not in STOP_RULES:  # a list or an object cannot be looked up
        raise UserError(f'import hf: {where}: early_stopping is {early!r}: it must be true, false or "never"')
    renormalize = generation.get("renormalize_logits", False)
    if not isinstance(renormalize, bool):
        raise UserError(f"import hf: {where}: renormalize_logits is {renormalize!r}: it must be true or false")
    return {"beam": beam, "lenpen": float(lenpen), "lenpen_kind": "length", "stop": STOP_RULES[early]}


def read_weights(hf_dir: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The checkpoint's tensors in float32, from model.safetensors or pytorch_model.bin: a flat mapping of names to
    floating-point tensors, none of them NaN or infinite."""
    for name in WEIGHT_FILES:
        path = hf_dir / name
        if path.exists() or path.is_symlink():
            break
    else:
        raise UserError(f"import hf: {hf_dir} holds no {' or '.join(WEIGHT_FILES)}")
    if not path.is_file():  # a FIFO waits for a writer, a device never ends
        raise UserError(f"import hf: {path} is not a regular file (a directory, a pipe or a device); give the file")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(path)
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # both readers report a torn or foreign file through many exception types
        raise UserError(f"import hf: {path} cannot be read as a weights file ({first_line(e)})") from None
    # torch.load returns whatever was pickled: an int, a string, a nested state of another program.
    if not isinstance(tensors, dict) or not tensors:
        raise UserError(f"import hf: {path} holds no weights (a model's file maps each weight's name to a tensor)")
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            what = f"a {tensor.dtype} tensor" if isinstance(tensor, torch.Tensor) else f"a {type(tensor).__name__}"
            raise UserError(
                f"import hf: {path} holds {what} under {name!r}: a model's file maps each weight's name to a "
                "floating-point tensor"
            )
    bad = nonfinite(tensors)
    if bad:  # refused here, in the file's names: a run of ours with them would be refused by every command
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UserError(
            f"import hf: {path}: {bad[0]}{more} holds NaN or infinite values: the file is corrupt or its model "
            "diverged; download or save it again"
        )
    return {k: v.float() for k, v in tensors.items()}, path


def check_sizes(config: dict, tensors: dict[str, torch.Tensor], where: Path, path: Path) -> None:
    """config.json's sizes against the file's tensors, before anything of those sizes is made (a model at a
    d_model of 8192 takes gigabytes; even on the meta device, its positions table is computed): the embeddings are
    (vocab_size, d_model), each side holds its number of layers, and the first layer's fc1 is (ffn_dim, d_model).
    The other weights' shapes follow from these (imported's meta model checks them)."""

    def refuse(key: str, found: str):
        raise UserError(f"import hf: {where}: {key} is {config[key]!r} but {path} holds {found}")

    name = next((n for n in ("model.encoder.embed_tokens.weight", "model.shared.weight") if n in tensors), None)
    if name is None:
        raise UserError(f"import hf: {path} lacks the weight model.shared.weight")
    shape = tuple(tensors[name].shape)
    if len(shape) != 2 or shape[1] != config["d_model"]:
        refuse("d_model", f"{name} of shape {shape}")
    if shape[0] != config["vocab_size"]:
        refuse("vocab_size", f"{name} of shape {shape}")
    layers: dict[str, set[int]] = {"encoder": set(), "decoder": set()}
    for found in map(LAYER_NAME.match, tensors):
        if found:
            layers[found[1]].add(int(found[2]))
    for side, held in layers.items():
        if len(held) != config[f"{side}_layers"] or held != set(range(len(held))):
            numbers = sorted(held)
            listed = ", ".join(map(str, numbers[:4])) + (", ..." if len(numbers) > 4 else "")
            refuse(f"{side}_layers", f"{len(held)} {side} layer(s)" + (f" (numbered {listed})" if held else ""))
        fc1 = f"model.{side}.layers.0.fc1.weight"
        if fc1 in tensors and tuple(tensors[fc1].shape) != (config[f"{side}_ffn_dim"], config["d_model"]):
            refuse(f"{side}_ffn_dim", f"{fc1} of shape {tuple(tensors[fc1].shape)}")


def our_weights(tensors: dict[str, torch.Tensor], cfg: Config, where: Path) -> dict[str, torch.Tensor]:
    """MarianMTModel's weights under our names (hf_export.marian_weights read backwards; "marian" positions need no
    permutation), final_logits_bias as the output's bias where model.output_bias. Tied matrices that the file stores
    once are read from the one it stores; every tensor of the file must find its place."""
    m, used = cfg.model, set()

    def take(*names: str) -> torch.Tensor:
        for name in names:
            if name in tensors:
                used.add(name)
                return tensors[name]
        raise UserError(f"import hf: {where} lacks the weight {names[0]}")

    out: dict[str, torch.Tensor] = {}

    def linear(ours: str, theirs: str) -> None:
        out[f"{ours}.weight"], out[f"{ours}.bias"] = take(f"{theirs}.weight"), take(f"{theirs}.bias")

    def attention(ours: str, theirs: str) -> None:
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear(f"{ours}.{proj}", f"{theirs}.{proj}")

    shared = ("model.shared.weight",) if m.share_embeddings else ()
    out["src_embed.weight"] = take("model.encoder.embed_tokens.weight", *shared)
    # One matrix under each name it has in our state_dict (shared or tied modules list it under both).
    out["tgt_embed.weight"] = (
        out["src_embed.weight"] if m.share_embeddings else take("model.decoder.embed_tokens.weight")
    )
    for name in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", *shared):
        if name in tensors and m.share_embeddings:  # one matrix stored under several names: it must be one
            used.add(name)
            if not torch.equal(tensors[name], out["src_embed.weight"]):
                raise UserError(f"import hf: {where}: {name} differs from the shared embeddings")
    if m.tie_output:
        if "lm_head.weight" in tensors:
            used.add("lm_head.weight")
            if not torch.equal(tensors["lm_head.weight"], out["tgt_embed.weight"]):
                raise UserError(f"import hf: {where}: lm_head.weight differs from the embeddings it is tied to")
        out["output.weight"] = out["tgt_embed.weight"]
    else:
        out["output.weight"] = take("lm_head.weight")
    table = None
    for side in ("encoder", "decoder"):
        name = f"model.{side}.embed_positions.weight"
        if name in tensors:  # transformers 5 saves none (it recomputes them); earlier versions did
            used.add(name)
            stored = tensors[name]
            if stored.shape == (m.max_positions, m.d_model) and table is None:  # computed only at the file's size
                table = positions.Marian.make_table(m.d_model, m.max_positions)
            if stored.shape != (m.max_positions, m.d_model) or (stored - table).abs().max() > POSITIONS_TOLERANCE:
                raise UserError(
                    f"import hf: {where}: {name} is not MarianMTModel's sinusoid table of {m.max_positions} x "
                    f"{m.d_model}: learned or other positions are not supported"
                )
    for i in range(m.n_encoder_layers):
        p, q = f"encoder_layers.{i}", f"model.encoder.layers.{i}"
        attention(f"{p}.self_attn", f"{q}.self_attn")
        linear(f"{p}.sub_attn.norm", f"{q}.self_attn_layer_norm")
        linear(f"{p}.ffn.fc1", f"{q}.fc1")
        linear(f"{p}.ffn.fc2", f"{q}.fc2")
        linear(f"{p}.sub_ffn.norm", f"{q}.final_layer_norm")
    for i in range(m.n_decoder_layers):
        p, q = f"decoder_layers.{i}", f"model.decoder.layers.{i}"
        attention(f"{p}.self_attn", f"{q}.self_attn")
        linear(f"{p}.sub_self.norm", f"{q}.self_attn_layer_norm")
        attention(f"{p}.cross_attn", f"{q}.encoder_attn")
        linear(f"{p}.sub_cross.norm", f"{q}.encoder_attn_layer_norm")
        linear(f"{p}.ffn.fc1", f"{q}.fc1")
        linear(f"{p}.ffn.fc2", f"{q}.fc2")
        linear(f"{p}.sub_ffn.norm", f"{q}.final_layer_norm")
    used.add("final_logits_bias")
    if m.output_bias:
        out["output.bias"] = tensors["final_logits_bias"].reshape(-1)
    unplaced = sorted(set(tensors) - used)
    if unplaced:
        raise UserError(
            f"import hf: {where} holds weights a MarianMTModel of its config.json has no place for "
            f"({', '.join(unplaced[:3])}{', ...' if len(unplaced) > 3 else ''})"
        )
    return out


@dataclass
class Imported:
    """What `import hf` writes: the run's config, its vocabulary, our model's weights (in our state_dict's order,
    tied matrices one tensor); notes for the user (what generate does that our search does not); and the files of
    the directory that were read."""

    cfg: Config
    vocab: MarianVocab
    weights: dict[str, torch.Tensor]
    notes: list[str]
    read: list[Path]


def imported(hf_dir: Path, run_dir: Path) -> Imported:
    """The directory's model as a run of ours, every size and setting checked before a model is made."""
    config_path, generation_path = hf_dir / "config.json", hf_dir / GENERATION_CONFIG
    config = _json(config_path)
    model = marian_settings(config, config_path)
    vocab = MarianVocab.load(hf_dir)
    start = start_piece(config, vocab, config_path)
    if start is not None:
        vocab = MarianVocab(vocab.files, start)
    check_special_ids(config, vocab, config_path)
    has_generation = generation_path.exists() or generation_path.is_symlink()  # a FIFO there is refused, not skipped
    generation = _json(generation_path) if has_generation else {}
    decode = decode_settings(generation, config, generation_path if generation else config_path, len(vocab))
    # generate has one limit for every source; ours is per source, capped by the positions: this makes it the cap.
    decode["max_len_offset"] = model["max_positions"]
    src_lang, tgt_lang = vocab.source_lang or "src", vocab.target_lang or "tgt"
    raw = {
        "model": model,
        "data": {
            "src_lang": src_lang,
            "tgt_lang": tgt_lang if tgt_lang != src_lang else f"{tgt_lang}2",
            "vocab_size": len(vocab),
            "spm_model_type": "unigram",  # OPUS-MT's SentencePiece models; recorded only, never trained again
            "max_len": min(256, model["max_positions"] - 2),
        },
        "train": {"run_dir": str(run_dir)},
        "decode": decode,
    }
    tensors, path = read_weights(hf_dir)
    check_sizes(config, tensors, config_path, path)
    raw["model"]["output_bias"] = bool(tensors.get("final_logits_bias", torch.zeros(1)).any())
    try:
        cfg = from_dict(raw)
    except UserError as e:
        raise UserError(f"import hf: {hf_dir}: its settings make no model of ours ({e})") from None
    weights = our_weights(tensors, cfg, path)
    # Our state_dict's names and shapes without allocating: the sinusoid table is no weight (a buffer not saved), and
    # even on the meta device it is computed, so the meta model has the shortest one.
    with torch.device("meta"):
        shapes = Transformer(dataclasses.replace(cfg.model, max_positions=2), len(vocab), vocab.specials).state_dict()
    for name, tensor in shapes.items():
        if name not in weights or weights[name].shape != tensor.shape:
            found = tuple(weights[name].shape) if name in weights else "none"
            raise UserError(
                f"import hf: {path}: {name} should have shape {tuple(tensor.shape)} for config.json's model, "
                f"it has {found}"
            )
    notes = []
    if generation.get("renormalize_logits"):
        notes.append(
            "note: its generation_config.json sets renormalize_logits: generate() rescales each step's "
            "log-probabilities by 1 - p(<pad>), which our search does not (beam outputs can differ where <pad> is "
            "given probability; docs/opus-mt.md)"
        )
    read = [config_path, *([generation_path] if has_generation else []), *(hf_dir / n for n in MARIAN_FILES), path]
    return Imported(cfg, vocab, {name: weights[name] for name in shapes}, notes, read)


def import_hf(hf_dir: str | Path, run_dir: str | Path, force: bool = False) -> tuple[Path, list[str]]:
    """Write RUN_DIR (final.pt, config.yaml, the tokenizer's four files, transformer-import.json) for the
    MarianMTModel directory hf_dir; returns it and the notes. force: replace an earlier import of ours (its record
    lists every file there, none changed since) or an empty directory, nothing else."""
    from transformer.inference.hf_export import require_transformers

    require_transformers()
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise UserError(f"import hf: {hf_dir} is not a directory (a MarianMTModel's, as save_pretrained writes it)")
    found = imported(hf_dir, Path(run_dir))

    def write(staging: Path) -> dict:
        final = RunDir(staging).final
        about = {"imported_from": str(hf_dir.resolve())}
        save_checkpoint(weights_checkpoint(to_dict(found.cfg), found.vocab.stored, found.weights, **about), final)
        save_config(found.cfg, RunDir(staging).config, header=CONFIG_HEADER)
        for name, data in found.vocab.files.items():
            (staging / name).write_bytes(data)
        # The files it read, hashed block by block (a weights file may be gigabytes); the others are no source.
        return {"source": str(hf_dir.resolve()), "source_files": {p.name: file_sha256(p) for p in found.read}}

    return write_export(run_dir, force, IMPORT_FORMAT, write, RunDir.IMPORT, "import hf"), found.notes


def run_import_hf(hf_dir: str, run_dir: str, force: bool) -> None:
    """The `import hf` command."""
    out, notes = import_hf(hf_dir, run_dir, force)
    for note in notes:
        print(note, file=sys.stderr)
    print(f"wrote {out}")
