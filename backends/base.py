"""The Backend interface (docs/design.md "Core contracts").

Four methods, in the spirit of lm-eval's ``LM`` and guidellm's start/validate/shutdown:
- ``start() -> BackendInfo``: load or launch the engine in a child process (``probe()`` first,
  optional: a cheap check that there is something to start, run before any reference work).
- ``stream(request) -> AsyncIterator[TokenEvent]``: one generation.
- ``metrics() -> dict``: engine-side counters, where the engine exposes them.
- ``stop()``: always safe, also after a crash; leaves no process behind.

and one optional method, ``tokenize(texts, chat=False)``: the engine's own token ids for
prompts, as it would feed them to the model (None when the engine cannot say).

Every failure an engine can have is raised as :class:`bakeoff.api.errors.EngineFailure` with a
failure class and evidence, so the evaluations turn it into a failed check.
"""

from __future__ import annotations

import abc
from typing import Any, AsyncIterator, ClassVar

from pydantic import BaseModel

from bakeoff.api.specs import BackendConfig, BackendInfo, GenerationRequest, TokenEvent
from backends._tokenize import server_tokenize
from bakeoff.api.options import parse_options


class Backend(abc.ABC):
    """One engine serving one model.

    Subclasses set ``name`` (the registry key) and ``Options`` (a pydantic model with
    ``extra="forbid"`` describing the ``--backend-opt`` keys they accept).

    Args:
        config: backend name, model, options, work folder, deadlines.

    Raises:
        UserError: from ``__init__`` when an option is unknown or has a bad value.
    """

    name: ClassVar[str] = ""
    # True once bakeoff itself launched the engine's server on 127.0.0.1 (no network hop can sit
    # between it and the client: throughput.transport then blames bursts on the engine or host)
    serves_on_loopback: bool = False
    Options: ClassVar[type[BaseModel]]
    # What evaluations read from any backend (declared here, never looked up with getattr):
    # the API its client speaks ("completions", "chat", "messages"); the interpreter of its
    # environment (its packages go into the fingerprint; None: this interpreter); the process
    # group it started (for py-spy stacks on a hang; None: nothing launched); its own output
    # token counter (the openai backend's ``tokenizer=``; None: the suite picks one).
    api: str = "completions"
    # the engine's pre-flight rule (its folder's preflight.py; bakeoff/analysis/preflight.py Rule)
    preflight_rule: ClassVar[Any] = None
    # its rule on the checkpoint's tensors against its quantization config (e.g. vLLM's MTP head check;
    # bakeoff/analysis/checkpoint_layout.py): (model_path, quantization, options) -> finding | None
    preflight_checkpoint_rule: ClassVar[Any] = None
    env_python: Any = None
    proc: Any = None
    count_tokens: Any = None
    # True: start() attaches to a server it does not launch (openai). Nothing of bakeoff's takes
    # the device then, so the transformers reference need not run before the start, alone: it
    # is computed when a check first asks for it (evaluations/plugin.py engine_state).
    attaches: ClassVar[bool] = False
    # True: the HTTP server in front of the engine is bakeoff's own worker, the leader of ``proc``'s group
    # (its CPU per token is bakeoff's serving path, not the engine's: bakeoff/loadgen/serving_cpu.py)
    bakeoff_worker: ClassVar[bool] = False
    # True: its server takes a request's ``cache_salt`` (vLLM: a prefix-cache namespace), so the same prompt
    # can be served cold again after it was cached (prefix_cache.correctness's "cold again")
    cache_salt: ClassVar[bool] = False

    @classmethod
    def env_specs(cls) -> list:
        """The engine environments (``bakeoff.host.envs.EnvSpec``) ``start()`` will need on this host,
        so that ``bakeoff qualify`` can create them while the fixture trains; [] for none (the
        reference runs in bakeoff's own environment, an ``openai`` server needs none, an engine
        that cannot run here creates none)."""
        return []

    def __init__(self, config: BackendConfig):
        self.config = config
        self.options = parse_options(self.name, self.Options, config.options)
        self.info: BackendInfo | None = None

    def probe(self) -> None:
        """A cheap check, before any reference work, that ``start()`` has something to start:
        the evaluations call it first, so that a server that is not there (the ``openai``
        backend's dead port) is told in seconds, not after minutes of reference outputs.
        Default: nothing (a backend that launches its engine learns by launching it).

        Raises:
            EngineFailure: as :meth:`start` would for the same cause.
        """

    @abc.abstractmethod
    def start(self) -> BackendInfo:
        """Load or launch the engine; blocks until it serves or fails.

        Returns:
            What the engine reported (versions, KV capacity, launch command).

        Raises:
            EngineFailure: ``unavailable``, ``load-failure``, ``config-rejected``,
                ``unsupported-architecture``, ``hang`` (start deadline) ...
        """

    @abc.abstractmethod
    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Stream one generation; events are timestamped as their bytes arrive.

        Raises:
            EngineFailure: ``runtime-crash``, ``transport-distortion``, ``hang``.
        """

    async def aclose(self) -> None:
        """Release per-event-loop resources (HTTP sessions); called at the end of a load run."""

    def metrics(self) -> dict[str, Any]:
        """Engine-side counters (prefix cache, spec decode, KV usage); empty if none."""
        return {}

    # Why the last tokenize() returned None (one line; '' when it did not or nothing is known).
    tokenize_note: str = ""

    def tokenize(self, texts: list[str], chat: bool = False) -> list[list[int]] | None:
        """The engine's own token ids for each text, exactly as it feeds a prompt to its model.

        Optional. The ids come from the engine's tokenizer, the one generation uses (never a
        second tokenizer loaded beside it), with the special tokens it adds to a prompt when
        generating (e.g. a BOS). ``chat=True``: each text is one user message, rendered as the
        engine renders a chat request (its chat template with the generation prompt), then
        tokenized without further special tokens.

        The default serves every backend reached over HTTP (``self.base_url``: a launched
        server, a bakeoff worker, an attached server): it asks the server's ``/tokenize`` route
        in vLLM's shape, which SGLang and bakeoff's workers also serve
        (:func:`backends._tokenize.server_tokenize`). A backend without one returns None.

        Returns:
            One id list per text, in order; None when the engine cannot say (no route, an
            answer of another shape), with the reason in :attr:`tokenize_note`.

        Raises:
            EngineFailure: the engine failed to answer (``runtime-crash``).
        """
        base_url = getattr(self, "base_url", None)
        if not base_url:
            self.tokenize_note = f"the {self.name} backend cannot report its engine's token ids"
            return None

        info = getattr(self, "info", None)
        ids, self.tokenize_note = server_tokenize(base_url, texts, chat=chat,
                                                  model=getattr(info, "served_model", None))
        return ids

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the engine and every process it started. Safe to call twice or after a crash."""

    def speculation(self) -> dict[str, Any] | None:
        """The speculative decoding this run configured: ``{"method", "draft", "self_draft"}`` (the draft
        model's path, or None; ``self_draft``: the draft is the served model itself, so nearly every drafted
        token must be accepted), or None when the run configures none (an attached server may still
        speculate: its counters tell, ``evaluations/test_spec_decode.py``)."""
        return None

    def determinism_switch(self) -> str | None:
        """The engine's batch-invariance switch as this run sets it (vLLM's ``VLLM_BATCH_INVARIANT=1``),
        or None: with it on, a request's greedy output must not depend on its batch at all
        (``served.batch_invariance`` then asks identical outputs, not ties)."""
        return None

    def log_tail(self, lines: int = 80) -> str:
        """Last lines of the engine's log, for evidence ('' when there is none)."""
        return ""

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
