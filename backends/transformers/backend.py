"""The transformers reference backend: ``generate`` in a worker process."""

from __future__ import annotations

import json
import sys
from typing import Literal

from backends._server import ChildServerBackend
from bakeoff.envs import child_env
from bakeoff.procs import free_port
from bakeoff.specs import BackendInfo, Spec


class TransformersOptions(Spec):
    """``--backend-opt`` keys of the transformers backend.

    Attributes:
        device: ``auto`` picks CUDA when present, else CPU.
        dtype: weights dtype; ``auto`` keeps the checkpoint's.
        trust_remote_code: off unless the user turns it on (recorded in the verdict).
    """

    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    trust_remote_code: bool = False


class TransformersBackend(ChildServerBackend):
    """The reference: Hugging Face transformers ``generate``, one request at a time.

    Runs in bakeoff's own environment (it already holds torch and transformers for the
    fixture builder).
    """

    name = "transformers"
    Options = TransformersOptions
    ready_mode = "file"

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        cmd = [sys.executable, "-m", "backends.transformers.worker", "--model", self.config.model,
               "--port", str(port), "--ready-file", str(self.ready_file),
               "--options", json.dumps(self.options.model_dump())]
        return cmd, child_env({"TOKENIZERS_PARALLELISM": "false"})

    def start(self) -> BackendInfo:
        port = free_port()
        startup_s = self.launch(port)
        info = self.ready_payload.get("info", {})
        self.make_client(self.config.model)
        self.info = BackendInfo(
            backend=self.name, engine="transformers", engine_version=info.get("engine_version"),
            device=info.get("device", "cpu"), max_model_len=info.get("max_model_len"),
            launch_command=self.launch_cmd, base_url=self.base_url, served_model=self.config.model,
            startup_s=round(startup_s, 2),
            notes={"dtype": str(info.get("dtype")), "torch": str(info.get("torch_version")),
                   "trust_remote_code": str(info.get("trust_remote_code")),
                   "scheduling": "one request at a time (reference, not a batching server)"},
        )
        return self.info
