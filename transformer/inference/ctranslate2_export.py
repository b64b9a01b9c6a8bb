"""`transformer export ctranslate2` and the conversion `--engine ctranslate2` keeps: a checkpoint as a CTranslate2 model
directory (build_spec), the copy cached beside a checkpoint (rebuilt when the checkpoint changes), and the records that
make a directory ours to replace (write_export: what --force may replace, for hf_export.py and hf_import.py too)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from transformer.errors import UserError
from transformer.files import JSON_LIMIT, current_umask, file_sha256, read_regular
from transformer.model.checkpoint import load_model, resolve_checkpoint
from transformer.run_dir import RunDir

# The records that make a directory ours to replace (never its file names: a user's folder may hold a model.bin).
SOURCE_RECORD = "source.json"  # in a cached conversion: which checkpoint file it was made from, and its files
EXPORT_RECORD = "transformer-export.json"  # in an export: that `export` wrote it, and its files
EXPORT_FORMAT = "transformer-ctranslate2-export-v1"
VMAP = "vmap.txt"  # CTranslate2's vocabulary map, which its use_vmap reads: the run's shortlist.txt, copied
# What build_spec writes, in a cached conversion's record: one without it (or another) is converted again. 2: the
# attention return_attention gives is the last layer's averaged over all heads (alignment.py's), not the first head's.
SPEC_VERSION = 2
# Every export of ours (hf_export.HF_EXPORT_FORMAT too): --force may replace any of them, and nothing else.
EXPORT_FORMATS = (EXPORT_FORMAT, "transformer-hf-export-v1")
# What `import hf` writes (RunDir.IMPORT, hf_import.IMPORT_FORMAT): --force there replaces an earlier import alone.
IMPORT_FORMATS = ("transformer-hf-import-v1",)
RECORD_FORMATS = {EXPORT_RECORD: EXPORT_FORMATS, RunDir.IMPORT: IMPORT_FORMATS}


def require_ctranslate2():
    """The ctranslate2 module, or a one-line error naming the optional extra that installs it."""
    try:
        import ctranslate2
    except ImportError:
        raise UserError(
            "CTranslate2 is not installed: pip install 'transformer[ctranslate2]' (or pip install ctranslate2)"
        ) from None
    return ctranslate2


def _linear(spec, *linears) -> None:
    """Set a CTranslate2 LinearSpec from one nn.Linear, or from several fused along the output axis."""
    spec.weight = torch.cat([m.weight.detach() for m in linears]).float().numpy()  # (out, in)
    if linears[0].bias is not None:
        spec.bias = torch.cat([m.bias.detach() for m in linears]).float().numpy()


def _norm(spec, norm) -> None:
    spec.gamma = norm.weight.detach().float().numpy()
    spec.beta = norm.bias.detach().float().numpy()


def build_spec(model, pieces: list[str]):
    """A ctranslate2 TransformerSpec holding our model's weights and vocabulary (pieces in id order; the special
    tokens are the model's vocabulary's: a Marian vocabulary's decoder starts from <pad>)."""
    from ctranslate2.specs import common_spec, transformer_spec

    c, positions = model.cfg, model.position_encoding
    activation = {"relu": common_spec.Activation.RELU, "swish": common_spec.Activation.SWISH}[c.activation]
    # What TransformerSpec.from_config builds, with the positions' own options (from_config takes no rotary_dim).
    shared = dict(pre_norm=c.norm == "pre", no_final_norm=c.norm == "post", activation=activation)
    shared.update(positions.ctranslate2_options())
    encoder = transformer_spec.TransformerEncoderSpec(c.n_encoder_layers, c.n_heads, **shared)
    # return_attention's weights: the last decoder layer's cross-attention averaged over all its heads, as
    # alignment.py's default (CTranslate2's own default is the first head alone).
    decoder = transformer_spec.TransformerDecoderSpec(
        c.n_decoder_layers, c.n_heads, alignment_layer=-1, alignment_heads=c.n_heads, **shared
    )
    spec = transformer_spec.TransformerSpec(encoder, decoder)
    for name, side, embedding, final_norm in (
        ("source", spec.encoder, model.src_embed, model.encoder_norm),
        ("target", spec.decoder, model.tgt_embed, model.decoder_norm),
    ):
        embeddings = side.embeddings[0] if isinstance(side.embeddings, list) else side.embeddings
        embeddings.weight = embedding.weight.detach().float().numpy()
        side.scale_embeddings = True  # x * sqrt(d_model), as in _embed
        table = positions.ctranslate2_encodings(name)  # (P, C): ours, never CTranslate2's own; None: none added
        if table is not None:
            side.position_encodings.encodings = table
        if c.norm == "pre":
            _norm(side.layer_norm, final_norm)
    for layer_spec, layer in zip(spec.encoder.layer, model.encoder_layers):
        a = layer.self_attn
        _linear(layer_spec.self_attention.linear[0], a.q_proj, a.k_proj, a.v_proj)
        _linear(layer_spec.self_attention.linear[1], a.out_proj)
        _norm(layer_spec.self_attention.layer_norm, layer.sub_attn.norm)
        _linear(layer_spec.ffn.linear_0, layer.ffn.fc1)
        _linear(layer_spec.ffn.linear_1, layer.ffn.fc2)
        _norm(layer_spec.ffn.layer_norm, layer.sub_ffn.norm)
    for layer_spec, layer in zip(spec.decoder.layer, model.decoder_layers):
        a, x = layer.self_attn, layer.cross_attn
        _linear(layer_spec.self_attention.linear[0], a.q_proj, a.k_proj, a.v_proj)
        _linear(layer_spec.self_attention.linear[1], a.out_proj)
        _norm(layer_spec.self_attention.layer_norm, layer.sub_self.norm)
        _linear(layer_spec.attention.linear[0], x.q_proj)
        _linear(layer_spec.attention.linear[1], x.k_proj, x.v_proj)
        _linear(layer_spec.attention.linear[2], x.out_proj)
        _norm(layer_spec.attention.layer_norm, layer.sub_cross.norm)
        _linear(layer_spec.ffn.linear_0, layer.ffn.fc1)
        _linear(layer_spec.ffn.linear_1, layer.ffn.fc2)
        _norm(layer_spec.ffn.layer_norm, layer.sub_ffn.norm)
    _linear(spec.decoder.projection, model.output)  # with its bias where model.output_bias

    specials = model.specials
    spec.config.add_source_eos = True  # our encoder always saw the source followed by </s>
    spec.config.bos_token = pieces[specials.bos]
    spec.config.eos_token = pieces[specials.eos]
    spec.config.unk_token = pieces[specials.unk]
    spec.config.decoder_start_token = pieces[specials.bos]
    spec.config.layer_norm_epsilon = c.layer_norm_eps
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    return spec


def _write_model(checkpoint: Path, out_dir: Path, quantization: str | None) -> None:
    model, vocab, _ = load_model(checkpoint, "cpu")
    spec = build_spec(model.eval(), vocab.pieces(range(len(vocab))))
    spec.validate()
    spec.optimize(quantization=quantization)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec.save(str(out_dir))
    for name, data in vocab.files.items():  # CTranslate2 takes pieces: these make them (spm.model, or Marian's)
        (out_dir / name).write_bytes(data)
    shortlist = checkpoint.parent / RunDir.SHORTLIST
    if shortlist.is_file():  # the run's lexical shortlist is CTranslate2's vocabulary map: its use_vmap reads it
        shutil.copyfile(shortlist, out_dir / VMAP)


def _read_record(path: Path) -> dict:
    """A JSON record (an empty dict when it is missing, unreadable, no regular file, or not a JSON object)."""
    try:
        record = json.loads(read_regular(path, JSON_LIMIT, "record").decode("utf-8"))
    except (UserError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _file_stamps(directory: Path) -> dict[str, list[int]]:
    """[size, mtime_ns] of every file just written into `directory`: what a cached conversion's record lists as ours
    (a conversion whose files changed is not current, and is made again)."""
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(directory.iterdir())}


def _file_contents(directory: Path) -> dict[str, dict]:
    """The size and sha256 of every file just written into `directory`: what an export's record lists as ours, and
    what --force compares (an mtime is no proof: an edit can keep it, a copy changes it)."""
    return {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in sorted(directory.iterdir())}


def _changed_since(target: Path, record_name: str) -> str | None:
    """The first file an export's record lists that is no longer what was written (a config.yaml edited since): its
    name, or None. An earlier version's record holds [size, mtime_ns] per file: those are compared instead."""
    files = _read_record(target / record_name).get("files")
    for name, written in files.items() if isinstance(files, dict) else ():
        path = target / name
        if not path.is_file() or path.is_symlink():  # a file removed since: nothing of the user's to lose
            continue
        size = path.stat().st_size
        if isinstance(written, dict):
            changed = written.get("size") != size or written.get("sha256") != file_sha256(path)
        else:
            changed = written != [size, path.stat().st_mtime_ns]
        if changed:
            return name
    return None


def _changed_error(target: Path, name: str, record_name: str, what: str) -> UserError:
    return UserError(
        f"{what}: {target / name} was changed since {record_name} recorded it; it is never replaced: move it away, "
        "or delete the directory yourself to replace it"
    )


def _replaceable(target: Path, record_name: str) -> set[str] | None:
    """The names to remove so that `target` can be replaced: none when it is absent or an empty directory; the files
    of a directory whose record (record_name, ours) lists every file in it. None: not ours, never to be replaced."""
    if not target.exists() and not target.is_symlink():
        return set()
    if target.is_symlink() or not target.is_dir():
        return None
    entries = {p.name: p for p in target.iterdir()}
    if not entries:
        return set()
    record = _read_record(target / record_name)
    ours = (
        record.get("format") in RECORD_FORMATS[record_name]
        if record_name in RECORD_FORMATS
        else {"checkpoint", "size", "mtime_ns"} <= record.keys()
    )
    files = record.get("files", entries)  # an earlier version's source.json lists none
    if (
        not ours
        or not isinstance(files, (dict, list))
        or not set(entries) <= set(files) | {record_name}
        or any(p.is_symlink() or not p.is_file() for p in entries.values())
    ):
        return None
    return set(entries)


def _not_ours(target: Path, record_name: str, what: str) -> UserError:
    return UserError(
        f"{what}: {target} exists and is not a directory this program wrote (no {record_name} of ours "
        "listing every file in it); it is never replaced: move it away or choose another directory "
        "(an export or conversion by an earlier version has no such record: delete it yourself)"
    )


def _replace_ours(target: Path, staging: Path, record_name: str, what: str) -> None:
    """Put `staging` where `target` is, if _replaceable (checked again now, at the last moment): only the files
    that its record lists are removed, by name; an export's or import's only if none of them was changed since."""
    ours = _replaceable(target, record_name)
    if ours is None:
        raise _not_ours(target, record_name, what)
    changed = _changed_since(target, record_name) if record_name in RECORD_FORMATS and ours else None
    if changed is not None:
        raise _changed_error(target, changed, record_name, what)
    if target.exists():
        for name in ours:
            (target / name).unlink(missing_ok=True)
        target.rmdir()
    os.replace(staging, target)


def export_ctranslate2(
    checkpoint: str | Path, out_dir: str | Path, quantization: str | None = None, force: bool = False
) -> Path:
    """Write a CTranslate2 model directory (model.bin, vocabularies, our spm.model, and EXPORT_RECORD) for
    `checkpoint` (a run directory or .pt file); returns it. CTranslate2 appends </s> to the source itself.
    force: replace an earlier export (its record lists every file there) or an empty directory, nothing else."""
    require_ctranslate2()
    source = resolve_checkpoint(checkpoint)

    def write(staging: Path) -> dict:
        _write_model(source, staging, quantization)
        return {"checkpoint": str(source), "quantization": quantization}

    return write_export(out_dir, force, EXPORT_FORMAT, write)


def write_export(
    out_dir: str | Path,
    force: bool,
    export_format: str,
    write: Callable[[Path], dict],
    record_name: str = EXPORT_RECORD,
    what: str = "export",
) -> Path:
    """The export directory `out_dir`, made by write(staging) (which returns what the record says besides the format
    and the files) in a directory beside it, then put in its place: an existing out_dir only with force, and only
    when it is an earlier export of ours (EXPORT_FORMATS; for `import hf`, record_name RunDir.IMPORT: an earlier
    import) whose files are all as it wrote them (its record holds their sha256), or empty. Returns out_dir as
    given."""
    if not str(out_dir).strip():  # realpath('') is the working directory: it would be "replaced"
        raise UserError(f"{what}: the output directory is an empty name; give the directory to write")
    given, out_dir = out_dir, Path(os.path.realpath(out_dir))  # a link to the directory stays a link
    if out_dir.exists():
        if not force:
            raise UserError(f"{what}: {given} exists; add --force to replace it")
        if _replaceable(out_dir, record_name) is None:
            raise _not_ours(Path(given), record_name, what)
        changed = _changed_since(out_dir, record_name)
        if changed is not None:  # before converting, not only at the end
            raise _changed_error(Path(given), changed, record_name, what)
    # Converted beside it first: a conversion that fails leaves the earlier export as it was.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = _staging_dir(out_dir)
    try:
        about = write(staging)
        record = {"format": export_format, **about, "files": _file_contents(staging)}
        (staging / record_name).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        _replace_ours(out_dir, staging, record_name, what)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Path(given)


def _staging_dir(target: Path) -> Path:
    """A new directory beside `target` to convert into, as readable as one made with mkdir (mkdtemp's is private,
    and it becomes the export)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    os.chmod(staging, 0o777 & ~current_umask())
    return staging


def _shortlist_stamp(checkpoint: Path) -> list[int] | None:
    """[size, mtime_ns] of the run's shortlist.txt, which a conversion copies (None: it has none)."""
    try:
        stat = (checkpoint.parent / RunDir.SHORTLIST).stat()
    except OSError:
        return None
    return [stat.st_size, stat.st_mtime_ns]


def _fingerprint(path: Path, with_hash: bool) -> dict:
    stat = path.stat()
    record = {"checkpoint": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    record["shortlist"] = _shortlist_stamp(path)  # a list written, changed or removed since: converted again
    if with_hash:
        record["sha256"] = file_sha256(path)
    return record


def _cache_is_current(model_dir: Path, checkpoint: Path) -> bool:
    """Every file the conversion wrote still there with its size and mtime (a deleted, torn or edited file: not
    current), and the checkpoint's size and mtime unchanged or (a copied or touched file) the same bytes by sha256.
    A record of an earlier version (no files listed, another SPEC_VERSION): converted again, once."""
    record = _read_record(model_dir / SOURCE_RECORD)
    files = record.get("files")
    if not isinstance(files, dict) or "model.bin" not in files or record.get("spec") != SPEC_VERSION:
        return False
    for name, stamp in files.items():
        try:
            stat = (model_dir / name).stat()
        except OSError:
            return False
        if [stat.st_size, stat.st_mtime_ns] != stamp:
            return False
    now = _fingerprint(checkpoint, with_hash=False)
    if record.get("shortlist") != now["shortlist"]:
        return False
    if record.get("size") == now["size"] and record.get("mtime_ns") == now["mtime_ns"]:
        return True
    return record.get("size") == now["size"] and record.get("sha256") == _fingerprint(checkpoint, True)["sha256"]


def cached_conversion(checkpoint: str | Path) -> Path:
    """The CTranslate2 conversion of `checkpoint`, made once and kept in CHECKPOINT_DIR/ct2/<stem>/ with a
    record of the checkpoint it came from; rebuilt when that checkpoint changes. Where that directory
    cannot be written, converts into a temporary directory instead (each time), with a warning."""
    require_ctranslate2()
    source = resolve_checkpoint(checkpoint).resolve()
    target = source.parent / RunDir.CT2 / source.stem
    if _cache_is_current(target, source):
        return target
    if _replaceable(target, SOURCE_RECORD) is None:  # a folder of the user's there: never emptied
        raise _not_ours(target, SOURCE_RECORD, "--engine ctranslate2")
    print(f"converting {source} for CTranslate2 into {target} (once per checkpoint)", file=sys.stderr)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = _staging_dir(target)
    except OSError as e:
        staging = Path(tempfile.mkdtemp(prefix="transformer_ct2_"))
        print(
            f"warning: cannot write {target.parent} ({e.strerror}); converted into {staging}, which is not reused",
            file=sys.stderr,
        )
        _write_model(source, staging, None)
        return staging
    try:
        source_stamp = _fingerprint(source, with_hash=True)  # before copying: a change meanwhile converts again
        _write_model(source, staging, None)
        record = {**source_stamp, "spec": SPEC_VERSION, "files": _file_stamps(staging)}
        (staging / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        # Readers load model.bin when they start, so swapping the directory under them is safe.
        try:
            _replace_ours(target, staging, SOURCE_RECORD, "--engine ctranslate2")
        except OSError:  # another process put its conversion there first: that one is as good
            if not _cache_is_current(target, source):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def run_export(checkpoint: str, out_dir: str, quantization: str | None, force: bool) -> None:
    """The `export ctranslate2` command."""
    print(f"wrote {export_ctranslate2(checkpoint, out_dir, quantization, force)}")
