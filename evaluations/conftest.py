"""Registers bakeoff's evaluations plugin for ``pytest evaluations/ --backend vllm`` where its
pytest11 entry points are not loaded (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``, or the checkout on
``PYTHONPATH`` without an install).

The plugin's hooks and fixtures live in :mod:`evaluations.plugin` (and the reference's fixtures
in :mod:`evaluations.reference`); this conftest only registers those two modules, under the
names their entry points (and ``-p evaluations.plugin``) use, and only when no one registered
them yet: installed, they are registered once, by the entry points. pytest loads this file
before the command line is parsed (``pytest_addoption`` is a historic hook, so a plugin
registered now still adds its options).
"""

from __future__ import annotations

from evaluations import plugin, reference


def pytest_addhooks(pluginmanager) -> None:
    for module in (plugin, reference):
        if not pluginmanager.is_registered(module):
            pluginmanager.register(module, module.__name__)
