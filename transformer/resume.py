"""What a run carries across a restart: counters, RNG states, resume rules, and the Ctrl-C/SIGTERM flag."""

from __future__ import annotations

import random
import signal
from dataclasses import dataclass, field
from typing import Optional

import torch

from transformer.config import Config, to_dict
from transformer.errors import UserError

# Model and vocabulary cannot change under a resumed run; anything else in the config may.
FROZEN_ON_RESUME = ("model", "data.vocab_size", "data.spm_model_type", "data.src_lang", "data.tgt_lang")
# Changing these reshuffles the epoch's batches: a resumed run then restarts its current epoch.
DATA_ORDER = ("train.seed", "data.source", "data.dir", "data.hub_name", "data.hub_config", "data.train_split",
              "data.max_len", "data.max_tokens", "data.pad_to_multiple", "data.max_train_pairs")

def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, keys.tolist(), pos, has_gauss, cached)  # plain types: loadable weights_only
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


@dataclass
class RunState:
    """Counters that must survive a restart."""

    step: int = 0
    best: Optional[float] = None          # best validation score so far ...
    best_metric: str = "loss"             # ... of this metric: "loss" (lower is better) or "bleu"
    bad_validations: int = 0              # validations in a row without improvement (early stopping)
    elapsed: float = 0.0                  # wall-clock seconds of training so far, across restarts
    tokens: int = 0                       # source + target tokens trained on so far
    data: dict = field(default_factory=lambda: {"epoch": 0, "batches_done": 0})


class StopRequested:
    """Turns SIGINT/SIGTERM into a flag checked between updates, so the loop can save and exit."""

    def __init__(self):
        self.signal_name: Optional[str] = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame):
        if self.signal_name is not None:  # a second Ctrl-C: stop now, without saving
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


def check_resume_config(saved: Config, new: Config) -> list[str]:
    """Refuse changes to frozen values; return descriptions of the changes that will apply."""
    old_d, new_d = to_dict(saved), to_dict(new)
    changes = []
    for section in new_d:
        for key, value in new_d[section].items():
            before = old_d[section][key]
            if before == value:
                continue
            if section in FROZEN_ON_RESUME or f"{section}.{key}" in FROZEN_ON_RESUME:
                raise UserError(f"resume: {section}.{key} was {before!r} in the checkpoint and is {value!r} now; "
                                "the model and vocabulary cannot change under a resumed run")
            if f"{section}.{key}" == "train.weight_decay" and (before > 0) != (value > 0):
                raise UserError("resume: train.weight_decay cannot switch between 0 (Adam) and > 0 (AdamW) "
                                "under a resumed run")
            changes.append(f"{section}.{key}: {before!r} -> {value!r}")
    return changes
