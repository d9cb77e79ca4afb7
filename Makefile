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

.PHONY: qualify test test-fresh install clean-venv chromium

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[reference,test]'
	touch $(STAMP)

install: $(STAMP)

qualify: $(STAMP)
	$(VENV)/bin/bakeoff qualify --model $(MODEL) --backends $(BACKENDS)

test: $(STAMP) chromium
	$(VENV)/bin/python -m pytest tests/ -q -ra --durations=15

# `make test` from an empty cache: BAKEOFF_CACHE is a temporary folder (removed at the end); the
# engine environments are created (uv, from their lock files), then the shipped fixtures verified
# and copied, then the tests run; each phase is timed (.ci/test-fresh).
test-fresh: $(STAMP) chromium
	VENV=$(VENV) bash .ci/test-fresh

# Headless Chromium renders the HTML report in a test; installed from Debian's packages when
# this user may (root), else that test skips and says why.
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ; } || \
	  echo "chromium not installed: the HTML rendering test will skip"

clean-venv:
	rm -rf $(VENV)
