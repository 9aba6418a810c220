# Everything a learner, a teacher or CI needs, from a fresh clone. `make help` lists the targets.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
EX     ?=
DIR    ?=
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_PROGRESS_BARS := 1
export TOKENIZERS_PARALLELISM := false
# Idle OpenMP threads sleep instead of spinning: with 2 cores shared by 2 test workers, spinning
# threads slow torch down several times over (measured while training the bundled models).
export OMP_WAIT_POLICY := PASSIVE

.PHONY: help install test test-fast test-browser lab generate serve grade exercises check-exercises student-release bench lint clean

help:
	@echo "make lab        JupyterLab on your copy of the course (workspace/, git-ignored; refreshed from chapters/ and exercises/ at each start; as root and headless too): the main job"
	@echo "make test       install everything pinned into $(VENV) and run every test (what CI runs)"
	@echo "make test-fast  the tests without notebooks"
	@echo "make test-browser  JupyterLab + Debian chromium: a chapter runs, its playground redraws, its exercise link opens"
	@echo "make generate   one greedy generation from the bundled model on the command line"
	@echo "make serve      the OpenAI-compatible server on the bundled model, http://127.0.0.1:8000/v1 (ARGS=...)"
	@echo "make grade      grade the exercises with minillm/grading (EX=05 for one); needs no solutions/"
	@echo "make exercises  regenerate exercises/ and their grading manifests from solutions/"
	@echo "make student-release DIR=../class  a copy of the course for a class: no solutions/, make grade still grades"
	@echo "make bench      the forward-pass benchmark (bench/forward.py); each other bench: $(PY) bench/NAME.py (docs/results.md)"
	@echo "make lint       ruff"

$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) tools/fill_numba_cache.py  # compile the numba kernels into their on-disk cache: no chapter pays it
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -n 2 --dist loadgroup tests

test-fast: install
	$(PY) -m pytest -n 2 -m "not notebook" tests

# Also part of `make test`; alone it prints its timings and leaves screenshots in /tmp/minillm-browser.
test-browser: install
	$(PY) -m pytest -p no:cacheprovider -s -rs tests/test_browser.py

lab: install
	$(PY) tools/lab.py

generate: install
	$(VENV)/bin/minillm generate "Once upon a time" --max-tokens 32

serve: install
	$(VENV)/bin/minillm serve $(ARGS)

exercises: install
	$(PY) tools/build_exercises.py

check-exercises: install
	$(PY) tools/build_exercises.py --check

grade: install
	$(PY) tools/grade.py $(if $(EX),--only $(EX),)

student-release: install
	@test -n "$(DIR)" || { echo "make student-release needs DIR=path: a new or empty folder outside this repository" >&2; exit 2; }
	$(PY) tools/student_release.py "$(DIR)"

bench: install
	$(PY) bench/forward.py

lint: install
	$(VENV)/bin/ruff check minillm kernels tests tools bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
