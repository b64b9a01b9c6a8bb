"""serve's model behind the API (serve/service.py): its settings checked, the checkpoint read once and a request's
sentences encoded once, a beam wider than the vocabulary refused (the API's answers: tests/serve/test_app.py)."""

import pytest

from tests.serve.test_app import SENTENCES, SETTINGS, post, tiny_run
from transformer.inference.settings import SearchFlags

pytest.importorskip("fastapi", reason="the 'serve' extra is not installed")
pytest.importorskip("httpx", reason="FastAPI's test client needs httpx")
from fastapi.testclient import TestClient  # noqa: E402

from transformer.serve.app import create_app  # noqa: E402
from transformer.serve.service import ServeSettings, Service  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("serve") / "run")


def test_a_beam_wider_than_the_vocabulary_is_refused_whatever_max_beam_allows(run):
    """A beam in the millions held millions of scores per sentence until the server ran out of memory."""
    settings = ServeSettings(batch_window_ms=2, max_sentences=8, max_chars=400, max_beam=10**9)
    with TestClient(create_app(Service(run, settings, "cpu", SearchFlags(dtype="fp32")))) as c:
        for path in ("/translate", "/beam"):
            response = c.post(path, json={"text": SENTENCES[0] if path == "/beam" else [SENTENCES[0]], "beam": 10**8})
            assert response.status_code == 422 and "beam must be between 1 and 80" in response.text, response.text
        assert c.post("/translate", json={"text": [SENTENCES[0]], "beam": 80}).status_code == 200
        assert c.get("/info").json()["limits"]["max_beam"] == 80  # what the page's beam input may offer


def test_settings_are_checked():
    with pytest.raises(Exception, match="--max-chars must be at least 1"):
        ServeSettings(max_chars=0)
    with pytest.raises(Exception, match="--batch-window-ms"):
        ServeSettings(batch_window_ms=-1)
    with pytest.raises(Exception, match="^--max-samples must be at most 16, got 17$"):  # translate's bound too
        ServeSettings(max_samples=17)


def test_checkpoint_is_read_once_and_each_request_encoded_once(run, monkeypatch):
    """The service reads its checkpoint once (the model and /info's run state come from one load), and a
    /translate request's sentences go through SentencePiece once (batch sizing and search share the ids)."""
    import transformer.inference.translator as translate_module
    from transformer.data.vocab import Vocab

    loads, encoded = [], []
    real_load, real_encode = translate_module.load_checkpoint, Vocab.encode
    monkeypatch.setattr(translate_module, "load_checkpoint", lambda path: loads.append(path) or real_load(path))
    monkeypatch.setattr(Vocab, "encode", lambda self, lines: encoded.append(list(lines)) or real_encode(self, lines))
    with TestClient(create_app(Service(run, SETTINGS, "cpu", SearchFlags(dtype="fp32")))) as c:
        assert len(loads) == 1 and c.get("/info").json()["step"] == 120
        result = post(c, "/translate", {"text": SENTENCES[:3], "beam": 2})
    assert len(result["translations"]) == 3
    assert encoded == [SENTENCES[:3]]
