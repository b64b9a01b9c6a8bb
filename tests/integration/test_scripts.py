"""scripts/fetch_multi30k.py: the real `datasets` loading path, run offline on a local dataset directory."""

from __future__ import annotations

import subprocess
import sys

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
