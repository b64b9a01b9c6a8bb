"""`transformer finish`, which training runs at its end (train.finish): the average of a run's last checkpoints, the
checkpoint and search settings chosen on the validation set (beam and a length penalty from LENPENS, which
final.pt's decode section then holds), the test score, and a summary (RUN_DIR/summary.json and RUN_DIR/final.pt)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from transformer.config import Config, from_dict, save_config, to_dict
from transformer.data.corpus import has_split, load_split
from transformer.data.prepare import eval_pairs, open_prepared_corpora, valid_sets
from transformer.data.store import Store
from transformer.data.vocab import vocab_from_stored
from transformer.device import tf32_matmuls
from transformer.errors import UserError
from transformer.files import atomic_write
from transformer.inference.scoring import SCORES, describe, length_ratio, mean_scores, translate_and_score
from transformer.inference.settings import SearchSettings, search_settings
from transformer.model.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint, weights_checkpoint
from transformer.run_dir import RunDir
from transformer.signals import stop_at_once
from transformer.training.average import average_checkpoints
from transformer.training.metrics import read_metrics

log = logging.getLogger("transformer")

FINAL = RunDir.FINAL  # what `translate RUN_DIR` uses once a run has finished
# The length penalties tried on the validation set at the config's beam; the best goes into final.pt's
# decode.lenpen (and config.yaml), in place of the config's, for every command that reads the run afterwards.
LENPENS = (0.6, 0.8, 1.0, 1.2)


class _Scorer:
    """Translates fixed sets of sources with a model in memory and scores them against their references: one set,
    or one per language pair of a multilingual run (their mean chooses, scoring.mean_scores)."""

    def __init__(self, sets: list[tuple[str, list[list[int]], list[str]]], vocab, device):
        self.sets, self.vocab, self.device = sets, vocab, device

    def __call__(self, model, settings: SearchSettings) -> tuple[dict, dict[str, list[str]]]:
        per_pair, hypotheses = {}, {}
        for name, sources, references in self.sets:
            per_pair[name], hypotheses[name] = translate_and_score(
                model, self.vocab, sources, references, settings, self.device
            )
        return mean_scores(per_pair), hypotheses


def _candidates(run_dir: Path, cfg: Config) -> dict[str, dict]:
    """best.pt, and the average of the last train.keep_last step checkpoints when there are several."""
    if not RunDir(run_dir).best.is_file():
        raise UserError(f"finish: {run_dir} holds no best.pt (has the run validated yet?)")
    found = {RunDir.BEST: load_checkpoint(RunDir(run_dir).best)}
    steps = RunDir(run_dir).step_checkpoints()[-cfg.train.keep_last :] if cfg.train.keep_last else []
    if len(steps) >= 2:
        averaged = average_checkpoints(steps)
        save_checkpoint(averaged, RunDir(run_dir).averaged)
        found[RunDir.AVERAGED] = averaged
        log.info("finish: averaged %s into averaged.pt", ", ".join(p.name for p in steps))
    return found


def _tune(score, model, config: SearchSettings, at_config: dict) -> tuple[SearchSettings, dict]:
    """The length penalty, then the beam, that score best on validation: a small grid around the config's
    settings (at_config: the score at those, already known). -> the chosen settings, and the grid's BLEU."""
    beam = config.beam
    tried = {(beam, config.lenpen): at_config}
    for lenpen in LENPENS if beam > 1 else ():  # greedy search finds the same output at every length penalty
        if (beam, lenpen) not in tried:
            tried[(beam, lenpen)] = score(model, replace(config, lenpen=lenpen))[0]
    # Ties keep the config's value: a change has to earn its place.
    lenpen = max((a for b, a in tried), key=lambda a: (tried[(beam, a)]["bleu"], a == config.lenpen))
    if beam > 1:  # a wider beam, where it helps
        tried[(beam + 2, lenpen)] = score(model, replace(config, beam=beam + 2, lenpen=lenpen))[0]
    chosen = max(((b, a) for b, a in tried if a == lenpen), key=lambda k: (tried[k]["bleu"], -k[0]))
    for (b, a), s in sorted(tried.items()):
        log.info("finish: valid beam %d lenpen %g: %s%s", b, a, describe(s), " (chosen)" if (b, a) == chosen else "")
    grid = {f"beam{b}_lp{a:g}": round(s["bleu"], 2) for (b, a), s in sorted(tried.items())}
    return replace(config, beam=chosen[0], lenpen=chosen[1]), grid


MEMORY_KEYS = ("peak_rss_mib", "peak_cuda_allocated_mib", "peak_cuda_reserved_mib")  # per rank, MiB (train.end)


def _training_record(run_dir: Path, cfg: Config, run: dict, best_step: int) -> dict:
    """Wall time, updates, epochs, throughput, the best validation and the peak memory of the last training
    process (host, and GPU where there was one) from metrics.jsonl and last.pt's run state."""
    # A killed run's validations past its last.pt were done again on resume: the later line of a step wins. A line
    # past both last.pt and best.pt (a kill between metrics.jsonl and the checkpoints, never resumed) is no model's.
    newest = max(run["step"], best_step)
    metrics = read_metrics(run_dir)
    valid = list({r["step"]: r for r in metrics if r.get("split") == "valid" and r["step"] <= newest}.values())
    done = next((r for r in reversed(metrics) if r.get("event") == "done"), {})
    by = "bleu" if cfg.train.valid_bleu and all("bleu" in r for r in valid) else "loss"
    best = (max if by == "bleu" else min)(valid, key=lambda r: r[by]) if valid else {}
    elapsed = run.get("elapsed", 0.0)
    return {
        "updates": run["step"],
        "epochs": run["data"]["epoch"],
        "training_seconds": round(elapsed, 1),
        "tokens_per_s": round(run.get("tokens", 0) / elapsed) if elapsed else None,
        "best_valid_loss": min((r["loss"] for r in valid), default=None),
        "best_valid_bleu": max((r["bleu"] for r in valid if "bleu" in r), default=None),
        "best_step": best.get("step"),
        "seconds_to_best": best.get("elapsed"),
        **{key: done[key] for key in MEMORY_KEYS if key in done},
    }


def finished_summary(run_dir: Path, step: int) -> dict | None:
    """summary.json, when the end of training completed at `step`: final.pt and a summary.json of that step
    written after it. A kill between the two leaves final.pt alone, and the end is done again."""
    final, summary = RunDir(run_dir).final, RunDir(run_dir).summary
    try:
        if summary.stat().st_mtime_ns < final.stat().st_mtime_ns:
            return None
        record = json.loads(summary.read_text(encoding="utf-8"))
        record["decode"] = {"beam": int(record["decode"]["beam"]), "lenpen": float(record["decode"]["lenpen"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if record.get("updates") == step else None


def end_of_training(run_dir: Path, cfg: Config, step: int, device: torch.device) -> None:
    """What `train` does once its updates are done: finish(), unless this process trained nothing and the end of
    training completed before (final.pt is gone once a run trains on): a job script that always passes --resume
    must not redo its minutes."""
    summary = finished_summary(run_dir, step)
    if summary is None:
        with stop_at_once(
            lambda name: (
                f"{name}: stopped while choosing the final model; the checkpoints are "
                f"complete, and `transformer finish {run_dir}` does this part again"
            )
        ):
            finish(run_dir, device)
        return
    # The resume wrote its own settings to config.yaml and nothing trained with them: the run's, as finish() wrote
    # them, but where the run and its data are now (a moved run directory, a corpus put elsewhere).
    last = load_checkpoint(RunDir(run_dir).last)
    trained = from_dict(last["config"])
    save_config(
        replace(
            trained,
            decode=replace(trained.decode, **summary["decode"]),
            train=replace(trained.train, run_dir=cfg.train.run_dir),
            data=replace(trained.data, dir=cfg.data.dir),
        ),
        RunDir(run_dir).config,
        pieces=len(vocab_from_stored(last["vocab"])),
    )
    log.info(
        "finish: nothing left to train; keeping final.pt and summary.json from the end of this training "
        "(`transformer finish %s` does it again)",
        run_dir,
    )
    _log_summary({**summary, "run_dir": str(run_dir), "checkpoint": str(run_dir / FINAL)})


def finish(run_dir: str | Path, device: torch.device) -> dict:
    """Choose and score the run's final model; write final.pt (weights + tuned decode settings) and summary.json.
    fp32 products run in TF32 on a GPU, as in training's validations (device.tf32_matmuls)."""
    with tf32_matmuls(device):
        return _finish(run_dir, device)


def _finish(run_dir: str | Path, device: torch.device) -> dict:
    started = time.perf_counter()
    run_dir = Path(run_dir)
    last = load_checkpoint(RunDir(run_dir).last)
    cfg = from_dict(last["config"])
    data_dir = Path(cfg.data.dir)
    if cfg.data.source == "local" and not data_dir.is_dir():  # else the test score would be skipped as absent
        fix = (
            "put the corpus back there"
            if data_dir.is_absolute()
            else f"it is relative to {Path.cwd()}, where this runs: run from the directory training ran in"
        )
        raise UserError(f"finish: data.dir {cfg.data.dir!r} is not a directory; {fix}")
    # Read before the minutes of searching: half a test split, or sides of different lengths, is an error here.
    tests = test_sets(cfg)
    if not tests:
        log.info("finish: the corpus has no test split %r: the summary will have no test score", cfg.data.test_split)
    candidates = _candidates(run_dir, cfg)
    models = {name: model_from_checkpoint(state, device) for name, state in candidates.items()}
    vocab = next(iter(models.values()))[1]
    store = Store(RunDir(run_dir).store)
    corpora = open_prepared_corpora(cfg, run_dir, vocab) if any(c.valid_split for c in cfg.data.corpora) else []
    sets = [(name, [c.source(i) for i in range(len(c))], refs) for name, c, refs in valid_sets(cfg, store, corpora)]
    score = _Scorer(sets, vocab, device)
    log.info(
        "finish: choosing on the %d validation pairs training kept (data.max_valid_pairs, data.max_len); "
        "`transformer evaluate --split valid` translates the whole split",
        sum(len(refs) for _, _, refs in sets),
    )

    # The checkpoint first, at the config's search settings (in fp32, with our search); then the settings for it.
    config = search_settings(cfg.decode)
    valid_scores = {name: score(model, config)[0] for name, (model, _, _) in models.items()}
    for name, s in valid_scores.items():
        log.info("finish: valid %s: %s", name, describe(s))
    chosen = max(valid_scores, key=lambda n: valid_scores[n]["bleu"])
    model = models[chosen][0]
    settings, grid = _tune(score, model, config, valid_scores[chosen])
    beam, lenpen = settings.beam, settings.lenpen

    tuned = replace(cfg, decode=replace(cfg.decode, beam=beam, lenpen=lenpen))
    # best.pt's training state (its step and validation score) comes along for serve's /info; an average has none.
    made = {"made_from": chosen, **({"run": candidates[chosen]["run"]} if "run" in candidates[chosen] else {})}
    save_checkpoint(
        weights_checkpoint(to_dict(tuned), candidates[chosen]["vocab"], candidates[chosen]["model"], **made),
        run_dir / FINAL,
    )
    save_config(tuned, RunDir(run_dir).config, pieces=len(vocab))

    # A run started from a trained model says which (train.init_from): the file and its sha256.
    origin = (
        {"init_from": {"path": cfg.train.init_from, "sha256": cfg.train.init_from_sha256}}
        if cfg.train.init_from
        else {}
    )
    summary = {
        "run_dir": str(run_dir),
        "checkpoint": str(run_dir / FINAL),
        "made_from": chosen,
        **origin,
        "decode": {"beam": beam, "lenpen": lenpen},
        "valid_grid_bleu": grid,
        "valid": {
            n: {"bleu": round(s["bleu"], 2), "length_ratio": round(length_ratio(s), 3)} for n, s in valid_scores.items()
        },
        **_training_record(run_dir, cfg, last["run"], candidates[RunDir.BEST].get("run", {}).get("step", 0)),
    }
    if tests:
        summary["test"] = _score_test(cfg, tests, vocab, model, settings, device, run_dir)
    summary["finish_seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(summary, indent=2) + "\n"
    atomic_write(RunDir(run_dir).summary, lambda f: f.write(text.encode("utf-8")))
    _log_summary(summary)
    return summary


def test_sets(cfg: Config) -> list[tuple[str, list[str], list[str], str]]:
    """The test sets the end of training scores, (pair, sources, references, the target token or ""): data.dir's test
    split, and each corpus's test_split (a multilingual run's other pairs). Read now: half a split is an error."""
    sets = []
    for p in eval_pairs(cfg.data):
        if p.test_split and has_split(p.data, p.test_split):
            sources, references = load_split(p.data, p.test_split)
            sets.append((p.name, sources, references, cfg.data.target_tokens.get(p.data.tgt_lang, "")))
    return sets


def _score_test(cfg: Config, tests: list[tuple], vocab, model, settings: SearchSettings, device, run_dir: Path) -> dict:
    sets = []
    for name, sources, references, token in tests:
        prefix = vocab.piece_ids([token]) if token else []  # a multilingual model is asked for the language
        sets.append((name, [prefix + ids for ids in vocab.encode(sources)], references))
    scores, hypotheses = _Scorer(sets, vocab, device)(model, settings)
    RunDir(run_dir).eval.mkdir(exist_ok=True)
    paths = {}
    for name, hyps in hypotheses.items():
        split = cfg.data.test_split if len(hypotheses) == 1 else f"{cfg.data.test_split}.{name}"
        paths[name] = RunDir(run_dir).final_hyp(split)
        text = "".join(h + "\n" for h in hyps)
        atomic_write(paths[name], lambda f, text=text: f.write(text.encode("utf-8")))
    return {
        "split": cfg.data.test_split,
        **{s.name: round(scores[s.name], 2) for s in SCORES},
        "length_ratio": round(length_ratio(scores), 3),
        **{f"{s.name}_signature": scores[f"{s.name}_signature"] for s in SCORES},
        **({"pairs": scores["pairs"]} if "pairs" in scores else {}),
        "hypotheses": str(next(iter(paths.values()))) if len(paths) == 1 else {n: str(p) for n, p in paths.items()},
    }


def _log_summary(s: dict) -> None:
    minutes = (s["training_seconds"] or 0) / 60
    lines = [
        f"summary: {s['updates']} updates, {s['epochs']} epochs, {minutes:.1f} min of training"
        + (f", {s['tokens_per_s']:,} tokens/s" if s.get("tokens_per_s") else "")
    ]
    if s.get("best_valid_loss") is not None:
        best = f"best valid loss {s['best_valid_loss']:.4f}"
        if s.get("best_valid_bleu") is not None:
            best += f", best valid BLEU {s['best_valid_bleu']:.2f}"
        if s.get("seconds_to_best") is not None:
            best += f" (best checkpoint at step {s['best_step']}, {s['seconds_to_best'] / 60:.1f} min)"
        lines.append("summary: " + best)
    if "test" in s:
        t = s["test"]
        lines.append(
            f"summary: test {describe(t)} with {s['made_from']}, beam {s['decode']['beam']}, "
            f"lenpen {s['decode']['lenpen']:g}"
        )
        # A summary.json of an earlier version (a resume with nothing left to train) has fewer scores.
        lines += [f"summary:   {t[f'{score.name}_signature']}" for score in SCORES if score.name in t]
    lines.append(
        f"summary: use {s['checkpoint']} (`transformer translate {s['run_dir']}` picks it); "
        f"details in {s['run_dir']}/summary.json"
    )
    for line in lines:
        log.info(line)
