"""`transformer serve`: the JSON API in-process (FastAPI's test client) on a tiny random checkpoint, request
batching, every refusal, and the page driven by headless Chromium against a real uvicorn."""

import importlib.util
import io
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import LINES, positions_model
from transformer import cli
from transformer.config import from_dict, to_dict
from transformer.data.vocab import train_vocab
from transformer.device import cpu_description
from transformer.inference import ctranslate2_engine
from transformer.inference.settings import SearchFlags
from transformer.inference.translator import Translator
from transformer.model.checkpoint import load_model, save_checkpoint
from transformer.model.positions import sinusoid_table
from transformer.model.transformer import Transformer, count_parameters

pytest.importorskip("fastapi", reason="the 'serve' extra is not installed")
pytest.importorskip("httpx", reason="FastAPI's test client needs httpx")
from fastapi.testclient import TestClient  # noqa: E402

from transformer.serve.app import create_app  # noqa: E402
from transformer.serve.server import listen, make_server  # noqa: E402
from transformer.serve.service import ServeSettings, Service  # noqa: E402

WORDS = (
    "ein zwei drei hund katze mann frau kind spielt läuft auf der die das im park mit einem ball "
    "sitzt steht vor haus baum wasser rot blau grün"
).split()
SENTENCES = [
    "ein hund spielt im park",
    "zwei katzen",
    "der mann sitzt auf einem roten haus vor dem baum",
    "eine frau mit einem ball",
    "das kind läuft",
    "drei hunde im wasser",
]
SETTINGS = ServeSettings(
    batch_window_ms=2, max_sentences=8, max_chars=400, max_beam=5, max_pending=16, max_position_values=4096
)


def synthetic(rng: random.Random, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) for _ in range(n)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: extra threads only spin
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return tiny_run(tmp_path_factory.mktemp("serve") / "run")


def tiny_run(run_dir: Path) -> Path:
    """A run directory with a random (peaky) model, a step and a validation row, as training leaves them."""
    run_dir.mkdir()
    vocab = train_vocab(synthetic(random.Random(0), 300), vocab_size=80)
    cfg = from_dict(
        {
            "model": {
                "d_model": 32,
                "n_heads": 4,
                "n_encoder_layers": 1,
                "n_decoder_layers": 2,
                "d_ff": 64,
                "dropout": 0.0,
                "max_positions": 40,
            },
            "data": {"dir": str(run_dir), "src_lang": "de", "tgt_lang": "en", "vocab_size": 80, "max_len": 30},
            "train": {"run_dir": str(run_dir)},
            "decode": {"beam": 3, "lenpen": 0.6, "max_len_offset": 6, "max_tokens": 64},
        }
    )
    torch.manual_seed(1)
    model = Transformer(cfg.model, len(vocab))
    with torch.no_grad():
        model.output.weight.mul_(3.0)  # peaky, so that sentences get different translations
    save_checkpoint(
        {
            "config": to_dict(cfg),
            "vocab": vocab.proto,
            "model": model.state_dict(),
            "run": {"step": 120, "best": 3.25, "best_metric": "loss"},
        },
        run_dir / "best.pt",
    )
    rows = [
        {"step": 100, "split": "valid", "loss": 3.5, "ppl": 33.1},
        {"step": 120, "split": "valid", "loss": 3.25, "nll": 3.0, "ppl": 25.8, "bleu": 1.5, "chrf": 40.5},
        {"step": 120, "split": "train", "loss": 3.0},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return run_dir


@pytest.fixture(scope="module")
def translator(run) -> Translator:
    return Translator(run, "cpu", SearchFlags(dtype="fp32"))


@pytest.fixture(scope="module")
def client(run):
    with TestClient(create_app(Service(run, SETTINGS, "cpu", SearchFlags(dtype="fp32")))) as c:
        yield c


def post(client, path: str, body) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


# ----------------------------------------------------------------------------- translate


@pytest.mark.parametrize("beam,nbest", [(1, 1), (3, 1), (4, 3)])
def test_translate_equals_the_translator(client, translator, beam, nbest):
    lines = [SENTENCES[0], "", SENTENCES[2], "   ", SENTENCES[1], SENTENCES[3], SENTENCES[5]]
    result = post(client, "/translate", {"text": lines, "beam": beam, "nbest": nbest})
    translator.settings = replace(translator.settings, beam=beam)
    expected = translator.translate_nbest(lines, nbest)
    assert (result["beam"], result["nbest"]) == (beam, nbest)
    assert len(result["translations"]) == len(lines)  # one output per input
    for got, hyps in zip(result["translations"], expected):
        assert [(h["score"], h["text"]) for h in got["nbest"]] == hyps
        assert (got["score"], got["text"]) == hyps[0]
    assert result["translations"][1]["text"] == "" and result["translations"][3]["text"] == ""
    assert len({t["text"] for t in result["translations"]}) > 2  # sentences differ: the order check means something


def test_translate_defaults_and_shapes(client, translator):
    translator.settings = replace(translator.settings, beam=3)  # the checkpoint's decode.beam
    one = post(client, "/translate", {"text": SENTENCES[0]})  # a single string is one sentence
    assert one["beam"] == 3 and [t["text"] for t in one["translations"]] == translator.translate([SENTENCES[0]])
    assert post(client, "/translate", {"text": []})["translations"] == []
    # A line break inside an item does not split it: one output, as the line it makes when joined.
    broken = post(client, "/translate", {"text": ["zwei\nkatzen"]})["translations"]
    assert [t["text"] for t in broken] == translator.translate(["zwei katzen"])


def test_a_source_longer_than_the_model_takes_is_flagged_in_the_answer_not_only_on_stderr(client, translator, capfd):
    long_line = " ".join(["hund katze"] * 20)  # over max_positions 40, under the request's 400 characters
    lines = [SENTENCES[0], long_line]
    result = post(client, "/translate", {"text": lines})
    assert [t["truncated"] for t in result["translations"]] == [False, True]
    assert "warning: input line" not in capfd.readouterr().err  # nothing for the server's log to count
    assert [t["text"] for t in result["translations"]] == translator.translate(lines)  # translated from its start


def test_concurrent_requests_are_batched_and_match_one_by_one(run, translator):
    """A wide window: requests sent together share searches (per beam), with the outputs of each alone."""
    settings = ServeSettings(batch_window_ms=1500, max_sentences=8, max_chars=400, max_beam=5)
    requests = [
        ({"text": [s], "beam": 3} if i % 3 else {"text": [s, SENTENCES[0]], "beam": 1, "nbest": 1})
        for i, s in enumerate(SENTENCES)
    ]
    results = [None] * len(requests)
    # max_tokens far above these sources: only the window decides what merges.
    with TestClient(create_app(Service(run, settings, "cpu", SearchFlags(dtype="fp32", max_tokens=4096)))) as c:

        def send(i):
            results[i] = c.post("/translate", json=requests[i])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        health = c.get("/health").json()
    assert all(r is not None and r.status_code == 200 for r in results), [r and r.text for r in results]
    for request, response in zip(requests, results):
        translator.settings = replace(translator.settings, beam=request["beam"])
        assert [t["text"] for t in response.json()["translations"]] == translator.translate(request["text"])
    assert health["requests"] == len(requests) and health["sentences"] == sum(len(r["text"]) for r in requests)
    assert health["batches"] < len(requests)  # merged: at most one search per beam size and window
    assert health["largest_batch"] > 2 and health["pending"] == 0


def test_a_full_batch_does_not_wait_for_the_window(run):
    """Sources that fill decode.max_tokens go to the model at once: the window bounds waiting, not work."""
    settings = ServeSettings(batch_window_ms=5000, max_sentences=8, max_chars=400, max_beam=5)
    with TestClient(create_app(Service(run, settings, "cpu", SearchFlags(dtype="fp32", max_tokens=1)))) as c:
        for sentence in SENTENCES[:3]:
            start = time.monotonic()
            assert c.post("/translate", json={"text": [sentence]}).status_code == 200
            assert time.monotonic() - start < 5.0  # waiting out the window would take 5 s
        assert c.get("/health").json()["batches"] == 3


def test_a_lone_surrogate_in_the_json_translates_as_the_replacement_character(client):
    """JSON may spell "\\ud800", which no UTF-8 encodes; it was a 500."""

    def send(path: str, body: dict):  # json.dumps writes the surrogate as the escape "\\ud800"
        return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})

    for path, body in (
        ("/translate", {"text": [SENTENCES[0] + "\ud800"]}),
        ("/beam", {"text": SENTENCES[0] + "\ud800"}),
        ("/attention", {"text": SENTENCES[0], "target": "a \udcf6"}),
    ):
        response = send(path, body)
        assert response.status_code == 200, (path, response.text)
    same = post(client, "/translate", {"text": [SENTENCES[0] + "\ufffd"]})
    assert send("/translate", {"text": [SENTENCES[0] + "\ud800"]}).json()["translations"] == same["translations"]


# ----------------------------------------------------------------------------- refusals


def chunked(size: int):
    """A body sent with Transfer-Encoding: chunked (no Content-Length), 64 KiB at a time."""
    body = b'{"text": ["' + b"x" * size + b'"]}'
    for i in range(0, len(body), 65536):
        yield body[i : i + 65536]


BAD = [
    (
        "post",
        "/translate",
        {"content": b"{not json", "headers": {"content-type": "application/json"}},
        400,
        "not valid JSON",
    ),
    ("post", "/translate", {"content": b"", "headers": {"content-type": "application/json"}}, 422, "JSON object"),
    (
        "post",
        "/translate",
        {"content": b'{"text": ["a"]}', "headers": {"content-type": "text/plain"}},
        415,
        "application/json",
    ),
    ("post", "/translate", {"json": ["ein hund"]}, 422, "JSON object"),
    ("post", "/translate", {"json": {"sentences": ["ein hund"]}}, 422, "text: Field required"),
    ("post", "/translate", {"json": {"text": 5}}, 422, "text"),
    ("post", "/translate", {"json": {"text": ["ein", 5]}}, 422, "text.1"),
    ("post", "/translate", {"json": {"text": ["ein"], "beam": "4"}}, 422, "beam"),
    ("post", "/translate", {"json": {"text": ["ein"], "beam": True}}, 422, "beam"),
    ("post", "/translate", {"json": {"text": ["ein"], "beam": 2.5}}, 422, "beam"),
    ("post", "/translate", {"json": {"text": ["ein"], "beam": 0}}, 422, "beam must be between 1 and 5"),
    ("post", "/translate", {"json": {"text": ["ein"], "beam": 6}}, 422, "beam must be between 1 and 5"),
    ("post", "/translate", {"json": {"text": ["ein"], "beam": 2, "nbest": 3}}, 422, "nbest"),
    ("post", "/translate", {"json": {"text": ["ein"] * 9}}, 413, "9 sentences"),
    ("post", "/translate", {"json": {"text": ["ein hund " * 30, "zwei " * 40]}}, 413, "characters"),
    ("post", "/translate", {"json": {"text": ["x" * 80_000]}}, 413, "bytes"),
    (
        "post",
        "/translate",
        {"content": chunked(200_000), "headers": {"content-type": "application/json"}},
        413,
        "bytes",
    ),
    ("post", "/attention", {"json": {"text": ""}}, 422, "empty"),
    ("post", "/attention", {"json": {"text": "   "}}, 422, "empty"),
    ("post", "/attention", {"json": {"text": " ".join(WORDS)}}, 422, "pieces long"),
    ("post", "/attention", {"json": {"text": ["ein hund"]}}, 422, "text"),
    ("post", "/attention", {"json": {"text": "ein hund", "target": "der " * 40}}, 422, "target sentence"),
    ("post", "/attention", {"json": {"text": "ein hund", "beam": 99}}, 422, "beam"),
    ("post", "/beam", {"json": {"text": "ein hund", "beam": 0}}, 422, "beam"),
    ("post", "/animate", {"json": {"text": "  "}}, 422, "empty"),
    (
        "post",
        "/animate",
        {"json": {"text": "ein hund", "layer": 2}},
        422,
        "layer must be between 1 and 1 (the encoder's)",
    ),
    ("post", "/animate", {"json": {"text": "ein hund", "head": 0}}, 422, "head must be between 1 and 4, got 0"),
    ("post", "/animate", {"json": {"text": "ein hund", "fps": 0}}, 422, "fps must be between 0.1 and 50"),
    ("post", "/animate", {"json": {"text": "ein hund", "only": "both"}}, 422, "only"),
    ("post", "/animate", {"json": {"text": "ein hund", "beam": 6}}, 422, "beam must be between 1 and 5"),
    ("post", "/beam", {"json": {"text": "ein hund", "beam": 2, "nbest": 0}}, 422, "nbest"),
    ("get", "/positions?d_model=7&length=5", {}, 422, "even"),
    ("get", "/positions?d_model=8&length=0", {}, 422, "length"),
    ("get", "/positions?d_model=512&length=100", {}, 422, "limit"),
    ("get", "/positions?d_model=eight", {}, 422, "d_model"),
    ("get", "/translate", {}, 405, "Method Not Allowed"),
    # issue 43's fields: sampling, prefixes, constraints, alignments
    ("post", "/translate", {"json": {"text": ["ein"], "sample": "topk:0"}}, 422, "sample takes topk:K"),
    ("post", "/translate", {"json": {"text": ["ein"], "sample": "topk:2", "beam": 3}}, 422, "cannot go with beam 3"),
    ("post", "/translate", {"json": {"text": ["ein"], "sample": "topk:2", "nbest": 17}}, 422, "between 1 and 16"),
    ("post", "/translate", {"json": {"text": ["ein"], "temperature": 0.5}}, 422, "temperature and seed go with sample"),
    (
        "post",
        "/translate",
        {"json": {"text": ["ein"], "sample": "topp:1", "temperature": 0}},
        422,
        "temperature must be",
    ),
    ("post", "/translate", {"json": {"text": ["ein"], "sample": "topk:2", "seed": -1}}, 422, "seed must be a whole"),
    ("post", "/translate", {"json": {"text": ["ein"], "sample": "topk:2", "seed": 1.5}}, 422, "seed"),
    ("post", "/translate", {"json": {"text": ["ein", "zwei"], "prefix": ["a"]}}, 422, "prefix must have one item per"),
    ("post", "/translate", {"json": {"text": ["ein"], "prefix": ["the " * 50]}}, 422, "pieces long; the limit is 38"),
    ("post", "/translate", {"json": {"text": ["ein"], "constraints": [["a"] * 9]}}, 422, "9 constraints for one"),
    (
        "post",
        "/translate",
        {"json": {"text": ["ein", "zwei"], "prefix": ["", "der 東京"]}},
        422,
        "the prefix of sentence 1 has characters the vocabulary lacks: '東', '京'",
    ),
    (
        "post",
        "/translate",
        {"json": {"text": ["ein"], "constraints": [["hund", "€"]]}},
        422,
        "the constraint '€' of sentence 0 has characters the vocabulary lacks: '€'",
    ),
    ("post", "/translate", {"json": {"text": ["ein"], "constraints": [[5]]}}, 422, "constraints.0.0"),
    ("post", "/translate", {"json": {"text": ["ein"], "constraints": [["x" * 399]]}}, 413, "characters"),
    (
        "post",
        "/translate",
        {"json": {"text": ["ein"], "constraints": [["dog"]], "sample": "topk:2"}},
        422,
        "constraints need beam search",
    ),
    ("post", "/translate", {"json": {"text": ["ein"], "alignments": "yes"}}, 422, "alignments"),
    ("get", "/nothing", {}, 404, "Not Found"),
    ("get", "/static/..%2Fserve.py", {}, 404, "Not Found"),
    ("get", "/static/../serve.py", {}, 404, "Not Found"),
]


@pytest.mark.parametrize("method,path,kwargs,status,fragment", BAD, ids=[f"{m} {p} {s} {f}" for m, p, _, s, f in BAD])
def test_bad_input_is_a_json_error_with_its_status(client, method, path, kwargs, status, fragment):
    response = getattr(client, method)(path, **kwargs)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert fragment in response.json()["error"]
    assert client.get("/health").json()["status"] == "ok"  # and the server goes on


# ----------------------------------------------------------------------------- attention, beam, positions, info


def test_attention_maps(client, run):
    got = post(client, "/attention", {"text": SENTENCES[2], "beam": 3})
    best = post(client, "/translate", {"text": [SENTENCES[2]], "beam": 3})["translations"][0]["text"]
    assert got["translated"] and got["target"] == best  # the decoder reads the translation /translate gives
    assert got["source_pieces"][-1] == "</s>" and got["target_pieces"][0] == "<s>"
    sizes = {"source": len(got["source_pieces"]), "target": len(got["target_pieces"])}
    layers = {"encoder": 1, "decoder": 2, "cross": 2}
    assert set(got["attention"]) == set(layers)
    for kind, spec in got["attention"].items():
        w = torch.tensor(spec["weights"], dtype=torch.float64)  # (layers, heads, queries, keys)
        assert w.shape == (layers[kind], 4, sizes[spec["queries"]], sizes[spec["keys"]])
        assert (spec["layers"], spec["heads"]) == (layers[kind], 4)
        assert torch.allclose(w.sum(-1), torch.ones(w.shape[:-1], dtype=torch.float64), atol=1e-3)
        assert bool((w >= 0).all())
    decoder = torch.tensor(got["attention"]["decoder"]["weights"])
    assert float(decoder.triu(diagonal=1).abs().max()) == 0.0  # nothing attends to a later target piece
    forced = post(client, "/attention", {"text": SENTENCES[0], "target": "a dog"})
    assert not forced["translated"] and forced["target"] == "a dog"


def test_beam_trace_ends_in_the_translation(client):
    trace = post(client, "/beam", {"text": SENTENCES[0], "beam": 4, "nbest": 3})
    result = post(client, "/translate", {"text": [SENTENCES[0]], "beam": 4, "nbest": 3})["translations"][0]
    assert [h["text"] for h in trace["nbest"]] == [h["text"] for h in result["nbest"]]
    assert [h["score"] for h in trace["nbest"]] == pytest.approx([h["score"] for h in result["nbest"]], abs=1e-4)
    assert trace["source_pieces"][-1] == "</s>" and trace["steps"]
    for t, step in enumerate(trace["steps"][:-1]):
        assert 1 <= len(step["alive"]) <= 4 and all(len(h["pieces"]) == t + 1 for h in step["alive"])
    finished = sorted((h for step in trace["steps"] for h in step["finished"]), key=lambda h: -h["score"])
    assert [h["text"] for h in finished[:3]] == [h["text"] for h in trace["nbest"]]


def test_the_animation_is_the_gif_animate_draws(client, translator):
    """The page's download: the GIF of the walk `transformer animate` draws for the sentence, one picture a frame."""
    from PIL import Image

    from transformer.visualize.walkthrough import frames, walk

    response = client.post("/animate", json={"text": SENTENCES[0], "beam": 2, "only": "decoder", "layer": 2, "fps": 4})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "image/gif"
    assert response.headers["content-disposition"] == 'attachment; filename="walk.gif"'
    settings = replace(translator.settings, beam=2)
    shown = walk(translator.model, translator.vocab, SENTENCES[0], settings, layer=2, only="decoder")
    with Image.open(io.BytesIO(response.content)) as gif:
        assert gif.format == "GIF" and gif.size == (800, 500) and gif.n_frames == len(frames(shown))
        assert gif.info["duration"] == 250
    best = post(client, "/translate", {"text": [SENTENCES[0]], "beam": 2})["translations"][0]["text"]
    assert shown.decoder.translation == best


def test_positions_table(client):
    got = client.get("/positions", params={"d_model": 16, "length": 30}).json()
    table = torch.tensor(got["table"])
    assert (got["d_model"], got["length"], tuple(table.shape)) == (16, 30, (30, 16))
    assert torch.allclose(table, sinusoid_table(16, 30), atol=1e-4)
    assert got["kind"] == "sinusoidal" and got["adds_table"] and "sin(pos" in got["note"]
    assert list(got["tables"]) == ["source and target"]
    default = client.get("/positions").json()  # the model's own width and its positions (up to 100)
    assert (default["d_model"], default["length"]) == (32, 40)


def test_serve_answers_with_the_view():
    service = SimpleNamespace(model=positions_model("rotary"))
    got = Service.position_view(service, 32, 10)
    assert got["kind"] == "rotary" and not got["adds_table"] and "add no table" in got["note"]
    assert len(got["table"]) == 10 and got["tables"]["cos"] == got["table"]
    other = Service.position_view(service, 64, 10)  # another width: rotary's view for 64 / 2 heads
    assert len(other["table"][0]) == 16


def test_info(client, run):
    info = client.get("/info").json()
    assert info["checkpoint"] == "best.pt" and info["step"] == 120  # a name, never a path
    validation = {"best": 3.25, "metric": "loss", "loss": 3.25, "nll": 3.0, "ppl": 25.8, "bleu": 1.5, "chrf": 40.5}
    assert info["validation"] == validation  # every score validation logged (train.valid_scores)
    model = info["model"]
    assert (model["d_model"], model["n_heads"], model["n_encoder_layers"], model["n_decoder_layers"]) == (32, 4, 1, 2)
    # Counted as trained, though on a CPU the served copy holds its linear weights input-major, as buffers.
    assert model["parameters"] == count_parameters(load_model(run / "best.pt", "cpu")[0])
    assert info["vocab_size"] == 80 and info["languages"] == ["de", "en"]
    assert info["decode"]["beam"] == 3 and info["decode"]["max_tokens"] == 64
    assert info["limits"]["max_sentences"] == 8 and info["dtype"] == "fp32"


def test_ctranslate2_engine_serves_translate_and_our_model_the_page(ctranslate2, copy_model, monkeypatch):
    """serve --engine ctranslate2: /translate goes through CTranslate2 (greedy: our outputs and scores);
    /attention and /beam still run our model; /info says which engine translates."""
    calls = []
    real = ctranslate2_engine.ctranslate2_search
    monkeypatch.setattr(ctranslate2_engine, "ctranslate2_search", lambda *a, **k: calls.append(1) or real(*a, **k))
    lines = LINES[: SETTINGS.max_sentences]
    with (
        TestClient(create_app(Service(copy_model, SETTINGS, "cpu", SearchFlags(dtype="fp32")))) as ours,
        TestClient(
            create_app(Service(copy_model, SETTINGS, "cpu", SearchFlags(dtype="fp32", engine="ctranslate2")))
        ) as theirs,
    ):
        assert ours.get("/info").json()["decode"]["engine"] == "ours"
        assert theirs.get("/info").json()["decode"]["engine"] == "ctranslate2"
        # /translate's stop rule: CTranslate2 stops once `beam` hypotheses have finished, whatever decode.stop says
        assert (ours.get("/info").json()["decode"]["stop"], theirs.get("/info").json()["decode"]["stop"]) == (
            "exact",
            "early",
        )
        expected = post(ours, "/translate", {"text": lines, "beam": 1})["translations"]
        assert not calls
        got = post(theirs, "/translate", {"text": lines, "beam": 1})["translations"]
        assert calls  # it was CTranslate2 that translated
        assert [t["text"] for t in got] == [t["text"] for t in expected]
        assert len({t["text"] for t in got}) > len(lines) // 2
        assert [t["score"] for t in got] == pytest.approx([t["score"] for t in expected], abs=1e-3)
        calls.clear()
        for path, body in (("/attention", {"text": lines[0], "beam": 1}), ("/beam", {"text": lines[0], "beam": 3})):
            # The same search and maps; ours multiplies input-major weights (weight_formats.py), so floats may differ
            # in the last digits.
            assert_close(post(theirs, path, body), post(ours, path, body))
        assert not calls  # the page's views are our model's


def assert_close(a, b, path: str = "") -> None:
    """JSON values equal, floats to 1e-4."""
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_close(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert a == pytest.approx(b, abs=1e-4), path
    else:
        assert a == b, path


def test_page_is_self_contained(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    static = Path(cli.__file__).parent.parent / "serve" / "static"
    names = sorted(p.name for p in static.iterdir())
    assert names == ["app.js", "index.html", "style.css"]
    for name in names:
        served = client.get(f"/static/{name}")
        assert served.status_code == 200 and served.text == (static / name).read_text(encoding="utf-8")
        # Nothing from elsewhere: the one URL-like string is the SVG namespace name, which is never fetched.
        text = served.text.replace("http://www.w3.org/2000/svg", "")
        assert "http://" not in text and "https://" not in text and "@import" not in text


# ----------------------------------------------------------------------------- the command


def run_cli(*argv) -> tuple[int, str]:
    try:
        cli.main([str(a) for a in argv])
    except SystemExit as e:
        return e.code, ""
    return 0, ""


# ----------------------------------------------------------------------------- the page in a real browser

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture
def server(run):
    """A real uvicorn on 127.0.0.1 and a free port, with serve's limits, in a thread; -> its base URL."""
    sock = listen("127.0.0.1", 0)
    service = Service(run, SETTINGS, "cpu", SearchFlags(dtype="fp32"))
    server = make_server(create_app(service, "127.0.0.1"), SETTINGS, service.drain)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()


@pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="no chromium and chromedriver: `make test` installs Debian's where apt-get can "
    "(or: apt-get install chromium chromium-driver)",
)
def test_page_in_headless_chromium(server, tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # No network beyond the server: without the background-networking flags Chromium's own connections are
    # refused many at a time on a closed machine.
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    try:
        driver.get(server + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "idle")
        # The model's kind of position, as /positions describes it: its title, its note and its table drawn.
        wait.until(lambda d: d.find_element(By.ID, "positions-help").text)
        assert driver.find_element(By.ID, "positions-title").text.startswith("Sinusoidal positional encoding")
        assert "sin(pos / 10000^(2i/d))" in driver.find_element(By.ID, "positions-help").text
        assert driver.find_element(By.ID, "positions").size["height"] > 100
        box = driver.find_element(By.ID, "text")
        box.send_keys(SENTENCES[0])
        driver.find_element(By.ID, "go").click()
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") in ("ready", "error"))
        assert driver.find_element(By.ID, "error").get_attribute("hidden") is not None, driver.find_element(
            By.ID, "error"
        ).text
        # The cross-attention grid is shown first: every decoder layer x head, one selected.
        thumbs = driver.find_elements(By.CSS_SELECTOR, "#grid canvas")
        assert len(thumbs) == 2 * 4 and len(driver.find_elements(By.CSS_SELECTOR, "#grid canvas.on")) == 1
        assert driver.find_elements(By.CSS_SELECTOR, "#nbest-table tbody tr")
        assert driver.find_elements(By.CSS_SELECTOR, "#lines line")
        assert driver.find_elements(By.CSS_SELECTOR, "#beam-chart circle")
        # Clicking another head selects it; hovering a source piece highlights it.
        thumbs[-1].click()
        assert "layer 2, head 4" in driver.find_element(By.ID, "big-title").text
        driver.find_element(By.CSS_SELECTOR, "#kinds button:first-child").click()  # encoder self-attention
        assert len(driver.find_elements(By.CSS_SELECTOR, "#grid canvas")) == 1 * 4
        from selenium.webdriver.common.action_chains import ActionChains

        ActionChains(driver).move_to_element(
            driver.find_element(By.CSS_SELECTOR, "#lines text[data-query='0']")
        ).perform()
        assert driver.find_elements(By.CSS_SELECTOR, "#lines text.hot")
        # The animation of the sentence on screen: fetched as a GIF and offered as walk.gif.
        driver.find_element(By.ID, "animate").click()
        link = driver.find_element(By.ID, "animation-link")
        WebDriverWait(driver, 120).until(lambda d: (link.get_attribute("href") or "").startswith("blob:"))
        assert link.text.startswith("walk.gif (") and link.get_attribute("download") == "walk.gif"
        assert driver.save_screenshot(str(tmp_path / "page.png"))
        assert (tmp_path / "page.png").stat().st_size > 10_000
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        driver.quit()


# ----------------------------------------------------------------------------- scripts/bench_serve.py


def bench_serve(run, tmp_path, *flags, hide: Path | None = None) -> subprocess.CompletedProcess:
    """scripts/bench_serve.py on `run` and SENTENCES (written to tmp_path/test.de) with `flags`, on one thread;
    `hide`: a folder put first on its path."""
    root = Path(__file__).resolve().parents[2]
    (tmp_path / "test.de").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    path = os.pathsep.join([*([str(hide)] if hide else []), str(root)])
    return subprocess.run(
        [sys.executable, "scripts/bench_serve.py", str(run), str(tmp_path / "test.de"), *map(str, flags)],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path},
    )


def test_bench_serve_runs_and_writes_json(run, tmp_path):
    """At toy size: both engines where CTranslate2 is installed (each with one window: a server costs seconds to
    start), every request answered, no error, each server with the --workers asked for; after each server (where CTranslate2 is installed) CTranslate2
    itself on the same sentences in calls of the size that server formed, and the server's ratio to it. No timing
    is asserted."""
    engines = ["ours", "ctranslate2"] if importlib.util.find_spec("ctranslate2") else ["ours"]
    out = tmp_path / "bench.json"
    result = bench_serve(
        run,
        tmp_path,
        *("--clients", 3, "--requests", 9, "--time-limit", 60, "--sentences", 2, "--beam", 2),
        *("--windows", 5, "--engines", *engines, "--stop", "early", "--workers", 1, "--warmup", 4, "--bursts", 2),
        *("--json", out),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["stop"] == "early" and report["machine"]["cpu"] == cpu_description()
    servers = [r for r in report["results"] if r["engine"] != "ctranslate2_itself"]
    assert [(r["engine"], r["window_ms"]) for r in servers] == [(e, 5) for e in engines]
    for r in servers:
        assert r["requests"] == 9 and r["errors"] == 0 and r["requests_per_s"] > 0
        assert r["p50_ms"] <= r["p99_ms"] and r["rss_before_mb"] > 0 and r["rss_after_mb"] > 0
        assert r["batches"] >= 1 and r["sentences_per_batch"] >= 1 and r["dtype"] == "fp32"
        assert r["workers"] == 1  # --workers reached each server (its /info says so)
        assert r["warmup_requests"] == 4
        assert r["bursts"]["rounds"] == 2 and 0 < r["bursts"]["min_ms"] <= r["bursts"]["median_ms"]
    assert "req/s" in result.stdout and "p99 ms" in result.stdout and "bursts of 3 at once" in result.stdout
    if "ctranslate2" not in engines:
        return
    # Each server row is followed by CTranslate2 itself on its work: the 18 sentences it answered, in as many calls
    # as its mean sentences per search makes, in the server's dtype, on the same beam.
    rows = report["results"]
    assert [r["engine"] for r in rows] == [x for e in engines for x in (e, "ctranslate2_itself")]
    for server, itself in zip(rows[::2], rows[1::2]):
        assert (itself["server_engine"], itself["window_ms"]) == (server["engine"], server["window_ms"])
        assert itself["sentences"] == 9 * 2 and itself["sentences_per_s"] > 0 and itself["seconds"] > 0
        assert itself["calls"] == round(18 / server["sentences_per_batch"])
        assert (itself["compute_type"], itself["beam"], itself["inter_threads"]) == ("float32", 2, 1)
        assert itself["intra_threads"] >= 1 and itself["max_decoding_length"] > 0
        assert server["vs_ct2_itself"] > 0
        assert server["vs_ct2_itself"] == pytest.approx(server["sentences_per_s"] / itself["sentences_per_s"])
    assert "/ct2 itself" in result.stdout and result.stdout.count("ctranslate2_itself") >= 2


def test_bench_serve_without_ctranslate2_says_so_in_one_line(run, tmp_path):
    """Where ctranslate2 cannot be imported (a module of that name that raises ImportError stands first on the
    path), the server rows come without the CTranslate2 itself rows and the ratio, and a note says why. --dtype
    reaches the server."""
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "ctranslate2.py").write_text("raise ImportError('hidden by the test')\n", encoding="utf-8")
    out = tmp_path / "bench.json"
    flags = ("--clients", 1, "--requests", 2, "--windows", 0, "--beam", 1, "--dtype", "int8", "--json", out)
    result = bench_serve(run, tmp_path, *flags, hide=tmp_path / "hidden")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "note: ctranslate2 is not installed: no ctranslate2_itself rows" in result.stderr
    (server,) = json.loads(out.read_text())["results"]
    assert server["engine"] == "ours" and server["requests"] == 2 and "vs_ct2_itself" not in server
    assert server["dtype"] == "int8"  # the server's /info says so
    assert "ctranslate2_itself" not in result.stdout


def test_bench_serve_soak_reports_rss_over_time(run, tmp_path):
    """The soak at toy length: RSS samples, every kind of request answered or refused as it should be, no error;
    no figure is asserted."""
    out = tmp_path / "soak.json"
    result = bench_serve(run, tmp_path, "--soak", "--minutes", 0.1, "--every", 1.5, "--clients", 3, "--json", out)
    assert result.returncode == 0, result.stdout + result.stderr
    soak = json.loads(out.read_text())["soak"]
    assert soak["errors"] == 0 and len(soak["samples"]) >= 4 and soak["samples"][-1]["idle"]
    assert all(x["rss_mb"] > 0 for x in soak["samples"]) and soak["samples"][-1]["requests"] > 10
    assert any(k.startswith("/translate 200") for k in soak["outcomes"])
    assert "RSS" in result.stdout and "errors: 0" in result.stdout


# ----------------------------------------------------------------------------- sampling, prefixes, constraints, alignments


def test_sampling_requests_are_seeded_and_equal_the_translator(client, translator):
    body = {"text": SENTENCES[:3], "sample": "topp:0.9", "temperature": 1.3, "seed": 11, "nbest": 2}
    first, again = post(client, "/translate", body), post(client, "/translate", body)
    assert first == again and (first["sample"], first["seed"], first["beam"]) == ("topp:0.9", 11, 1)
    settings = replace(translator.settings, beam=1, sample="topp:0.9", temperature=1.3, seed=11, nbest=2)
    expected = translator.translate_lines(SENTENCES[:3], settings=settings)
    assert [[h["text"] for h in t["nbest"]] for t in first["translations"]] == [[h.text for h in t] for t in expected]
    unseeded = post(client, "/translate", {"text": SENTENCES[:1], "sample": "topk:5"})
    assert isinstance(unseeded["seed"], int)  # a new one, in the answer so that the request can be repeated


def test_a_tiny_temperature_or_nucleus_answers_greedy_search(client):
    greedy = post(client, "/translate", {"text": SENTENCES[:3], "beam": 1})["translations"]
    for asked in ({"sample": "topk:5", "temperature": 1e-39}, {"sample": "topp:1e-46"}):
        sampled = post(client, "/translate", {"text": SENTENCES[:3], **asked, "seed": 1})["translations"]
        assert [t["text"] for t in sampled] == [t["text"] for t in greedy]


def test_requests_that_differ_only_in_their_seeds_share_a_search_and_get_their_own_samples(run, translator):
    settings = replace(SETTINGS, batch_window_ms=1500)
    with TestClient(create_app(Service(run, settings, "cpu", SearchFlags(dtype="fp32")))) as c:
        bodies = [{"text": [SENTENCES[i]], "sample": "topk:6", "seed": 20 + i} for i in range(3)]
        results = [None] * 3

        def send(i):
            results[i] = c.post("/translate", json=bodies[i]).json()

        threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert c.get("/health").json()["batches"] == 1
    for i, result in enumerate(results):
        alone = replace(translator.settings, beam=1, nbest=1, sample="topk:6", seed=20 + i)
        assert (
            result["translations"][0]["text"] == translator.translate_lines([SENTENCES[i]], settings=alone)[0][0].text
        )


def test_a_prefix_starts_each_translation(client, translator):
    prefixes = ["the red", "", "blue dog"]
    result = post(client, "/translate", {"text": SENTENCES[:3], "prefix": prefixes, "beam": 2})
    texts = [t["text"] for t in result["translations"]]
    assert texts[0].startswith("the red") and texts[2].startswith("blue dog")
    expected = translator.translate_lines(SENTENCES[:3], prefixes, settings=replace(translator.settings, beam=2))
    assert texts == [t[0].text for t in expected]
    one = post(client, "/translate", {"text": SENTENCES[0], "prefix": "the red"})  # strings, as for text
    assert one["translations"][0]["text"].startswith("the red")


@pytest.mark.usefixtures("hf_offline")
def test_an_imported_models_prefix_is_counted_in_its_target_pieces(marian_dir, tmp_path):
    """The prefix's length was checked in source.spm's pieces: "the red dog", three target pieces, was refused as
    eleven by a server whose limit is four."""
    pytest.importorskip("transformers")
    from transformer.inference.hf_import import import_hf

    run, _ = import_hf(marian_dir, tmp_path / "run")
    with TestClient(create_app(Service(run, replace(SETTINGS, max_prefix=4), "cpu"))) as client:
        result = post(client, "/translate", {"text": ["der mann sitzt"], "prefix": ["the red dog"]})
    assert result["translations"][0]["text"].startswith("the red dog")


def test_constraints_are_met_or_said_not_to_be(client):
    asked = [["blue"], [], ["red dog", "the"]]
    result = post(client, "/translate", {"text": SENTENCES[:3], "constraints": asked, "nbest": 2})
    for t, phrases in zip(result["translations"], asked):
        assert ("constraints_met" in t) == bool(phrases)
        if t.get("constraints_met"):
            assert all(p in h["text"] for h in t["nbest"] if h["score"] is not None for p in phrases)
    assert sum(t.get("constraints_met", False) for t in result["translations"]) >= 1


def test_alignments_come_with_each_translation(client, translator):
    result = post(client, "/translate", {"text": SENTENCES[:3], "alignments": True, "nbest": 2})
    settings = replace(translator.settings, alignments=True, nbest=2)
    expected = translator.translate_lines(SENTENCES[:3], settings=settings)
    for t, hyps in zip(result["translations"], expected):
        assert t["alignment"] == [list(p) for p in hyps[0].alignment]
        assert [h["alignment"] for h in t["nbest"]] == [[list(p) for p in h.alignment] for h in hyps]
    assert "alignment" not in post(client, "/translate", {"text": SENTENCES[:1]})["translations"][0]


def test_info_shows_the_new_limits(client):
    limits = client.get("/info").json()["limits"]
    assert (limits["max_samples"], limits["max_constraints"], limits["max_prefix"]) == (16, 8, 128)
