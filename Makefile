# Set-up, data, training and tests. Every target creates the virtual environment first.
PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
# Pinned so that a CPU-only machine with the wheel on disk installs it in seconds;
# override on a GPU machine, e.g. make TORCH_SPEC='torch>=2.4' train
TORCH_SPEC  ?= torch==2.13.0
CONFIG      ?= configs/multi30k.yaml
# A local mirror of the corpora (plain text). Used when present; otherwise `make data`
# downloads Multi30k from the Hugging Face hub through `datasets`.
DATA_MIRROR ?= ../shared/data
ARGS        ?=
# Test processes side by side (pytest-xdist): every test runs one thread, so the suite scales with the cores;
# a module's tests stay in one process (its fixtures are built once), and modules go out in the order
# tests/conftest.py gives them (heaviest first, so the processes end together). TEST_JOBS=0 runs them in this process.
TEST_JOBS   ?= auto

.PHONY: install data train test lint format browser clean reverse bt-data bt bt-tune distill-data student student-small \
	distill-captions student-captions

install: $(VENV)/.installed

EXTRAS      := dev,plot,hub,tensorboard,serve,hf,langid
PIP         := $(PY) -m pip install -q --disable-pip-version-check --no-compile
UV          := $(VENV)/bin/uv pip install -q --python $(PY)

# Python writes the byte code of what it imports when first imported, here even where the environment says not
# to: nothing is compiled at install (all of 1.8 GB of packages took 43 s on 2 cores, for the fraction that is ever
# imported), and no process compiles its imports again.
unexport PYTHONDONTWRITEBYTECODE

# torch through pip, which reads the machine's own pip configuration (a wheel on disk, constraints) where uv does
# not; the rest through uv, which resolves and downloads in parallel (5 s against pip's 100 s), pip as the fallback.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH_SPEC)" uv
	$(UV) -e ".[$(EXTRAS)]" || $(PIP) -e ".[$(EXTRAS)]"
	# Optional: lets the CTranslate2 export tests run; they are skipped where no wheel installs.
	$(UV) "ctranslate2>=4.0" || $(PIP) "ctranslate2>=4.0" || echo "ctranslate2 did not install: its tests will be skipped"
	touch $@

data: install data/multi30k/train.de

data/multi30k/train.de:
	mkdir -p data
	if [ -f "$(DATA_MIRROR)/multi30k/train.de" ]; then \
		ln -sfn "$(abspath $(DATA_MIRROR))/multi30k" data/multi30k; \
	else \
		$(PY) scripts/fetch_multi30k.py data/multi30k; \
	fi

# --resume: run again after Ctrl-C, a crash or a reboot, `make train` continues the run where its last
# checkpoint left it (a new run directory simply starts); a finished run returns in seconds.
train: install data
	$(PY) -m transformer train $(CONFIG) --resume $(ARGS)

# More than the parallel data (docs/more-data.md): back-translated captions, then a distilled student. Each step
# continues where it stopped (a training resumes, a synthesis goes on after its last part); a finished step returns
# in seconds, so any of these is safe to run again.
CAPTIONS    := data/captions/train.en
# The five caption files of multi30k_captions in one language ($(1)), written whole to the target.
join_captions = mkdir -p $(dir $@) && cat $(DATA_MIRROR)/multi30k_captions/train.[1-5].$(1) > $@.tmp && mv $@.tmp $@
reverse: install data train
	$(PY) -m transformer train configs/multi30k_en_de.yaml --resume $(ARGS)

$(CAPTIONS):
	$(call join_captions,en)

bt-data: reverse $(CAPTIONS)
	$(PY) -m transformer synthesize runs/multi30k_en_de --input $(CAPTIONS) --out runs/synthetic/bt_captions \
		--sample topk:10 --seed 1

bt: bt-data
	$(PY) -m transformer train configs/multi30k_bt.yaml --resume $(ARGS)

# The back-translation model continued on the real pairs alone (docs/more-data.md says whether it helped).
bt-tune: bt
	$(PY) -m transformer train configs/multi30k_bt_tune.yaml --resume $(ARGS)

distill-data: bt
	$(PY) -m transformer synthesize runs/multi30k_bt --input data/multi30k/train.de --out runs/synthetic/distilled \
		--beam 4

student: distill-data
	$(PY) -m transformer train configs/multi30k_student.yaml --resume $(ARGS)

student-small: distill-data
	$(PY) -m transformer train configs/multi30k_student_small.yaml --resume $(ARGS)

# The German captions translated by the back-translation model too: five times the sources for a student.
CAPTIONS_DE := data/captions_de/train.de
$(CAPTIONS_DE):
	$(call join_captions,de)

distill-captions: bt $(CAPTIONS_DE)
	$(PY) -m transformer synthesize runs/multi30k_bt --input $(CAPTIONS_DE) --out runs/synthetic/distilled_captions \
		--beam 4

student-captions: distill-data distill-captions
	$(PY) -m transformer train configs/multi30k_student_captions.yaml --resume $(ARGS)

# The code's format and lint rules (ruff, configured in pyproject.toml); `make format` applies them.
lint: install
	$(VENV)/bin/ruff format --check transformer tests scripts
	$(VENV)/bin/ruff check transformer tests scripts

format: install
	$(VENV)/bin/ruff format transformer tests scripts
	$(VENV)/bin/ruff check --fix transformer tests scripts

# -rs: a skipped test prints its reason (the page's browser test says why it could not run).
# The Python packages and the browser's Debian packages install side by side (-j2: each waits on its downloads).
test:
	@$(MAKE) --no-print-directory -j2 install browser
	@$(MAKE) --no-print-directory lint
	TRANSFORMER_DATA="$(abspath $(DATA_MIRROR))" $(PY) -m pytest -q -rs -n $(TEST_JOBS) --dist loadscope --no-loadscope-reorder tests

# The page's real-browser test (tests/serve/test_app.py) needs Chromium and its driver: Debian's packages, installed
# once where apt-get is available (as root, or through sudo without a password); elsewhere the test is skipped.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif ! command -v apt-get >/dev/null; then \
		echo "no chromium or chromedriver, and no apt-get to install them: the page's browser test will be skipped"; \
	elif [ -n "$(SUDO)" ] && ! sudo -n true 2>/dev/null; then \
		echo "no chromium or chromedriver; installing them needs root: sudo apt-get install chromium chromium-driver" \
		     "(the page's browser test will be skipped)"; \
	else \
		echo "installing Debian's chromium and chromium-driver for the page's browser test (once)"; \
		( $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq \
			--no-install-recommends chromium chromium-driver >/dev/null ) \
		|| echo "apt-get could not install chromium and chromium-driver: the page's browser test will be skipped"; \
	fi

clean:
	rm -rf $(VENV) data build *.egg-info .pytest_cache
