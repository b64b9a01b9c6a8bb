"""`transformer serve` as a process (serve/server.py): a taken port, bad settings, a missing extra or engine, each a
one-line error before anything is served."""

import socket
import sys

import pytest

from tests.serve.test_app import run_cli, tiny_run

pytest.importorskip("fastapi", reason="the 'serve' extra is not installed")
pytest.importorskip("httpx", reason="FastAPI's test client needs httpx")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("serve") / "run")


def test_serve_without_ctranslate2_is_one_line_naming_the_extra(run, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 now raises ImportError
    taken = socket.socket()  # were the engine ignored, the server would fail on this port rather than serve on
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        status, _ = run_cli(
            "serve", run, "--device", "cpu", "--engine", "ctranslate2", "--port", taken.getsockname()[1]
        )
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "transformer[ctranslate2]" in err, err


def test_missing_extra_is_one_line_naming_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # importing it now fails as if it were not installed
    for module in ("app", "server", "service"):  # imported already: they would not import fastapi again
        monkeypatch.delitem(sys.modules, f"transformer.serve.{module}", raising=False)
    status, _ = run_cli("serve", "no-such-run")
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1
    assert "pip install 'transformer[serve]'" in err and "fastapi" in err


def test_taken_port_and_bad_settings_are_one_line_errors(run, capsys):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        status, _ = run_cli("serve", run, "--device", "cpu", "--port", taken.getsockname()[1])
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert status == 2 and "cannot listen on 127.0.0.1" in err and "Traceback" not in err
    status, _ = run_cli("serve", run, "--max-chars", "0")
    assert status == 2 and "--max-chars must be at least 1" in capsys.readouterr().err
    status, _ = run_cli("serve", run, "--port", "70000")
    assert status == 2 and "--port" in capsys.readouterr().err
    # A beam past the limit names where it came from: the command line, or the checkpoint (decode.beam 3).
    status, _ = run_cli("serve", run, "--beam", "7", "--max-beam", "5")
    assert status == 2 and capsys.readouterr().err == "error: --beam (7) is above --max-beam (5)\n"
    status, _ = run_cli("serve", run, "--device", "cpu", "--max-beam", "2")
    assert status == 2 and "--max-beam (2) is below the checkpoint's decode.beam (3)" in capsys.readouterr().err
