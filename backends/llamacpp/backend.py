"""llama.cpp backend: llama.cpp's own ``llama-server`` serving a GGUF file (``xllamacpp``).

``start()`` builds the ``llamacpp`` environment (:mod:`backends.llamacpp.env`, one prebuilt
wheel), finds the GGUF (:func:`find_gguf`) or, where the checkpoint has none, converts it with
llama.cpp's own converter (:mod:`adapters.gguf_convert`, cached; its refusal is the verdict's
evidence), launches :mod:`backends.llamacpp.worker`, and speaks the OpenAI completions API to
the server. ``--model`` stays the Hugging Face checkpoint the reference runs (and the client's
tokenizer); the engine serves the GGUF, named in the run's notes with its sha256 prefix.

Configuration (the run's notes say each): parallel slots with continuous batching
(``parallel_slots``, default 32, the full profile's largest sweep point) sharing one unified KV
cache of ``ctx_size`` tokens (``--kv-unified``: every slot may use the whole context, the cells
are shared), prompt caching on (llama-server's default), threads bakeoff's CPU default (the
usable CPUs less one, :func:`backends._hosting.threads.default_threads`), sampling defaults made
neutral (:mod:`backends.llamacpp.worker`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from adapters.gguf_convert import GgufOptions, GgufResult, convert

from backends._hosting.threads import option_or_default
from backends._server import ChildServerBackend
from backends.llamacpp.env import env_spec
from backends.llamacpp.preflight import rule as preflight_rule
from backends.llamacpp.tokenize import server_tokenize_llamacpp
from bakeoff.api.errors import EngineFailure
from bakeoff.api.specs import BackendInfo
from bakeoff.host import envs
from bakeoff.host.hashing import sha256_file
from bakeoff.loadgen.client import NEUTRAL_LLAMACPP

class LlamaCppOptions(BaseModel):
    """``--backend-opt`` keys of the llamacpp backend.

    Attributes:
        gguf: the GGUF file to serve; unset: the one GGUF in the model folder, or the one a
            packaged model (``--model smollm2-135m-instruct``) keeps beside its checkpoint, or,
            where there is none, the checkpoint converted by llama.cpp's converter.
        convert_outtype: convert the checkpoint with llama.cpp's converter at this ``--outtype``
            even where a GGUF is found; unset: only where none is, at ``q8_0``
            (:class:`adapters.gguf_convert.GgufOptions`).
        convert_timeout_s: the converter's deadline in seconds.
        parallel_slots: llama-server's ``--parallel``: requests decoded together (continuous
            batching); a request beyond them waits for a slot.
        ctx_size: llama-server's ``--ctx-size``: KV cache cells in tokens, shared by the slots
            (``kv_unified``); each slot is still capped at the model's trained context.
        kv_unified: one KV cache for all slots (llama-server's ``--kv-unified``); False splits
            ``ctx_size`` evenly among the slots.
        cache_prompt: reuse a slot's cached prompt prefix (llama-server's default).
        threads: ``--threads`` and ``--threads-batch``; unset: bakeoff's CPU default.
        batch_size: ``--batch-size`` (logical batch of a prefill), llama.cpp's default 2048.
        ubatch_size: ``--ubatch-size`` (physical batch), llama.cpp's default 512.
        draft_gguf: a draft model for speculative decoding (llama-server's ``--model-draft``), or ``self``:
            the served GGUF as its own draft (every drafted token should be accepted: the check's floor).
        draft_max: tokens drafted per step (``--draft-max``); unset: llama.cpp's default (3 in the
            pinned build).
    """

    model_config = ConfigDict(extra="forbid")

    gguf: str | None = None
    convert_outtype: Literal["q8_0", "f16", "bf16", "f32", "auto"] | None = None
    convert_timeout_s: float = Field(3600.0, gt=0)
    parallel_slots: int = Field(32, ge=1, le=256)
    ctx_size: int = Field(32768, ge=256)
    kv_unified: bool = True
    cache_prompt: bool = True
    threads: int | None = Field(None, ge=1)
    batch_size: int = Field(2048, ge=32)
    ubatch_size: int = Field(512, ge=32)
    draft_gguf: str | None = None
    draft_max: int | None = Field(None, ge=1, le=64)

    @field_validator("draft_gguf")
    @classmethod
    def _draft_is_a_file(cls, v: str | None) -> str | None:
        """A draft the user names must be a file now (or ``self``), as ``gguf`` must."""
        if v is not None and v != "self" and not Path(v).expanduser().is_file():
            raise ValueError(f"draft_gguf={v!r} is not a file; pass the path of a .gguf file, or self for the served GGUF")
        return v

    @field_validator("gguf")
    @classmethod
    def _gguf_is_a_file(cls, v: str | None) -> str | None:
        """A GGUF path the user names must be a file now: a typo is the user's to fix (one line, exit
        2), not a run that ends ``unavailable`` (found by a new user's walk-through)."""
        if v is not None and not Path(v).expanduser().is_file():
            raise ValueError(f"gguf={v!r} is not a file; pass the path of a .gguf file, or leave gguf out to "
                             "serve the model folder's GGUF (or convert the checkpoint)")
        return v


def find_gguf(model: str, given: str | None) -> Path:
    """The GGUF file to serve (:class:`LlamaCppOptions` ``gguf``).

    Raises:
        EngineFailure: ``unavailable`` when there is none or several, saying what to pass
            (:meth:`LlamaCppBackend.prepare` converts the checkpoint where there is none).
    """
    if given:
        p = Path(given).expanduser()
        if not p.is_file():
            raise EngineFailure("unavailable", f"llamacpp: gguf={given!r} is not a file")
        return p
    folder = Path(model)
    if not folder.is_dir():
        raise EngineFailure("unavailable", f"llamacpp serves a local GGUF; {model!r} is not a folder: "
                                           "pass --backend-opt gguf=FILE")
    found = sorted(folder.glob("*.gguf"))
    if not found and (folder.parent / "packaged.json").is_file():  # a packaged model keeps its GGUF beside hf/
        found = sorted((folder.parent / "gguf").glob("*.gguf"))
    if len(found) != 1:
        what = "no GGUF file" if not found else f"{len(found)} GGUF files ({', '.join(p.name for p in found)})"
        raise EngineFailure("unavailable", f"llamacpp: {what} in {folder}; pass --backend-opt gguf=FILE "
                                           "(a GGUF of this checkpoint)")
    return found[0]


class LlamaCppBackend(ChildServerBackend):
    """llama.cpp's server on a GGUF file (module docstring)."""

    preflight_rule = staticmethod(preflight_rule)

    name = "llamacpp"
    Options = LlamaCppOptions
    ready_mode = "file"

    # the converter's environment (adapters.gguf_convert) is made when a conversion first needs it,
    # not beside every run: a GGUF given or found needs none
    engine_env = staticmethod(env_spec)

    def __init__(self, config):
        super().__init__(config)
        self.gguf: Path | None = None
        self.converted: GgufResult | None = None

    def prepare(self) -> None:
        """The environment, then the GGUF: the one given or found, else the checkpoint converted."""
        self.env_python = envs.ensure(env_spec(), self._log)
        outtype = self.options.convert_outtype
        if outtype is None or self.options.gguf:
            try:
                self.gguf = find_gguf(self.config.model, self.options.gguf)
                return
            except EngineFailure as exc:
                if self.options.gguf or "no GGUF file" not in exc.message or \
                        not (Path(self.config.model) / "config.json").is_file():
                    raise
        if not Path(self.config.model).is_dir():
            raise EngineFailure("unavailable", f"llamacpp converts local checkpoint folders; {self.config.model!r} is "
                                "not one (no hub access here): pass --backend-opt gguf=FILE")
        self.converted = convert(self.config.model, GgufOptions(outtype=outtype or "q8_0"), log=self._log,
                                 timeout_s=self.options.convert_timeout_s)
        self.gguf = Path(self.converted.gguf)

    def threads(self) -> tuple[int, str]:
        return option_or_default(self.options.threads, "threads")

    def worker_options(self) -> dict[str, Any]:
        """What the worker's ``configure`` reads (:mod:`backends.llamacpp.worker`; the bare loop of
        ``benchmarks/bench_fidelity.py`` reads the same)."""
        draft = self.options.draft_gguf
        return {**self.options.model_dump(exclude={"gguf", "threads", "convert_outtype", "convert_timeout_s", "draft_gguf"}),
                "threads": self.threads()[0],
                "draft_gguf": str(self.gguf) if draft == "self" else (str(Path(draft).expanduser()) if draft else None)}

    def speculation(self) -> dict[str, Any] | None:
        """``draft_gguf`` as :meth:`backends.base.Backend.speculation` states it (llama.cpp's draft model)."""
        draft = self.options.draft_gguf
        if not draft:
            return None
        path = self.gguf if draft == "self" else Path(draft).expanduser()
        same = draft == "self" or (self.gguf is not None and path is not None and path.resolve() == self.gguf.resolve())
        return {"method": "draft_model", "draft": str(path) if path else draft, "self_draft": same}

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        assert self.env_python is not None and self.gguf is not None
        opts = self.worker_options()
        cmd = [str(self.env_python), "-m", "backends.llamacpp.worker", "--gguf", str(self.gguf), "--port", str(port),
               "--ready-file", str(self.ready_file), "--options", json.dumps(opts)]
        return cmd, envs.child_env({})

    def served_model(self) -> str:
        return self.config.model

    def extra_body(self) -> dict[str, Any]:
        # the prompt cache is the server's; sent so that a request says what the run's notes say
        return {"cache_prompt": self.options.cache_prompt}

    def greedy_body(self) -> dict[str, Any]:
        return dict(NEUTRAL_LLAMACPP)  # the server's defaults are neutral too (worker.py NEUTRAL_SAMPLING)

    def tokenize(self, texts: list[str], chat: bool = False) -> list[list[int]] | None:
        """llama-server's own ids: ``/tokenize`` in its shape (``content``, ``add_special``), chat
        prompts rendered first by its ``/apply-template`` (the template it serves)."""
        ids, self.tokenize_note = server_tokenize_llamacpp(self.base_url, texts, chat=chat)
        return ids

    def describe(self, startup_s: float) -> BackendInfo:
        info = self.ready_payload.get("info", {})
        opts = info.get("options", {})
        slots, n_ctx_slot = info.get("total_slots"), info.get("n_ctx_slot")
        threads, why = self.threads()
        sha = self.converted.gguf_sha256[:16] if self.converted else sha256_file(self.gguf)[:16]
        notes = {"gguf": f"{self.gguf} (sha256 {sha}...)", **(self.converted.notes() if self.converted else {}),
                 "environment": envs.describe(self.env_python), "build": str(info.get("build_info")),
                 "system_info": str(info.get("system_info")),
                 "parallel_slots": f"{slots} (continuous batching; parallel_slots option, default 32)",
                 "kv_cache": (f"{opts.get('ctx_size')} tokens {'shared by all slots (kv_unified)' if opts.get('kv_unified') else 'split among the slots'}"
                              f", {n_ctx_slot} per slot at most"),
                 "kv_cache_tokens": str(opts.get("ctx_size")),
                 "threads": f"{threads} ({why})",
                 "prompt_cache": "on" if opts.get("cache_prompt") else "off",
                 **({"speculative_decoding": f"draft model {opts['draft_gguf']} ({opts.get('draft_max') or 'default'} "
                                             "tokens a step); llama-server streams real logprobs for the first token "
                                             "only while drafting"} if opts.get("draft_gguf") else {}),
                 "sampling": "neutral server defaults (top_k 0, top_p 1, min_p 0, no penalties): "
                             "llama-server's own (top_k 40, top_p 0.95, min_p 0.05) would apply to fields a "
                             "request leaves out"}
        return BackendInfo(
            backend=self.name, engine="llama.cpp", engine_version=info.get("engine_version"), device="cpu",
            launch_command=self.launch_cmd, base_url=self.base_url, served_model=self.config.model,
            startup_s=startup_s, concurrent_requests=slots, notes=notes,
            kv_cache_tokens=opts.get("ctx_size"), max_model_len=n_ctx_slot,
            # the unified cache holds this many requests at the longest context a slot may use
            max_concurrency=round(opts["ctx_size"] / n_ctx_slot, 2) if opts.get("ctx_size") and n_ctx_slot else None)
