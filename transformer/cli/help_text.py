"""What each verb's --help says of it: the prose above its options (cli/parser.py holds the options)."""

from transformer.inference.scoring import SCORES  # no torch either

SCORE_LABELS = ", ".join(score.label for score in SCORES)

# transformer train
TRAIN = (
    "Train a model from a YAML config. The run directory (train.run_dir) receives the "
    "effective config, the SentencePiece model, the prepared store, metrics.jsonl, train.log, "
    "last.pt and best.pt; it is locked (train.lock) while a training process owns it. When "
    "training ends (unless train.finish is false) the last checkpoints are averaged (with "
    "train.keep_last >= 2), the checkpoint and the length penalty are chosen on the validation "
    "set, the test split is translated and scored, and a summary is printed and written to "
    "summary.json; final.pt is then what `translate RUN_DIR` uses. With train.init_from: "
    "RUN_DIR_OR_CHECKPOINT (or --set train.init_from=...), a new run starts from that model's "
    "weights and vocabulary (fine-tuning), with a fresh optimizer, schedule and data."
)

# transformer prepare
PREPARE = (
    "Train (or reuse) the run's SentencePiece model and encode the training and validation splits "
    "once into train.run_dir/store: flat numpy token files that training memory-maps, so every "
    "start, resume and rank begins in seconds. `train` does this itself when the store is missing "
    "or its inputs changed; run `prepare` on one machine before training on many (under torchrun "
    "every rank maps the same files). With train.init_from (a run that starts from a trained "
    "model) the store is encoded with that model's vocabulary, and how well it fits the new data is "
    "reported (pieces per word, unknown pieces). Prints the store directory."
)

# transformer finish
FINISH = (
    "What `train` does when training ends, for a run directory: average the last train.keep_last "
    "step checkpoints, choose between the average and best.pt by validation BLEU, choose the "
    "length penalty (and beam) on the validation set, translate and score the test split, and "
    "write final.pt (the chosen weights with the chosen search settings), summary.json and "
    "config.yaml. For a run stopped while it was finishing, or trained with train.finish false."
)

# transformer attention
ATTENTION = (
    "Run one sentence through a trained model and plot its attention weights: encoder "
    "self-attention, masked decoder self-attention and encoder-decoder (cross) attention, "
    "one figure per kind with a grid of layers (rows) x heads (columns). Without --target the "
    "decoder reads the model's own translation (beam search with the checkpoint's decode "
    "settings). Rows are queries, columns are keys, both labelled with SentencePiece pieces "
    "(U+2581 marks a word start); every row sums to 1."
)

# transformer animate
ANIMATE = (
    "Animate what the model computes on one sentence, in the order the illustrated explainers "
    "draw it, with the model's real values: the encoder (pieces, embedding rows times sqrt(d_model), "
    "position rows, then for one layer and head Q and K, the scores filling in, divided by sqrt(d_k), "
    "softmax row by row, the weighted sum of V, all heads side by side and their join), then the decoder "
    "step by step as the search wrote the translation (its masked self-attention, its attention over the "
    "source, the most probable next pieces and the one chosen). Writes a GIF, an MP4 (needs ffmpeg) or a "
    "folder of PNG frames, and prints its path; the translation goes to stderr."
)

# transformer synthesize
SYNTHESIZE = (
    "Translate every line of --input (monolingual text in the model's source language) and write\n"
    "the pairs to --out as train.SRC and train.TGT (the model's languages), for data.corpora of a\n"
    "training run: an English->German model's outputs of English captions are German sources for a\n"
    "German->English run (back-translation); a teacher's outputs of its own sources train a student\n"
    "(distillation). Beam search or sampling (--sample topk:K|topp:P, --temperature, --seed); --nbest N\n"
    "outputs per line; several models make an ensemble.\n\n"
    "Resumable: the input goes in parts of --chunk-lines lines, each written whole. After Ctrl-C,\n"
    "kill -9 or a crash, the same command continues after the last part written; the result is\n"
    "byte for byte what an uninterrupted run writes (a seeded sample depends on its source alone;\n"
    "without --seed, the one drawn is kept in the record and used again). synthesis.json records the\n"
    "models' sha256, the input, the settings and the counts. Empty outputs, copies of the source,\n"
    "outputs over 3x longer or shorter, and runaway repetitions are left out and counted (--no-filter\n"
    "keeps them).\n\n"
    "Cost: as translate --input with the same settings. On a 2-core CPU (AMD EPYC Zen 4, 2 threads),\n"
    "make bt-data's 145,000 English captions with --sample topk:10 took 6 min 39 s, 363 lines/s, and\n"
    "1.2 GiB of memory (docs/more-data.md)."
)

# transformer translate
TRANSLATE = (
    "Translate sentences given as arguments, read from --input FILE, or read from stdin\n"
    "line by line (each line is translated as soon as it arrives, so interactive use works).\n"
    "Prints one translation per input line, in input order; an empty input line gives an\n"
    "empty output line; a source longer than model.max_positions - 2 subwords is truncated\n"
    "with a warning on stderr. A line longer than 1,048,576 characters is cut there before it\n"
    "is split into subwords, with that warning too (splitting costs ~60 bytes a character;\n"
    "the model reads only the first subwords), and a stream goes on with the next line.\n\n"
    "n-best format: with --nbest N > 1, prints N lines per input line, best first, each\n"
    "  SCORE<TAB>TRANSLATION\n"
    "where SCORE is the sum of the token log-probabilities (EOS included) divided by the\n"
    "length penalty ((5 + length) / 6)^lenpen, length counting EOS; an empty input gives N\n"
    "lines '0.0000<TAB>'. With --alignments, each translation is followed by a tab and its\n"
    "word alignment, 'i-j' pairs (source word i, output word j, from 0).\n\n"
    "Ensembles: several run directories or checkpoints before the sentences (each an existing\n"
    "directory with a checkpoint, or a .pt file), or --checkpoint PATH repeated, are searched as\n"
    "one model: their log-probabilities averaged at each step. They must share one vocabulary."
)

# transformer evaluate
EVALUATE = (
    "Translate a split of the run's data (read through the config's data section) or --src/--ref "
    f"files, score with sacreBLEU ({SCORE_LABELS}; cased, BLEU with 13a tokenisation), print the scores with "
    "their signatures, and write the hypotheses and a JSON of scores to RUN_DIR/eval/SPLIT.beamB.lpA.hyp "
    "and .json (.early, .bf16, .int8 or .ct2 added for those settings; SPLIT is --src's file name, or "
    "'pipe' for a pipe, with a digest of the sentences added when another source's results hold "
    "that name; for a checkpoint file: eval/ next to it, named after it). --compare: other systems on the "
    "same sentences, by sacreBLEU's paired bootstrap resampling (1000 resamples, seed 12345): each score "
    "with its 95% confidence interval, each difference to the first system with its interval and p-value."
)

# transformer serve
SERVE = (
    "Serve one checkpoint over HTTP (pip install 'transformer[serve]'): POST /translate,\n"
    "/attention and /beam, GET /positions, /health and /info take and give JSON; GET / is a\n"
    "page that translates what you type and draws every attention head, the beam search step by\n"
    "step and the positional encoding. Requests that arrive within --batch-window-ms are\n"
    "translated in one batched search on one model worker. Binds to 127.0.0.1 unless --host\n"
    "says otherwise, and answers only requests addressed to loopback names, its own address or\n"
    "--allow-host's; there is no authentication, and no request can name a file. What a\n"
    "request or connection may cost is bounded by the limits below; SIGTERM or Ctrl-C lets\n"
    "the requests in flight finish (--drain-timeout), answers the rest 503 and exits 0."
)

# transformer average
AVERAGE = (
    "Average model weights (float mean) into a new checkpoint that translate and evaluate accept; "
    "config and vocabulary are kept, optimizer state is dropped. Either a run directory and "
    "--last N (its N latest step_*.pt, written by the trainer when train.keep_last > 0; output "
    "RUN_DIR/averaged.pt by default), or checkpoint files and --output FILE. All inputs must share "
    "the model config and the vocabulary; each counts once (a file named twice, a link to it, or "
    "the same weights twice, such as last.pt beside its step's checkpoint, is refused)."
)

# transformer shortlist
SHORTLIST = (
    "Write RUN/shortlist.txt, the lexical shortlist that translate, evaluate, synthesize and serve read with "
    "--shortlist: for each source piece the target pieces seen with it most (the Dice coefficient over the "
    "run's training pairs, or --src/--tgt), and the most frequent target pieces. A search then scores only a "
    "sentence's candidates at each step instead of the whole vocabulary (its batch's projected together). The "
    "file is CTranslate2's vocabulary map (vmap), which --engine ctranslate2 and `export ctranslate2` use too. "
    "It prints what share of the validation references' pieces the candidates hold; `evaluate` with and "
    "without --shortlist measures the BLEU it costs. Seconds for Multi30k's 29,000 pairs."
)

# transformer export
EXPORT = (
    "Write a checkpoint as a model directory for another engine. ctranslate2: model.bin, "
    "vocabularies and the SentencePiece model spm.model, for serving with CTranslate2 (pip install "
    "'transformer[ctranslate2]'); CTranslate2 takes SentencePiece pieces and appends </s> to the "
    "source itself, and `translate --engine ctranslate2` does this for you, once per checkpoint. "
    "hf: a transformers MarianMTModel directory (config.json, model.safetensors, source.spm, "
    "target.spm, vocab.json, tokenizer and generation configs) that MarianMTModel.from_pretrained "
    "and MarianTokenizer.from_pretrained load (pip install 'transformer[hf]'); the weights are "
    "converted exactly, and a model Marian cannot compute (pre-norm) is refused."
)

# transformer import
IMPORT = (
    "Read a transformers MarianMTModel directory, as MarianMTModel.save_pretrained and "
    "MarianTokenizer.save_pretrained write it (config.json; model.safetensors or pytorch_model.bin, fp16 or "
    "fp32; source.spm, target.spm, vocab.json, tokenizer_config.json; generation_config.json when present), "
    "and write RUN_DIR: final.pt, config.yaml, the tokenizer's four files and transformer-import.json. "
    "translate, evaluate, serve, attention, export and train.init_from (fine-tuning) take it as they take a "
    "run of ours, and translate as transformers' generate() does (docs/opus-mt.md says where the two differ). "
    "Nothing is downloaded: fetch a model first (huggingface-cli download Helsinki-NLP/opus-mt-de-en "
    "--local-dir DIR). A directory of another architecture (BART, T5, M2M100, ...) or a setting we cannot "
    "honour is refused, naming it (pip install 'transformer[hf]')."
)
