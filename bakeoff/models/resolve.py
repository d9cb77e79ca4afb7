"""Resolve what the user passed as ``--model``: ``fixture:NAME``, the name of a model a registry
package ships (``smollm2-135m-instruct``: :mod:`bakeoff.models.packaged`), a local path, or a hub id."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from bakeoff.api.errors import UserError
from bakeoff.host.artifacts import check_creatable

_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._\-]{0,94}[A-Za-z0-9])?"
HUB_ID = re.compile(rf"{_HUB_PART}/{_HUB_PART}")  # huggingface_hub's validate_repo_id, ASCII, with an org


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` is a Hub repository id ``org/name`` as the Hub accepts one: ASCII letters,
    digits, ``.``, ``_``, ``-``, each part starting and ending with a letter or digit, at most 96
    characters, no ``--`` or ``..`` (so ``org/..`` and ``a..b/..`` are not ids), not ending ``.git``."""
    return bool(HUB_ID.fullmatch(spec)) and "--" not in spec and ".." not in spec and not spec.endswith(".git")


@dataclass
class Probe:
    """A prompt with a checkable greedy continuation."""

    id: str
    task: str
    prompt: str
    expected: str
    match: str = "prefix"
    max_tokens: int | None = None  # tokens to generate (None: the character bound, evaluations/probing.py)
    # a chat probe's raw messages (``prompt`` is them rendered with a chat template): what a chat API is
    # sent, so that its server renders them once; None for a completion probe
    messages: list[dict[str, str]] | None = None


@dataclass
class ResolvedModel:
    """A model ready to hand to an engine.

    Attributes:
        label: what the user typed.
        path: local checkpoint folder, or the hub id when not local.
        local: whether ``path`` is a local folder.
        fixture: the fixture name when built by bakeoff.
        packaged: the packaged model's name when a registry package ships it
            (:mod:`bakeoff.models.packaged`); ``path`` is then its converted checkpoint.
    """

    label: str
    path: str
    local: bool
    fixture: str | None = None
    packaged: str | None = None

    def config(self) -> dict:
        """The checkpoint's ``config.json`` ({} for a hub id)."""
        if not self.local:
            return {}
        return json.loads((Path(self.path) / "config.json").read_text())

    def probes(self) -> list[Probe] | None:
        """Probes shipped with the model (``probes.jsonl``), or None."""
        if not self.local:
            return None
        path = Path(self.path) / "probes.jsonl"
        if not path.is_file():
            return None
        out = []
        for line in path.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                out.append(Probe(id=d["id"], task=d.get("task", ""), prompt=d["prompt"], expected=d["expected"],
                                 match=d.get("match", "prefix")))
        return out


def _fixture_name(spec: str) -> str:
    """``NAME`` of ``fixture:NAME``.

    Raises:
        UserError: not a fixture bakeoff knows.
    """
    # lazy: keeps this module light for its hub-id and path checks (cli.jobs, evaluations.inputs): the fixture and packaged registries cost 60 ms
    from bakeoff.models import fixtures

    name = spec.split(":", 1)[1]
    if name not in fixtures.names():
        raise UserError(f"unknown fixture {name!r}; choose one of: {', '.join('fixture:' + n for n in fixtures.names())}")
    return name


def packaged_name(spec: str) -> str | None:
    """The packaged model ``spec`` names (:func:`bakeoff.models.packaged.names`), or None; a folder
    of that name that exists here is a path instead (``./NAME`` says so plainly)."""
    # lazy: keeps this module light for its hub-id and path checks (cli.jobs, evaluations.inputs): the fixture and packaged registries cost 60 ms
    from bakeoff.models import packaged

    if packaged.get(spec) is None:
        return None
    try:
        return None if Path(spec).exists() else spec
    except OSError:
        return spec


def _packaged_names() -> list[str]:
    # lazy: keeps this module light for its hub-id and path checks (cli.jobs, evaluations.inputs): the fixture and packaged registries cost 60 ms
    from bakeoff.models import packaged

    return packaged.names()


def resolve(spec: str, build: bool = True, log=print) -> ResolvedModel:
    """Resolve ``--model``.

    Args:
        spec: ``fixture:NAME``, a packaged model's name, a path to a checkpoint folder, or a hub
            id ``org/name``.
        build: build a fixture or packaged model that is not cached yet (else raise).
        log: progress printer for fixture and packaged-model builds.

    Raises:
        UserError: unknown fixture, a fixture or packaged model to build whose cache is not
            writable (or that cannot be fetched), a path that does not exist or holds no
            ``config.json``.
    """
    name = packaged_name(spec)
    if name is not None:
        # lazy: keeps this module light for its hub-id and path checks (cli.jobs, evaluations.inputs): the fixture and packaged registries cost 60 ms
        from bakeoff.models import packaged

        if not packaged.is_built(name) and not build:
            raise UserError(f"{name} is not fetched yet; run: bakeoff qualify --model {name} (fetched on first use)")
        return ResolvedModel(label=spec, path=str(packaged.build(name, log=log)), local=True, packaged=name)
    if spec.startswith("fixture:"):
        # lazy: keeps this module light for its hub-id and path checks (cli.jobs, evaluations.inputs): the fixture and packaged registries cost 60 ms
        from bakeoff.models import fixtures

        name = _fixture_name(spec)
        if not fixtures.is_built(name):
            if not build:
                raise UserError(f"fixture {name} is not built; run: bakeoff fixture build {name}")
            check(spec)  # the cache takes the build, else one line before minutes of training
        return ResolvedModel(label=spec, path=str(fixtures.build(name, log=log)), local=True, fixture=name)
    if not spec.strip():
        raise UserError("--model is empty; pass a checkpoint folder, a hub id (org/name) or fixture:NAME")
    path = Path(spec).expanduser()
    try:
        exists = path.exists()
        if exists:
            if not path.is_dir():
                raise UserError(f"model path {spec} is a file; pass the checkpoint folder that holds config.json")
            if not (path / "config.json").is_file():
                raise UserError(f"model path {spec} has no config.json; pass a Hugging Face checkpoint folder")
            (path / "config.json").read_bytes()
    except OSError as exc:  # too long a name, no permission to read the folder or config.json
        raise UserError(f"model path {spec[:120]} cannot be read ({exc.__class__.__name__}: {exc.strerror or exc}); "
                        "pass a checkpoint folder you can read") from None
    if exists:
        # A config.json that is not JSON (or not an object) is not refused here: the engine's
        # reaction to it is evidence (load-failure with the engine's words).
        return ResolvedModel(label=spec, path=str(path.resolve()), local=True)
    if spec.startswith((".", "/", "~")) or not is_hub_id(spec):
        raise UserError(f"model path {spec} does not exist; pass a checkpoint folder, a hub id (org/name), fixture:NAME "
                        f"or a packaged model ({', '.join(_packaged_names())})")
    return ResolvedModel(label=spec, path=spec, local=False)


def check(spec: str) -> None:
    """Everything :func:`resolve` would refuse in ``spec``, without building or writing anything.

    A ``fixture:NAME`` must name a known fixture and, when it is not built yet, the fixture
    cache must be writable (a real probe, made and removed); a path or hub id is checked as
    :func:`resolve` does. Call it for every model of a command before the first build, then
    :func:`resolve` to build.

    Raises:
        UserError: an unknown fixture, an unwritable cache for a fixture to build, a path that
            is not a readable checkpoint folder.
    """
    name = packaged_name(spec)
    if name is not None:
        # lazy: keeps this module light for its hub-id and path checks (cli.jobs, evaluations.inputs): the fixture and packaged registries cost 60 ms
        from bakeoff.models import packaged

        packaged.check(name)
        return
    if not spec.startswith("fixture:"):
        resolve(spec, build=False)  # no side effects for paths and hub ids
        return
    # lazy: keeps this module light for its hub-id and path checks (cli.jobs, evaluations.inputs): the fixture and packaged registries cost 60 ms
    from bakeoff.models import fixtures
    name = _fixture_name(spec)
    if not fixtures.is_built(name):  # is_built refuses a BAKEOFF_CACHE that is a file
        check_creatable(fixtures.cache_root(), "fixture cache",
                        f"fixture {name} is not built yet and is built there: point BAKEOFF_CACHE at a writable folder")


QUANTIZATION_RECORD = "bakeoff-quantization.json"  # written by adapters.awq_int4 and adapters.trtllm_build


def default_reference(model: ResolvedModel) -> tuple[ResolvedModel, str]:
    """The model the transformers reference runs when ``--reference-model`` is not given.

    A checkpoint that ``bakeoff quantize`` wrote records its unquantized source in
    ``bakeoff-quantization.json``; the reference is that source (bf16), so a W4A16 checkpoint is
    compared with the model it came from, as the INT4 tolerance rule intends. Any other model
    is its own reference.

    Returns:
        ``(reference, reason)``: the model and one line saying why it was chosen.
    """
    record = Path(model.path) / QUANTIZATION_RECORD if model.local else None
    if record is not None and record.is_file():
        try:
            source = json.loads(record.read_text()).get("source")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            source = None
        if source:
            try:
                return resolve(str(source), build=False), f"the unquantized source named in {QUANTIZATION_RECORD}"
            except UserError:
                return model, f"{QUANTIZATION_RECORD} names source {source}, which is not here: the model is its own reference"
    return model, "the model under test"
