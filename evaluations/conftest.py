"""Registers bakeoff's evaluations plugin for ``pytest evaluations/ --backend vllm``.

The plugin's hooks and fixtures live in :mod:`evaluations.plugin` (and the reference's fixtures
in :mod:`evaluations.reference`); this conftest only registers those two modules, once, when
pytest loads it (before the command line is parsed: ``pytest_addoption`` is a historic hook, so
a plugin registered now still adds its options).
"""

from __future__ import annotations

from evaluations import plugin, reference


def pytest_addhooks(pluginmanager) -> None:
    for module in (plugin, reference):
        if not pluginmanager.is_registered(module):
            pluginmanager.register(module, f"bakeoff-{module.__name__}")
