"""The Adapter interface: one build/export step, a source checkpoint in, what an engine loads out.

Every adapter has a name (its ``adapters.REGISTRY`` key), an ``Options`` spec (validated before
any work), the environment its tool runs in (``env_spec``: the pins a job installs, the modules
that make it preinstalled) and ``run(source, out)``, which writes its result under ``out`` and
returns a summary (duration, size, what the tool reported). A refusal or crash of the tool is an
:class:`bakeoff.api.errors.EngineFailure` with a failure class and the tool's own message.
"""

from __future__ import annotations

import abc
import shutil
from pathlib import Path
from typing import Any, Callable, ClassVar

from bakeoff.api.specs import Spec
from bakeoff.host import envs


class Adapter(abc.ABC):
    """A build/export step (see the module docstring)."""

    name: ClassVar[str] = ""
    Options: ClassVar[type[Spec]]

    def __init__(self, options: Spec | dict[str, Any] | None = None):
        self.options = options if isinstance(options, self.Options) else self.Options.model_validate(options or {})

    @classmethod
    @abc.abstractmethod
    def env_spec(cls) -> envs.EnvSpec:
        """The environment the adapter's tool runs in."""

    @classmethod
    def requirements(cls) -> list[str]:
        """The pip requirements of that environment (a job installs them in its own)."""
        return list(cls.env_spec().requirements)

    @abc.abstractmethod
    def run(self, source: str | Path, out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
        """Build from the checkpoint folder ``source`` into the folder ``out``; returns a summary.

        Raises:
            EngineFailure: the tool refused or crashed (its class and message).
        """


def copy_cached_export(output_dir: str | Path, out: Path) -> Path:
    """Copy what an export's cache entry holds (the folder above its ``output_dir``: the model folder and
    the export's metadata, as the exporting adapter caches them) into ``out``; returns that cache folder."""
    src = Path(output_dir).parent
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        (shutil.copytree if item.is_dir() else shutil.copy2)(item, out / item.name)
    return src
