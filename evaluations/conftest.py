"""bakeoff's pytest plugin: ``pytest evaluations/ --backend vllm --model fixture:tiny-qwen3``.

Options are added with ``pytest_addoption``; run state lives in ``config.stash``; every test
module is a family of checks; each check is recorded in the run's ``verdict.json`` as it
finishes, and the session end writes the final verdict. Bad input (unknown backend, malformed
``--backend-opt``, a model path that does not exist) is a ``pytest.UsageError`` (one line,
non-zero exit) raised before anything is written.
"""

from __future__ import annotations

import pytest

from evaluations import plugin, reference as _reference

pytest_addoption = plugin.pytest_addoption
pytest_configure = plugin.pytest_configure
pytest_sessionfinish = plugin.pytest_sessionfinish
pytest_collection_modifyitems = plugin.pytest_collection_modifyitems
pytest_pyfunc_call = plugin.pytest_pyfunc_call
pytest_report_header = plugin.pytest_report_header
pytest_runtest_makereport = plugin.pytest_runtest_makereport

run = plugin.run
engine = plugin.engine
engine_state = plugin.engine_state
settings = plugin.settings
reference = _reference.reference
probes = _reference.probes

__all__ = ["pytest"]
