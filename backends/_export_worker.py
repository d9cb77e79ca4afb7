"""Backends that serve an export through one of bakeoff's workers (ORT GenAI, optimum-ort, OpenVINO).

The sequence each of them runs, written once: :meth:`ExportWorkerBackend.prepare` makes the
engine's environment and the export (cached by its adapter: ``export(model, options, log=,
timeout_s=, use_cache=)``, :meth:`ChildServerBackend.prepare_export`), and
:meth:`ExportWorkerBackend.command` starts the backend's worker module on the export's folder
with the options :meth:`ExportWorkerBackend.engine_options` gives. A backend names its adapter's
``export`` and its worker module, and says what its worker gets and what it reported.
"""

from __future__ import annotations

import json
from typing import Any, Callable, ClassVar

from backends._server import ChildServerBackend
from bakeoff.host import envs


class ExportWorkerBackend(ChildServerBackend):
    """An adapter's export served by a bakeoff worker (module docstring).

    Subclasses set :attr:`export_fn` (``staticmethod(export)`` of their adapter) and
    :attr:`worker_module`, implement :meth:`engine_options` and :meth:`describe`; their options
    model has ``export_options()``, ``export_timeout_s`` and ``reuse_export``.
    """

    ready_mode = "file"
    log_name = "export.log"
    bakeoff_worker = True
    export_fn: ClassVar[Callable[..., Any]]
    worker_module: ClassVar[str]

    def __init__(self, config):
        super().__init__(config)
        self.export_result: Any = None

    def prepare(self) -> None:
        """The environment, then the export (cached) the worker serves."""
        self.prepare_export(type(self).export_fn, self.options.export_options(), self.options.export_timeout_s,
                            self.options.reuse_export)

    def engine_options(self) -> dict[str, Any]:
        """What the worker's engine process gets (``--options``, JSON)."""
        raise NotImplementedError

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        assert self.export_result is not None and self.env_python is not None
        cmd = [str(self.env_python), "-m", self.worker_module, "--model", self.export_result.output_dir,
               "--port", str(port), "--ready-file", str(self.ready_file), "--served-model", self.config.model,
               "--options", json.dumps(self.engine_options())]
        return cmd, envs.child_env({"TOKENIZERS_PARALLELISM": "false"}, huge_pages=self.huge_pages)
