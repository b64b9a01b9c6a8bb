"""CTranslate2 as an engine: `transformer export ctranslate2` (a checkpoint as a CTranslate2 model directory), the
converted copy that `--engine ctranslate2` keeps beside a checkpoint (rebuilt when the checkpoint changes), and the
search through it (`ctranslate2_search`: our batches, length limits, scores and settings mapped onto its
translate_batch)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from transformer.data.batch import source_limit
from transformer.data.loader import source_batches
from transformer.data.vocab import AnyVocab
from transformer.errors import UserError
from transformer.files import JSON_LIMIT, current_umask, file_sha256, read_regular
from transformer.inference.search import Hypothesis, length_penalty, max_output_lengths
from transformer.inference.settings import SearchSettings, ctranslate2_keywords, ctranslate2_rescores, parse_sample
from transformer.model.checkpoint import load_model, resolve_checkpoint
from transformer.run_dir import RunDir

# The records that make a directory ours to replace (never its file names: a user's folder may hold a model.bin).
SOURCE_RECORD = "source.json"  # in a cached conversion: which checkpoint file it was made from, and its files
EXPORT_RECORD = "transformer-export.json"  # in an export: that `export` wrote it, and its files
EXPORT_FORMAT = "transformer-ctranslate2-export-v1"
# What build_spec writes, in a cached conversion's record: one without it (or another) is converted again. 2: the
# attention return_attention gives is the last layer's averaged over all heads (alignment.py's), not the first head's.
SPEC_VERSION = 2
# Every export of ours (hf_export.HF_EXPORT_FORMAT too): --force may replace any of them, and nothing else.
EXPORT_FORMATS = (EXPORT_FORMAT, "transformer-hf-export-v1")
# What `import hf` writes (RunDir.IMPORT, hf_import.IMPORT_FORMAT): --force there replaces an earlier import alone.
IMPORT_FORMATS = ("transformer-hf-import-v1",)
RECORD_FORMATS = {EXPORT_RECORD: EXPORT_FORMATS, RunDir.IMPORT: IMPORT_FORMATS}
CT2_COMPUTE_TYPES = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8"}  # our dtype -> its compute_type


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


def _fingerprint(path: Path, with_hash: bool) -> dict:
    stat = path.stat()
    record = {"checkpoint": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
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
        _write_model(source, staging, None)
        record = {**_fingerprint(source, with_hash=True), "spec": SPEC_VERSION, "files": _file_stamps(staging)}
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


# --------------------------------------------------------------------------- the search through CTranslate2


def ctranslate2_search(
    translator,
    vocab: AnyVocab,
    src_ids: Sequence[Sequence[int]],
    settings: SearchSettings,
    max_positions: int,
    prefixes: Sequence[Sequence[int]] | None = None,
) -> list[list[Hypothesis]]:
    """translator.search_ids through a ctranslate2.Translator of the same model: the same batches, sources, length
    limits and score definition; like ours, it never emits BOS or PAD. settings.stop, .dtype and .workers do not
    apply here (the translator was made with its compute type and inter_threads).

    Length limits (one per call in CTranslate2): a batch goes as one call, and a sentence one of whose returned
    hypotheses comes within a token of its own limit is searched again under its own limit
    (ctranslate2_limited). With a length penalty the first search stops, as CTranslate2 stops, at the step its
    `beam`-th hypothesis finishes, and it returns its `beam` best finished ones: a search that ran past the step
    where its own limit would have ended it had fewer than `beam` finished by then, so one it returns is longer
    and it is always seen and done again; one that did not is, step for step, the search under its own limit.
    The outcome is the search under its own limit whatever the call's limit, so the call takes the largest of
    its sentences' buckets (limit_bucket: a limit rounded up to a power of two, which bounds what a sentence
    that runs on costs). Without one (lenpen 0: it returns `nbest` and stops once its best candidate is EOS) a
    search can run past that step unseen, when its `nbest` returned finished earlier: those are then the
    outcome, so each sentence is searched under its own bucket, one call per bucket. Either way a sentence's
    output depends on the sentence alone, never on the others in its batch.

    Scores, in one pass: BOS and PAD are not suppressed in the search, so each step's log-probabilities are
    normalised over the whole vocabulary, as ours are, and its search scores are ours (to float rounding, ~1e-5
    a hypothesis): no scoring pass is needed. (Suppressing them, as its suppress_sequences does, renormalises
    over the tokens left, slightly off ours at every token, so every shown score took a scoring pass.) A
    sentence one of whose returned hypotheses holds BOS or PAD (an untrained model) is searched again under
    its own limit with both suppressed, and its hypotheses scored again. Scored again too, by CTranslate2's
    scorer (ours exactly): hypotheses searched again under their own limit (at the limit CTranslate2 does not
    force EOS, so one still unfinished there has none, and the scorer adds the EOS ours would force), those
    with a forced prefix (its search score leaves the prefix's tokens out), and every one under a setting that
    its search renormalises for (settings.ctranslate2_rescores: its logits processors, as no_repeat_ngram_size,
    rule out tokens before its softmax, so its beam ranks by other scores than ours and may keep another).

    Ranking: with a length penalty it returns its `beam` best, ranked by its own penalty (length**lenpen
    rather than GNMT's ((5 + length) / 6)**lenpen; length counting EOS in both, hence return_end_token),
    re-ranked here by ours computed from its scores; without one, its `nbest` best (the two rankings agree,
    and its early exit waits for nbest finished).

    Beam outputs can differ from ours (greedy outputs do not): (1) it stops as our "early" rule does but keeps
    every hypothesis finished at the stopping step, up to 2*beam-1, where ours keeps the first `beam`; (2) only
    the `beam` best by its penalty reach the re-ranking; (3) at the limit its unfinished hypotheses, scored
    without their EOS, can push a shorter finished one out of those `beam`, and a live hypothesis ours ends
    there is missing when an EOS took its place in the beam's top `beam`; (4) a BOS or PAD candidate can hold
    a place in its beam for some steps and drop out again before the end (ours never ranks them), leaving
    another beam than ours (an untrained model; after training label smoothing leaves each ~smoothing /
    vocabulary, far below any beam's candidates). With several workers (the translator's inter_threads) the
    batches are sized and run side by side as search_batches runs ours.

    What else it maps (ctranslate2_options): sampling (its sampling_topk, sampling_topp, sampling_temperature,
    with BOS and PAD suppressed; a random stream per worker, seeded when the Translator is made, so that a run
    repeats itself with the same seed, the same input and one worker, but a sentence's samples depend on its
    batch, on what was drawn before it and, with several workers, on which worker takes its batch), a forced
    prefix (`prefixes`: per source, the target ids of its SentenceOptions.prefix; target_prefix, whose limit
    counts the prefix, as ours does) and alignments (return_attention: the conversion asks for the last
    layer's cross-attention averaged over all heads, alignment.py's default, and the source's EOS is not in
    it). Constraints and ensembles it does not have (the Translator refuses them).
    """
    nbest, sampling = settings.nbest, settings.sample is not None
    out: list[list[Hypothesis]] = [[Hypothesis([], 0.0) for _ in range(nbest)] for _ in src_ids]
    limit = source_limit(max_positions)
    workers = translator.num_translators
    rows = settings.rows_per_source
    tokens_per_batch = max(1, settings.max_tokens // (workers * rows))  # as source_batches sizes them
    sources: dict[int, list[str]] = {}  # CTranslate2 appends </s> itself
    forced: dict[int, list[str]] = {}  # forced target prefixes, as pieces
    own: dict[int, int] = {}  # each sentence's own output-length limit
    calls = []  # per call: its indices and pending results
    for batch in source_batches(src_ids, max_positions, settings.max_tokens, workers, rows):
        for i in batch:
            sources[i] = vocab.pieces(src_ids[i][:limit])
            forced[i] = vocab.pieces(list(prefixes[i])) if prefixes is not None else []
        max_lens = max_output_lengths(
            torch.tensor([len(sources[i]) + 1 for i in batch]),  # + EOS
            settings.max_len_offset,
            max_positions,
        )
        # At least the prefix, as search.max_lengths says.
        max_lens = torch.maximum(max_lens, torch.tensor([len(forced[i]) for i in batch]))
        own.update(zip(batch, max_lens.clamp(max=max_positions - 1).tolist()))
        if sampling:  # samples searched again would be other samples: each under its own limit
            continue
        buckets = [limit_bucket(own[i], max_positions) for i in batch]
        if settings.lenpen > 0:  # the outcome does not depend on the call's limit (above): one call
            buckets = [max(buckets)] * len(batch)
        for bucket, rows in same_limit(buckets):  # asynchronous: every worker takes calls from the queue
            indices = [batch[r] for r in rows]
            pending = _translate_async(translator, vocab, sources, forced, indices, settings, bucket, suppress=False)
            calls.append((indices, pending))
    never = {vocab.specials.bos, vocab.specials.pad}

    def unwanted(hyps: list[Hypothesis]) -> bool:
        return any(never.intersection(h.tokens) for h in hyps)

    found: dict[int, list[Hypothesis]] = {}
    # Scored again: search scores that leave a prefix out, or that a setting made its own (ctranslate2_rescores).
    rescored: dict[int, list[Hypothesis]] = {}
    renormalised = ctranslate2_rescores(settings)
    again = list(sources) if sampling else []  # sentences to search under their own limit
    suppressed = []  # sentences to search under their own limit with BOS and PAD suppressed
    for indices, pending in calls:
        for i, result in zip(indices, pending):
            hyps = _hypotheses(vocab, result.result(), settings)
            if any(len(h.tokens) >= own[i] - 1 for h in hyps):
                again.append(i)
            elif unwanted(hyps):
                suppressed.append(i)
            elif forced[i] or renormalised:
                rescored[i] = hyps
            else:  # every hypothesis ended with EOS: its score is ours
                found[i] = hyps
    found.update(zip(rescored, _scored(translator, vocab, sources, rescored, settings, tokens_per_batch)))
    limited = ctranslate2_limited(translator, vocab, sources, forced, again, own, settings, suppress=sampling)
    suppressed += [i for i, hyps in limited.items() if unwanted(hyps)]
    found.update(limited)
    found.update(ctranslate2_limited(translator, vocab, sources, forced, suppressed, own, settings, suppress=True))
    for i, hyps in found.items():
        out[i] = sorted(hyps, key=lambda h: h.score, reverse=True)[:nbest]
    return out


def ctranslate2_limited(
    translator,
    vocab: AnyVocab,
    sources: dict[int, list[str]],
    prefixes: dict[int, list[str]],
    indices: Sequence[int],
    limits: dict[int, int],
    settings: SearchSettings,
    suppress: bool,
) -> dict[int, list[Hypothesis]]:
    """The sources (pieces, by index) of `indices` searched each under its own length limit (`limits`, by index):
    one call per distinct limit, every returned hypothesis scored again (ours: the EOS that the limit ended
    added), best first. suppress: BOS and PAD are never candidates (_translate_async)."""
    tokens_per_batch = max(1, settings.max_tokens // (translator.num_translators * settings.rows_per_source))
    calls = []
    for max_len, rows in same_limit([limits[i] for i in indices]):
        batch = [indices[r] for r in rows]
        pending = _translate_async(
            translator, vocab, sources, prefixes, batch, settings, max_len, suppress, tokens_per_batch
        )
        calls.append((batch, pending))
    found = {}
    for batch, pending in calls:
        for i, result in zip(batch, pending):
            found[i] = _hypotheses(vocab, result.result(), settings)
    scored = _scored(translator, vocab, sources, found, settings, tokens_per_batch)
    return {i: sorted(hyps, key=lambda h: h.score, reverse=True) for i, hyps in zip(found, scored)}


def limit_bucket(max_len: int, max_positions: int) -> int:
    """The length limit a sentence whose own limit is `max_len` is first searched under by CTranslate2: the power
    of two at or above it, capped at the longest output a model can make (max_positions - 1, as every limit is).
    A sentence that runs on past its own limit costs at most twice its steps more."""
    return min(1 << max(0, max_len - 1).bit_length(), max_positions - 1)


def _translate_async(
    translator,
    vocab: AnyVocab,
    sources: dict[int, list[str]],
    prefixes: dict[int, list[str]],
    indices: Sequence[int],
    settings: SearchSettings,
    max_len: int,
    suppress: bool,
    max_tokens: int = 0,
) -> list:
    """One asynchronous translate_batch call for the sources of `indices` under length limit `max_len`, as ours
    searches: EOS allowed at once, the sources as given (cut already), each one's forced prefix, the hypotheses
    with their EOS (which its penalty then counts, as ours does: an empty output would otherwise rank last,
    divided by 0**lenpen). suppress: BOS and PAD are never candidates (its log-probabilities are then normalised
    over the other tokens; unsuppressed, over all of them, as ours). max_tokens: CTranslate2 splits the sources into batches of
    that many tokens (0: they are one batch)."""
    forced = [prefixes[i] for i in indices]
    never = [[piece] for piece in vocab.pieces(sorted({vocab.specials.bos, vocab.specials.pad}))]
    return translator.translate_batch(
        [sources[i] for i in indices],
        target_prefix=forced if any(forced) else None,
        num_hypotheses=settings.nbest if settings.lenpen == 0 or settings.sample is not None else settings.beam,
        max_decoding_length=max_len,
        suppress_sequences=never if suppress else None,
        min_decoding_length=0,
        return_end_token=True,
        return_scores=True,
        max_input_length=0,
        max_batch_size=max_tokens,
        batch_type="tokens",
        asynchronous=True,
        **ctranslate2_options(settings),
    )


def ctranslate2_options(settings: SearchSettings) -> dict:
    """translate_batch's search options for `settings`: those it takes as they are (settings.ctranslate2_keywords:
    the length penalty, alignments...), and beam search or sampling (top-k 0 is its whole vocabulary)."""
    if settings.sample is None:
        return {**ctranslate2_keywords(settings), "beam_size": settings.beam}
    kind, value = parse_sample(settings.sample)
    return {
        **ctranslate2_keywords(settings),
        "beam_size": 1,
        "sampling_topk": int(value) if kind == "topk" else 0,
        "sampling_topp": value if kind == "topp" else 1.0,
        "sampling_temperature": settings.temperature,
    }


def _hypotheses(vocab: AnyVocab, result, settings: SearchSettings) -> list[Hypothesis]:
    """A TranslationResult's hypotheses as ours, without EOS, scored by our penalty from its normalised score:
    summed log-probability = score * length**lenpen (length counting EOS, as return_end_token makes it). A
    hypothesis the length limit ended has no EOS: neither its tokens nor its score count one. With alignments,
    each hypothesis's per output piece the source piece it attends to most."""
    lenpen, hyps = settings.lenpen, []
    attention = result.attention if settings.alignments else [None] * len(result.hypotheses)
    for pieces, score, weights in zip(result.hypotheses, result.scores, attention):
        length = len(pieces)
        total = score * length**lenpen if length else score
        ids = _without_eos(vocab.piece_ids(pieces), vocab.specials.eos)
        alignment = None if weights is None else _attended(weights, len(ids))
        hyps.append(Hypothesis(ids, total / length_penalty(length, lenpen, settings.lenpen_kind), alignment))
    return hyps


def _scored(
    translator,
    vocab: AnyVocab,
    sources: dict[int, list[str]],
    found: dict[int, list[Hypothesis]],
    settings: SearchSettings,
    tokens_per_batch: int,
) -> list[list[Hypothesis]]:
    """found's hypotheses (by source index) scored again by CTranslate2's scorer in one asynchronous call split
    into batches of about tokens_per_batch: ours, each token's and EOS's log-probability normalised over the
    whole vocabulary, divided by our length penalty."""
    lenpen, kind = settings.lenpen, settings.lenpen_kind
    pairs = [(sources[i], h.tokens) for i, hyps in found.items() for h in hyps]
    if not pairs:
        return []
    pending = iter(
        translator.score_batch(
            [source for source, _ in pairs],
            [vocab.pieces(tokens) for _, tokens in pairs],
            max_batch_size=tokens_per_batch,
            batch_type="tokens",
            max_input_length=0,
            asynchronous=True,
        )
    )
    return [
        [
            Hypothesis(
                h.tokens,
                sum(next(pending).result().log_probs) / length_penalty(len(h.tokens) + 1, lenpen, kind),
                h.alignment,
            )
            for h in hyps
        ]
        for hyps in found.values()
    ]


def _attended(weights: Sequence[Sequence[float]], length: int) -> list[int]:
    """CTranslate2's attention of one hypothesis (a row per output piece, a column per source piece, EOS's
    dropped) -> per output piece the source piece it attends to most."""
    return [max(range(len(row)), key=row.__getitem__) if len(row) else 0 for row in list(weights)[:length]]


def _without_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:-1] if ids and ids[-1] == eos else ids


def same_limit(max_lens: Sequence[int]) -> list[tuple[int, list[int]]]:
    """(limit, positions) for each distinct value in `max_lens`, the largest first: what one CTranslate2 call
    with that max_decoding_length may take."""
    groups: dict[int, list[int]] = {}
    for position, max_len in enumerate(max_lens):
        groups.setdefault(max_len, []).append(position)
    return sorted(groups.items(), reverse=True)
