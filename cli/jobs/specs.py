"""Pydantic specs of a bakeoff job: what runs (the task) and how it is submitted (the request).

No engine import, no network, no side effects in validators (docs/design.md "Style").
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from bakeoff.api.errors import UserError

import adapters
from bakeoff.models.resolve import is_hub_id

PIPELINES = tuple(adapters.names())  # the adapters registry: a job exports with any of them
TIMEOUT = re.compile(r"^\d+(\.\d+)?[smhd]?$")
# Secret-looking names must travel as secrets, never in the job's plain environment.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PYTHON_REQUEST = re.compile(r"[A-Za-z0-9][A-Za-z0-9@.+_\-]{0,63}")  # uv run --python: 3.12, cpython@3.12, pypy3.10
IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-/:@]{0,255}")  # [registry/]name[:tag][@digest]
SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|APIKEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL)", re.I)


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PushTarget(_Spec):
    """Where a job's output goes.

    Attributes:
        kind: ``hub`` (a Hub repository), ``file`` (a local folder, tests and local runs), ``none``.
        repo_id: ``org/name`` for ``hub``.
        repo_type: ``model`` or ``dataset`` for ``hub``.
        folder: the folder for ``file``.
    """

    kind: Literal["hub", "file", "none"]
    repo_id: str | None = None
    repo_type: Literal["model", "dataset"] = "model"
    folder: str | None = None

    @classmethod
    def parse(cls, text: str) -> "PushTarget":
        """``none`` | ``file:///abs/path`` | ``org/name`` | ``datasets/org/name``.

        Raises:
            UserError: anything else.
        """
        text = text.strip()
        if text == "none":
            return cls(kind="none")
        if text.startswith("file://"):
            folder = text[len("file://"):]
            if not folder.startswith("/"):
                raise UserError(f"--push-to {text}: a file target needs an absolute path (file:///abs/folder)")
            return cls(kind="file", folder=folder)
        repo_type = "model"
        for prefix, kind in (("datasets/", "dataset"), ("models/", "model")):
            if text.startswith(prefix):
                text, repo_type = text[len(prefix):], kind
        if not is_hub_id(text):
            raise UserError(f"--push-to {text!r}: name a Hub repository (org/name or datasets/org/name), "
                            "a local folder file:///abs/path, or none")
        return cls(kind="hub", repo_id=text, repo_type=repo_type)

    def label(self) -> str:
        """Human form, the inverse of :meth:`parse`."""
        if self.kind == "none":
            return "none"
        if self.kind == "file":
            return f"file://{self.folder}"
        return ("datasets/" if self.repo_type == "dataset" else "") + str(self.repo_id)


class ExportTask(_Spec):
    """One adapter pipeline run inside the job.

    Attributes:
        pipeline: an adapter's name (``adapters.REGISTRY``: ``ort-genai`` INT4/QMoE export,
            ``awq-int4`` llm-compressor W4A16).
        options: that adapter's ``Options`` fields.
    """

    pipeline: str
    options: dict[str, object] = Field(default_factory=dict)

    @field_validator("pipeline")
    @classmethod
    def _registered(cls, v: str) -> str:
        if v not in PIPELINES:
            raise ValueError(f"unknown pipeline {v!r}; choose one of: {', '.join(PIPELINES)}")
        return v


class QualifyTask(_Spec):
    """One ``bakeoff qualify`` inside the job.

    Attributes:
        backends: backend names.
        profile: ``quick`` | ``full``.
        backend_opts: ``[BACKEND:]KEY=VALUE`` items, passed as ``--backend-opt``.
        reference_model: optional ``--reference-model``.
    """

    backends: list[str]
    profile: Literal["quick", "full"] = "quick"
    backend_opts: list[str] = Field(default_factory=list)
    reference_model: str | None = None


class JobTask(_Spec):
    """Everything the rendered script needs to do its work (embedded in it as JSON).

    Attributes:
        kind: ``export`` or ``qualify``.
        tag: unique id of this submission (also a job label); names the output folder.
        model: ``fixture:NAME``, a Hub id, or a path that exists where the script runs.
        export: the pipeline for ``export`` jobs.
        qualify: the run for ``qualify`` jobs.
        push_to: where the output goes.
        path_in_repo: folder inside the target (``""``: its root).
        flavor: the hardware flavor the job was submitted on (``local`` for ``uv run`` here).
    """

    kind: Literal["export", "qualify"]
    tag: str
    model: str
    export: ExportTask | None = None
    qualify: QualifyTask | None = None
    push_to: PushTarget
    path_in_repo: str = ""
    flavor: str = "local"


class JobRequest(_Spec):
    """How a rendered script is submitted (``huggingface_hub.run_uv_job`` arguments).

    Attributes:
        flavor: hardware flavor (``cpu-xl``, ``l40sx1``, ...).
        timeout: job timeout (``30m``, ``2h``, seconds as digits).
        secrets: NAMES of secrets; values are read at submission (local env or login) and
            never written anywhere.
        env: plain environment variables of the job (no secret-looking names).
        image: Docker image with ``uv`` (None: huggingface_hub's default uv image).
        python: Python version for ``uv run --python`` inside the job.
        namespace: user or org that owns the job (None: the token's user).
        labels: job labels.
        name: job name.
    """

    flavor: str = "cpu-basic"
    timeout: str = "30m"
    secrets: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    image: str | None = None
    python: str | None = None
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    name: str | None = None

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, v: str) -> str:
        if not TIMEOUT.fullmatch(v):
            raise ValueError(f"timeout {v!r}: use digits with an optional unit s, m, h or d (e.g. 30m, 2h)")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [k for k in v if SECRET_NAME.search(k)]
        if bad:
            raise ValueError(f"--env {', '.join(bad)} looks secret: pass it as --secret NAME instead")
        for k, val in v.items():
            if not ENV_NAME.fullmatch(k):
                raise ValueError(f"--env {k!r}: an environment variable name is letters, digits and _ (e.g. MY_FLAG=1)")
            if "\0" in val:
                raise ValueError(f"--env {k}: a value cannot hold a NUL character")
        return v

    @field_validator("secrets")
    @classmethod
    def _secrets(cls, v: list[str]) -> list[str]:
        for k in v:
            if not ENV_NAME.fullmatch(k):
                raise ValueError(f"--secret {k!r}: name an environment variable (letters, digits and _, e.g. HF_TOKEN)")
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not (k + val).isprintable() or not k.strip():
                raise ValueError(f"--label {k!r}={val!r}: a label is one printable line, KEY=VALUE with a KEY")
        return v

    @field_validator("python")
    @classmethod
    def _python(cls, v: str | None) -> str | None:
        if v is not None and not PYTHON_REQUEST.fullmatch(v):
            raise ValueError(f"--python {v!r}: pass a Python version such as 3.12 (or cpython@3.12)")
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        if v is not None and not IMAGE.fullmatch(v):
            raise ValueError(f"--image {v!r}: pass a Docker image reference such as ghcr.io/astral-sh/uv:python3.12-bookworm")
        return v


class JobRecord(_Spec):
    """What bakeoff keeps locally about a submitted job (``artifacts/jobs/<id>.json``).

    Attributes:
        job_id: the Hub's job id.
        url: the job's page.
        kind: ``export`` or ``qualify``.
        tag: the submission tag (label ``bakeoff-tag``).
        flavor: hardware flavor.
        namespace: owner of the job.
        endpoint: the Hub endpoint it was submitted to.
        push_to: the output target (label form).
        path_in_repo: folder inside the target.
        submitted_at: UTC time, ISO 8601.
        secrets: secret NAMES sent.
    """

    job_id: str
    url: str
    kind: str
    tag: str
    flavor: str
    namespace: str
    endpoint: str
    push_to: str
    path_in_repo: str = ""
    submitted_at: str
    secrets: list[str] = Field(default_factory=list)
