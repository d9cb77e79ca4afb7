"""Imports sit at the top of the module, unless there is a reason (issue 40).

Every ``import`` / ``from ... import`` statement inside a function (``def`` / ``async def``, at
any depth) of ``bakeoff/``, ``backends/``, ``adapters/``, ``evaluations/`` and ``cli/`` must
have a reason, one of:

* its top-level module is in :data:`LAZY_MODULES`: heavy to import, or optional (absent from
  bakeoff's own dependencies, or from the engine environments the code runs in); each entry says
  which, measured with ``python -X importtime -c "import X"`` (cumulative, this venv);
* the statement's first line, or the comment line directly above it (or above the run of
  consecutive import lines it belongs to), carries a comment starting ``# lazy:`` with the
  reason: an import cycle, an upward import (``tests/test_layers.py``), code that runs inside
  engine environments, a test that patches the name, ``bakeoff --help`` kept fast, ...

Anything else moves to the top of its module. :data:`PENDING` lists files being refactored
elsewhere at the time, with how many offenders each may still hold; it only shrinks (empty since
2026-12-06).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("bakeoff", "backends", "adapters", "evaluations", "cli")
MARK = "# lazy:"

# top-level module: why importing it inside a function is right (times: cumulative, this venv)
LAZY_MODULES = {
    # heavy
    "torch": "heavy: 1.1 s to import; optional: only in the `reference` extra and the engine environments",
    "transformers": "heavy: 0.8 s to import (torch on first model use); optional: `reference` extra and engine environments",
    "accelerate": "heavy: 1.3 s to import (torch); optional: the `reference` extra only",
    "compressed_tensors": "heavy: 3.6 s to import (torch, transformers); optional: the `reference` extra and llm-compressor's environment",
    "matplotlib": "heavy: 0.24 s to import; only the comparison's plots need it",
    "gguf": "heavy: 0.16 s to import (numpy, yaml); optional: the `reference` extra and the gguf-convert environment",
    "aiohttp": "heavy: 0.15 s to import; the engine workers' server needs it, the engines' own clients do not",
    "httpx": "heavy: 0.12 s to import; only the judge's and the openai backend's HTTP calls need it",
    "numpy": "heavy: 0.11 s to import; kept out of `bakeoff --help`, the pytest plugin's start and light engine modules",
    "prometheus_client": "heavy: 50 ms to import; only reading an engine's /metrics needs its parser",
    "rich": "heavy: 30-45 ms to import (rich.console, rich.table, rich.live); keeps `bakeoff --help` and bad-input answers fast",
    "jinja2": "heavy: 37 ms to import; only the chat-template probes need it",
    # optional: not installed everywhere the code runs
    "tokenizers": "optional: the `reference` extra and the engine environments, not bakeoff's own dependencies",
    "safetensors": "optional: the `reference` extra and the engine environments, not bakeoff's own dependencies",
    "psutil": "optional: absent from the ort-genai, optimum-onnx, llama.cpp and gguf-convert environments, "
              "where engine-side modules run",
    "pynvml": "optional: nvidia-ml-py is absent from the engine environments (but llm-compressor's); 18 ms",
    "uvloop": "optional: not on Windows (pyproject.toml's marker); 58 ms to import",
    "huggingface_hub": "heavy: HfApi 0.2 s, snapshot_download 0.3 s to import (the package itself loads its parts lazily)",
    "uv": "optional: bakeoff.host.locks.uv_bin falls back to a `uv` on PATH when the package is not importable",
    "packaging": "optional: not a declared dependency of bakeoff (it comes with pytest)",
    "yaml": "optional: PyYAML is no dependency of bakeoff; only in TensorRT-LLM's environment",
    "datasets": "optional: only in the llm-compressor environment",
    "onnx": "optional: only in the ONNX export environments",
    "onnxruntime": "optional: only in the ONNX Runtime environments (ort-genai, optimum-onnx)",
    "onnxruntime_genai": "optional: only in the ort-genai environment",
    "openvino": "optional: only in the OpenVINO environment",
    "openvino_genai": "optional: only in the OpenVINO environment",
    "optimum": "optional: only in the optimum-onnx environment",
    "vllm": "optional: only in the vLLM environments",
    "tensorrt_llm": "optional: only in the TensorRT-LLM environment",
    "llmcompressor": "optional: only in the llm-compressor environment",
    "modelopt": "optional: only in the TensorRT-LLM (ModelOpt) environment",
    "xllamacpp": "optional: only in the llama.cpp environment",
}

# file: offenders it may still hold (someone else is refactoring these files now; issue 40)
PENDING: dict[str, int] = {}


def _top(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The top-level modules a statement imports (a relative import names none of LAZY_MODULES)."""
    if isinstance(node, ast.Import):
        return [a.name.split(".")[0] for a in node.names]
    if node.level:
        return ["." * node.level + (node.module or "")]
    return [(node.module or "").split(".")[0]]


def _said_why(lines: list[str], lineno: int) -> bool:
    """``# lazy:`` on the statement's first line, or on the comment line directly above it or above
    the run of consecutive import lines it belongs to (``lineno`` counts from 1)."""
    if MARK in lines[lineno - 1]:
        return True
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith(("import ", "from ")):
        i -= 1
    return i >= 0 and lines[i].strip().startswith(MARK)


def offenders(path: Path) -> list[tuple[int, str]]:
    """``(line, imported module)`` for each function-level import in ``path`` without a reason."""
    source = path.read_text()
    lines = source.splitlines()
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                tops = _top(child)
                if not all(t in LAZY_MODULES for t in tops) and not _said_why(lines, child.lineno):
                    names = [a.name for a in child.names] if isinstance(child, ast.Import) else \
                        ["." * child.level + (child.module or "")]
                    out.append((child.lineno, ", ".join(names)))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(source), False)
    return out


FILES = sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def test_function_level_imports_say_why():
    bad, over, paid = [], {}, []
    for p in FILES:
        rel = str(p.relative_to(REPO))
        found = offenders(p)
        if rel in PENDING:
            if len(found) > PENDING[rel]:
                over[rel] = (PENDING[rel], len(found))
            elif not found:
                paid.append(rel)
            continue
        bad += [f"{rel}:{line}: import {name} (move it to the top of the module, or say why with {MARK})"
                for line, name in found]
    print("\n".join(bad))
    assert not bad, f"{len(bad)} function-level imports without a reason:\n" + "\n".join(bad)
    assert not over, f"PENDING files gained function-level imports (allowed, now): {over}"
    assert not paid, f"no function-level import left without a reason: remove from PENDING: {paid}"


def test_lazy_modules_and_pending_name_real_things():
    assert all(r.startswith(("heavy:", "optional:")) for r in LAZY_MODULES.values()), "say heavy: or optional:"
    assert all((REPO / f).is_file() for f in PENDING), [f for f in PENDING if not (REPO / f).is_file()]


def test_the_checker_sees_a_bare_function_level_import(tmp_path):
    """The rule is not vacuous: a bare import in a function (any depth) is caught; one with a
    ``# lazy:`` reason (same line, line above, above its run), one of LAZY_MODULES, and any at
    module level are not."""
    src = tmp_path / "planted.py"
    src.write_text(
        "import json\n"                                   # 1 module level: fine
        "def f():\n"
        "    import os\n"                                 # 3 bare: caught
        "    from bakeoff.api import errors\n"            # 4 bare: caught
        "    import re  # lazy: a reason\n"               # 5
        "    # lazy: a cycle with x\n"
        "    from bakeoff.host import envs\n"             # 7
        "    from bakeoff.host import procs\n"            # 8 same run as 7: covered
        "    import torch\n"                              # 9 LAZY_MODULES
        "    from transformers import AutoTokenizer\n"    # 10 LAZY_MODULES
        "    x = 1\n"
        "    import math\n"                               # 12 run broken by code: caught
        "    import numpy, shutil\n"                      # 13 one name not lazy: caught
        "class C:\n"
        "    import abc\n"                                # 15 class body, not a function: fine
        "    async def g(self):\n"
        "        def h():\n"
        "            from . import sibling\n"             # 18 nested, relative: caught
    )
    assert offenders(src) == [(3, "os"), (4, "bakeoff.api"), (12, "math"), (13, "numpy, shutil"), (18, ".")]
