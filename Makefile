# The two set-up commands of the README. Each creates .venv and installs what it needs.
# Engine environments (vLLM, ONNX Runtime GenAI, ...) are created by bakeoff itself on first
# use under ~/.cache/bakeoff/envs and reused.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bakeoff-installed
BACKENDS ?= transformers,vllm,ort-genai,trtllm
MODEL ?= fixture:tiny-qwen3

.PHONY: qualify test install clean-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[reference]'
	touch $(STAMP)

install: $(STAMP)

qualify: $(STAMP)
	$(VENV)/bin/bakeoff qualify --model $(MODEL) --backends $(BACKENDS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest tests/ -q -ra

clean-venv:
	rm -rf $(VENV)
