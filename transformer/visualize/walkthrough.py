"""What the animated walk through one sentence shows: the model's own values at each stage, as plain arrays."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from transformer.data.vocab import AnyVocab
from transformer.errors import UserError
from transformer.inference.search import max_lengths
from transformer.inference.settings import SearchSettings
from transformer.model.transformer import Transformer
from transformer.visualize.attention import collect_attention, own_translation, source_ids

PARTS = ("encoder", "decoder")
TOP = 5  # candidates a decoder step shows
MAX_PIECES = 20  # rows or columns a frame shows at a readable size; a longer sentence is cut, with a note
FILL_FRAMES = 5  # frames in which a matrix fills in, row by row or a few rows at a time
HOLD_LAST = 3  # frame times the last frame of a part stays


@dataclass
class EncoderWalk:
    """One encoder layer's self-attention, one head followed, on the source; every array is the model's own values
    (float32 copies of what it computed, in its dtype)."""

    pieces: list[str]  # the source pieces and "</s>": S
    scale: float  # √d_model, what the embedding rows are multiplied by
    embedded: np.ndarray  # (S, C) each piece's embedding row x scale
    position_rows: np.ndarray  # (S, C) what the kind of position adds (zeros where it adds nothing)
    positions_title: str  # the kind's own words for what it is (Positions.view)
    rotated: bool  # the kind turns queries and keys in self-attention (rather than, or besides, adding rows)
    stream: np.ndarray  # (S, C) what encoder layer 1 reads: the model's sum of the two
    layer: int  # numbered from 1
    head: int  # numbered from 1
    pre_norm: bool  # the layer's self-attention reads LayerNorm(its input)
    reads: np.ndarray  # (S, C) what the layer's self-attention reads
    q: np.ndarray  # (S, d_k) the head's queries (turned by position where the kind rotates them)
    k: np.ndarray  # (S, d_k) its keys
    v: np.ndarray  # (S, d_k) its values
    scores: np.ndarray  # (S, S) Q Kᵀ: row = query piece, column = key piece
    scaled: np.ndarray  # (S, S) scores / √d_k
    weights: np.ndarray  # (S, S) softmax of each scaled row
    head_output: np.ndarray  # (S, d_k) weights V
    all_weights: np.ndarray  # (H, S, S) every head of the layer
    joined_heads: np.ndarray  # (S, C) the heads' outputs side by side
    output: np.ndarray  # (S, C) joined_heads W_O + b: what the attention sub-layer computes (the module's output)

    @property
    def d_k(self) -> int:
        return self.q.shape[1]


@dataclass
class DecoderWalk:
    """The decoder writing the translation the search found, step by step; row t of every array is step t, which
    reads `read[: t + 1]` and chooses `chosen[t]`."""

    source_pieces: list[str]
    read: list[str]  # "<s>" and the chosen pieces but the last: T
    chosen: list[int]  # the ids the search chose, EOS last: T
    chosen_pieces: list[str]
    translation: str
    beam: int
    at_limit: bool  # the translation reached the search's length limit, where EOS is forced
    layer: int
    head: int
    self_weights: np.ndarray  # (T, T) masked self-attention of the layer and head (0 on later pieces)
    cross_weights: np.ndarray  # (T, S) its attention over the source
    probs: np.ndarray  # (T,) the probability the model gave each chosen piece
    top_ids: np.ndarray  # (T, TOP) the most probable next pieces, most probable first
    top_probs: np.ndarray  # (T, TOP)
    top_pieces: list[list[str]]


@dataclass
class Walk:
    """Everything an animation of one sentence shows (a part left out is None)."""

    source: str
    encoder: EncoderWalk | None
    decoder: DecoderWalk | None
    d_model: int
    n_heads: int


def check_index(flag: str, value: int | None, count: int, stack: str) -> None:
    if value is not None and not 1 <= value <= count:
        plural = "" if count == 1 else "s"
        raise UserError(
            f"--{flag} {value} is out of range: the {stack} has {count} {flag}{plural}, numbered 1..{count}"
        )


def telling_head(weights: np.ndarray) -> int:
    """The head (numbered from 1) of (H, Tq, Tk) weights whose rows point at the most different keys, most sharply:
    a head that sends every row to one piece (often </s>) shows little."""
    distinct = np.array([len(set(rows.tolist())) for rows in weights.argmax(-1)]) / weights.shape[1]
    return int(np.argmax(distinct * weights.max(-1).mean(-1))) + 1


@contextmanager
def watching(module: torch.nn.Module) -> Iterator[dict]:
    """Inside the block, what `module` is called with and returns: {"args", "kwargs", "output"} of its last call."""
    seen: dict = {}

    def before(_, args, kwargs):
        seen.update(args=args, kwargs=kwargs)

    def after(_, args, kwargs, output):
        seen["output"] = output

    hooks = [
        module.register_forward_pre_hook(before, with_kwargs=True),
        module.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


def _numpy(x: torch.Tensor) -> np.ndarray:
    return x.detach().float().cpu().numpy()


def walk(
    model: Transformer,
    vocab: AnyVocab,
    source: str,
    settings: SearchSettings = SearchSettings(beam=1),
    layer: int | None = None,
    head: int | None = None,
    only: str | None = None,
    prefix: Sequence[int] = (),
) -> Walk:
    """The values an animation of `source` shows, from one teacher-forced pass over the model's own translation
    (searched with `settings`: greedy, or the best beam hypothesis). layer, head: numbered from 1; None: the last
    layer of each stack and its telling_head (the decoder's chosen on its attention over the source). only: one of
    PARTS, or None for both. prefix: a multilingual model's language token before the source (source_ids)."""
    parts = PARTS if only is None else (only,)
    cfg = model.cfg
    for part, layers in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        if part in parts:
            check_index("layer", layer, layers, part)
            check_index("head", head, cfg.n_heads, part)
    src = source_ids(model, vocab, source, prefix)
    tokens = own_translation(model, src, settings) if "decoder" in parts else []
    tgt_in = torch.tensor([[model.specials.bos, *tokens]], dtype=torch.long, device=src.device)
    encoder_layer = (layer if "encoder" in parts else None) or cfg.n_encoder_layers  # watched only when drawn
    with (
        watching(model.encoder_layers[0]) as first,
        watching(model.encoder_layers[encoder_layer - 1].self_attn) as attention,
    ):
        logits, weights = collect_attention(model, src, tgt_in)
    encoder = decoder = None
    if "encoder" in parts:
        all_weights = _numpy(weights["encoder"][encoder_layer - 1, 0])
        encoder = _encoder_walk(model, vocab, src, first, attention, encoder_layer, head or telling_head(all_weights))
    if "decoder" in parts:
        decoder_layer = layer or cfg.n_decoder_layers
        cross = _numpy(weights["cross"][decoder_layer - 1, 0])  # (H, T, S)
        chosen_head = head or telling_head(cross)
        decoder = _decoder_walk(model, vocab, src, tokens, logits[0], weights, decoder_layer, chosen_head, settings)
    return Walk(source, encoder, decoder, cfg.d_model, cfg.n_heads)


@torch.no_grad()
def _encoder_walk(model, vocab, src, first: dict, attention: dict, layer: int, head: int) -> EncoderWalk:
    """One head of the layer whose self-attention `attention` watched, computed step by step from what it read."""
    module = model.encoder_layers[layer - 1].self_attn
    embedding = model.src_embed(src)[0]  # (S, C)
    scale = math.sqrt(model.cfg.d_model)
    # What the kind adds is what it makes of zeros; the rotation, what self-attention turns Q and K with.
    position_rows, rotation = model.position_encoding(torch.zeros_like(embedding)[None], "source")
    reads = attention["args"][0][0]  # (S, C): one sentence, no padding, so no packing
    s, n_heads, d_k = reads.size(0), module.n_heads, module.d_head

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.view(s, n_heads, d_k).transpose(0, 1)  # (S, C) -> (H, S, d_k)

    q, k, v = (heads(projection(reads)) for projection in (module.q_proj, module.k_proj, module.v_proj))
    rotation = attention["kwargs"].get("rotation")
    if rotation is not None:
        q, k = rotation(q[None])[0], rotation(k[None])[0]
    scores = q @ k.transpose(-2, -1)  # (H, S, S)
    scaled = scores / math.sqrt(d_k)
    weights = scaled.softmax(dim=-1)
    head_outputs = weights @ v  # (H, S, d_k)
    joined = head_outputs.transpose(0, 1).reshape(s, n_heads * d_k)
    h = head - 1
    return EncoderWalk(
        pieces=vocab.pieces(src[0].tolist()),
        scale=scale,
        embedded=_numpy(embedding * scale),
        position_rows=_numpy(position_rows[0]),
        positions_title=model.position_encoding.view(s).title,
        rotated=rotation is not None,
        stream=_numpy(first["args"][0][0]),
        layer=layer,
        head=head,
        pre_norm=model.cfg.norm == "pre",
        reads=_numpy(reads),
        q=_numpy(q[h]),
        k=_numpy(k[h]),
        v=_numpy(v[h]),
        scores=_numpy(scores[h]),
        scaled=_numpy(scaled[h]),
        weights=_numpy(weights[h]),
        head_output=_numpy(head_outputs[h]),
        all_weights=_numpy(weights),
        joined_heads=_numpy(joined),
        output=_numpy(attention["output"][0]),
    )


def _decoder_walk(model, vocab, src, tokens, logits, weights, layer: int, head: int, settings) -> DecoderWalk:
    specials = model.specials
    chosen = [*tokens, specials.eos]
    probs = logits.float().softmax(dim=-1)  # (T, V): what the search's log-probabilities are of
    probs[:, sorted({specials.pad, specials.bos})] = 0.0  # never emitted: the search rules them out
    top_probs, top_ids = probs.topk(min(TOP, probs.size(1)), dim=-1)
    step = torch.arange(len(chosen), device=probs.device)
    return DecoderWalk(
        source_pieces=vocab.pieces(src[0].tolist()),
        read=vocab.pieces([specials.bos, *tokens]),
        chosen=chosen,
        chosen_pieces=vocab.pieces(chosen),
        translation=vocab.decode([tokens])[0],
        beam=settings.beam,
        at_limit=len(tokens) == int(max_lengths(model, src, settings.max_len_offset)[0]),
        layer=layer,
        head=head,
        self_weights=_numpy(weights["decoder"][layer - 1, 0, head - 1]),
        cross_weights=_numpy(weights["cross"][layer - 1, 0, head - 1]),
        probs=_numpy(probs[step, torch.tensor(chosen, device=probs.device)]),
        top_ids=top_ids.cpu().numpy(),
        top_probs=_numpy(top_probs),
        top_pieces=[vocab.pieces(row) for row in top_ids.tolist()],
    )


# ----------------------------------------------------------------------------- frames


@dataclass
class Frame:
    """One picture of the animation: which drawing (scene) shows it, its words, and each panel's numbers (NaN where
    this frame has not computed them yet), cut to what a frame can show."""

    scene: str  # "embed", "scores", "softmax", "heads", "join" or "step"
    title: str
    caption: str  # the sentence, or what the decoder has written so far
    legend: str  # what each panel is
    values: dict[str, np.ndarray]
    labels: dict[str, list[str]]  # piece labels, by axis name
    words: dict[str, str] = field(default_factory=dict)  # panel titles, by panel name
    limits: dict[str, float] = field(default_factory=dict)  # colour scale ±limit of panels of signed values
    current: int | None = None  # the row this frame is about (a decoder step), outlined
    note: str = ""  # the sentence is cut
    hold: int = 1  # frame times it stays on screen


def frames(walk: Walk, max_pieces: int = MAX_PIECES) -> list[Frame]:
    """The animation's frames, in the order the explainers draw it: the encoder, then the decoder step by step."""
    out = []
    if walk.encoder is not None:
        out += encoder_frames(walk, walk.encoder, max_pieces)
    if walk.decoder is not None:
        out += decoder_frames(walk, walk.decoder, max_pieces)
    return out


def _limit(*arrays: np.ndarray) -> float:
    """A colour scale ±limit for signed values: the 99th percentile of their size, so a few outliers do not wash
    out the rest."""
    values = np.abs(np.concatenate([a.ravel() for a in arrays]))
    return float(max(np.percentile(values, 99), 1e-6)) if values.size else 1.0


def _blank(a: np.ndarray) -> np.ndarray:
    return np.full_like(a, np.nan)


def _rows(a: np.ndarray, filled: int) -> np.ndarray:
    """`a` with its rows from `filled` on not computed yet."""
    out = a.copy()
    out[filled:] = np.nan
    return out


def fill_steps(rows: int) -> list[int]:
    """How many rows are filled in each frame of a matrix filling in: all of them after at most FILL_FRAMES."""
    per = math.ceil(rows / FILL_FRAMES)
    return list(range(per, rows, per)) + [rows]


def _cut(count: int, max_pieces: int, what: str) -> str:
    return f"{what} {count} pieces long: only the first {max_pieces} are shown" if count > max_pieces else ""


ENCODER_STAGES = 10


def _stage(stage: int, what: str) -> str:
    return f"Encoder {stage}/{ENCODER_STAGES} · {what}"


def encoder_frames(walk: Walk, e: EncoderWalk, max_pieces: int = MAX_PIECES) -> list[Frame]:
    """The sentence in pieces, their embedding and position rows; one head's Q and K, scores, softmax and weighted sum
    of V; every head of the layer; their join."""
    n = min(len(e.pieces), max_pieces)
    note = _cut(len(e.pieces), max_pieces, "the sentence is")
    if note:
        note += " (each row's weights still sum to 1 over all of them)"
    base = {"caption": f"source: {walk.source}", "labels": {"source": e.pieces[:n]}, "note": note}
    return [
        *_embed_frames(walk, e, n, base),
        *_score_frames(walk, e, n, base),
        *_softmax_frames(e, n, base),
        *_head_frames(walk, e, n, base),
    ]


def _embed_frames(walk: Walk, e: EncoderWalk, n: int, base: dict) -> list[Frame]:
    values = {"embedded": e.embedded[:n], "position_rows": e.position_rows[:n], "stream": e.stream[:n]}
    words = {
        "embedded": f"embedding row × √{walk.d_model} = {e.scale:.3g}",
        "position_rows": "+ position row",
        "stream": "= what layer 1 reads",
    }
    adds = e.positions_title
    if e.rotated and not e.position_rows.any():
        adds = "rotary positions add no row: each self-attention turns its queries and keys by position"
        words["no_rows"] = "nothing added:\nrotary positions turn\nQ and K by position\ninside self-attention"
    legend = (
        f"One row per piece, one column per dimension (d_model = {walk.d_model}), one colour scale: red positive, "
        f"blue negative. Left: the piece's row of the embedding matrix, scaled. Middle: what its position adds "
        f"({adds}). Right: the sum, what the first encoder layer reads."
    )
    limits = {"value": _limit(*values.values())}
    out = []
    for stage, what, shown in (
        (1, "the sentence in pieces", ()),
        (2, "each piece becomes its embedding row", ("embedded",)),
        (3, "plus what its position adds", tuple(values)),
    ):
        drawn = {name: (a if name in shown else _blank(a)) for name, a in values.items()}
        out.append(Frame("embed", _stage(stage, what), legend=legend, values=drawn, words=words, limits=limits, **base))
    return out


def _score_frames(walk: Walk, e: EncoderWalk, n: int, base: dict) -> list[Frame]:
    q, k, scores = e.q[:n], e.k[:n], e.scores[:n, :n]
    reads = "the layer's input after LayerNorm (pre-norm)" if e.pre_norm else "the layer's input"
    turned = " Rotary positions turn Q and K by their position before the scores." if e.rotated else ""
    words = {"q": f"Q: queries ({e.d_k} dims)", "k": f"K: keys ({e.d_k} dims)", "scores": "scores Q·Kᵀ"}
    legend = (
        f"Q and K: {reads} times the head's W_Q and W_K, one row per piece.{turned} Each score is a query row · a "
        "key row: row = the piece asking (query), column = the piece asked (key); red high, blue low."
    )
    frame = {"legend": legend, "limits": {"qk": _limit(q, k), "scores": _limit(scores)}, **base}
    where = f"layer {e.layer}, head {e.head} of {walk.n_heads}"
    out = [
        Frame(
            "scores",
            _stage(4, f"{where}: queries and keys"),
            values={"q": q, "k": k, "scores": _blank(scores)},
            words=words,
            **frame,
        )
    ]
    for filled in fill_steps(n):
        title = _stage(5, f"scores Q·Kᵀ, row by row ({filled} of {n})")
        out.append(
            Frame("scores", title, values={"q": q, "k": k, "scores": _rows(scores, filled)}, words=words, **frame)
        )
    scaled_words = {**words, "scores": f"scores / √d_k (÷ {math.sqrt(e.d_k):.3g})"}
    values = {"q": q, "k": k, "scores": e.scaled[:n, :n]}
    out.append(Frame("scores", _stage(6, f"divided by √d_k = √{e.d_k}"), values=values, words=scaled_words, **frame))
    return out


def _softmax_frames(e: EncoderWalk, n: int, base: dict) -> list[Frame]:
    scaled, weights, v, z = e.scaled[:n, :n], e.weights[:n, :n], e.v[:n], e.head_output[:n]
    words = {"scaled": "scores / √d_k", "weights": "softmax: weights", "v": "V: values", "z": "Z = weights · V"}
    legend = (
        "Left: the scores divided by √d_k, on a colour scale of their own. Softmax turns each of their rows into "
        "weights that sum to 1 (white 0, dark blue 1). V: the head's values, the layer's input times W_V. Z: each "
        "piece's new row, the weights' mix of every piece's value row."
    )
    frame = {"legend": legend, "words": words, "limits": {"scaled": _limit(scaled), "vz": _limit(v, z)}}
    out = []
    for filled in fill_steps(n):
        values = {"scaled": scaled, "weights": _rows(weights, filled), "v": v, "z": _blank(z)}
        out.append(
            Frame("softmax", _stage(7, f"softmax, row by row ({filled} of {n})"), values=values, **frame, **base)
        )
    values = {"scaled": scaled, "weights": weights, "v": v, "z": z}
    out.append(Frame("softmax", _stage(8, "the weighted sum of V"), values=values, **frame, **base))
    return out


def _head_frames(walk: Walk, e: EncoderWalk, n: int, base: dict) -> list[Frame]:
    heads = walk.n_heads
    words = {f"head{h}": f"head {h}" + (" (followed)" if h == e.head else "") for h in range(1, heads + 1)}
    legend = (
        f"Each of the {heads} heads computes its own weights with its own W_Q, W_K and W_V, so each can look for "
        "something else: rows = queries, columns = keys, white 0, dark blue 1."
    )
    side_by_side = Frame(
        "heads",
        _stage(9, f"all {heads} heads of layer {e.layer} side by side"),
        legend=legend,
        values={"heads": e.all_weights[:, :n, :n]},
        words=words,
        current=e.head - 1,
        **base,
    )
    words = {"joined_heads": f"heads' Z side by side ({heads} × {e.d_k})", "output": "× W_O: the attention's output"}
    legend = (
        f"Left: the {heads} heads' outputs Z next to each other, one row per piece ({walk.d_model} columns). "
        "Right: that times W_O, what the self-attention adds to each piece's row on its way to the feed-forward "
        "layer; red positive, blue negative."
    )
    values = {
        "joined_heads": e.joined_heads[:n],
        "output": e.output[:n],
        "head_starts": np.arange(1, heads) * e.d_k,  # the columns where a head's output begins
    }
    limits = {"joined_heads": _limit(e.joined_heads[:n]), "output": _limit(e.output[:n])}
    joined = Frame(
        "join",
        _stage(10, "the heads joined"),
        legend=legend,
        values=values,
        words=words,
        limits=limits,
        hold=HOLD_LAST,
        **base,
    )
    return [side_by_side, joined]


def decoder_frames(walk: Walk, d: DecoderWalk, max_pieces: int = MAX_PIECES) -> list[Frame]:
    t_shown, s_shown = min(len(d.read), max_pieces), min(len(d.source_pieces), max_pieces)
    self_weights, cross = d.self_weights[:t_shown, :t_shown], d.cross_weights[:t_shown, :s_shown]
    notes = [
        _cut(len(d.read), max_pieces, "the translation is"),
        _cut(len(d.source_pieces), max_pieces, "the source is"),
    ]
    note = "; ".join(n for n in notes if n)
    chose = "greedy search chose" if d.beam == 1 else f"beam search (beam {d.beam}) kept"
    legend = (
        f"Left: masked self-attention of decoder layer {d.layer}, head {d.head}: each row a step, over the pieces "
        "written so far (grey: later pieces, masked). Middle: the same step's attention over the source. Right: the "
        f"model's most probable next pieces; orange: the one {chose}"
        + ("." if d.beam == 1 else ", best for the whole sentence, so not always the most probable at its step.")
    )
    words = {"self": "masked self-attention", "cross": "attention over the source", "top": "next piece"}
    labels = {"read": d.read[:t_shown], "source": d.source_pieces[:s_shown]}
    out = []
    for t in range(t_shown):
        ids, probs, pieces = list(d.top_ids[t]), list(d.top_probs[t]), list(d.top_pieces[t])
        if d.chosen[t] not in ids:  # beam search, or EOS forced at the length limit: shown below the rest
            ids, probs, pieces = ids + [d.chosen[t]], probs + [d.probs[t]], pieces + [d.chosen_pieces[t]]
        written = _spaced(d.chosen_pieces[: min(t + 1, len(d.chosen) - 1)])  # the words, not the EOS
        out.append(
            Frame(
                "step",
                f"Decoder step {t + 1}/{len(d.read)} · reads {_quoted(d.read[t])}, "
                + (
                    f"ends: the length limit forces {_quoted(d.chosen_pieces[t])}"
                    if d.at_limit and t == len(d.read) - 1
                    else f"chooses {_quoted(d.chosen_pieces[t])}"
                )
                + f" (p = {d.probs[t]:.2f})",
                caption=f"source: {walk.source}   →   {written}",
                legend=legend,
                values={
                    "self": _rows(self_weights, t + 1),
                    "cross": _rows(cross, t + 1),
                    "top": np.array(probs, dtype=np.float32),
                    "chosen": np.array([ids.index(d.chosen[t])]),
                },
                labels={**labels, "top": pieces},
                words=words,
                current=t,
                note=note,
            )
        )
    out.append(
        Frame(
            "step",
            f"The translation: {d.translation}",
            caption=f"source: {walk.source}",
            legend=legend,
            values=out[-1].values,
            labels=out[-1].labels,
            words=words,
            note=note,
            hold=HOLD_LAST,
        )
    )
    return out


def _spaced(pieces: list[str]) -> str:
    """Pieces as the words they spell (SentencePiece marks a word start with U+2581)."""
    return "".join(pieces).replace("\u2581", " ").strip()


def _quoted(piece: str) -> str:
    return f"“{piece}”"
