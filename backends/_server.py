"""Shared machinery for backends whose engine runs in a child process behind HTTP.

Both hosting modes use it (docs/design.md "Two ways to host an engine"):
- server: the engine's own OpenAI-compatible server (``vllm serve``, ``trtllm-serve``);
  ready when ``/health`` answers 200.
- worker: the engine's in-process API wrapped by :mod:`backends._hosting.worker_server`; ready when
  the worker writes its ready file.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, AsyncIterator, Callable, ClassVar

from backends import _ranks
from backends.base import Backend
from bakeoff.api.errors import EngineFailure
from bakeoff.loadgen.client import OpenAIClient
from bakeoff.loadgen.progress import Progress
from bakeoff.loadgen.side_http import open_bounded
from bakeoff.analysis.failures import classify_start, missing_tokenizer
from bakeoff.host import envs, hugepages
from bakeoff.host.procs import ManagedProcess, describe_exit, died_by_signal, free_port
from bakeoff.api.specs import BackendInfo, GenerationRequest, TokenEvent
from backends._options import OptionReport, fallback_statements
from backends._checkpoint_read import check
from backends._server_failures import cuda_evidence, death_cause, last_error_line, shape_refusal


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """GET ``url``; returns ``(status, body)``, status 0 when unreachable."""
    try:
        status, raw, _ = open_bounded(url, timeout_s)  # no redirect followed, the body bounded (side_http)
        return status, raw.decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, ""


def parse_prometheus(text: str) -> dict[str, float]:
    """Flatten Prometheus exposition text to ``{name{labels}: value}`` with prometheus_client's parser.

    Counters keep their ``_total`` suffix as on the wire; labels other than ``model_name``
    and ``engine`` are kept in the key, e.g. ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}``.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception:  # a malformed exposition is not worth failing a run over
        return out
    for fam in families:
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            key = s.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


class ChildServerBackend(Backend):
    """A backend whose engine is a child process serving the OpenAI API over HTTP.

    :meth:`start` is the template every such backend runs: :meth:`prepare` (environment,
    export, host probe), :meth:`launch` on a free port until the engine serves (a failure
    passes through :meth:`classify_start_failure`), the client for :meth:`served_model`,
    then :meth:`describe` says what the engine stated. Subclasses implement :meth:`command`
    and :meth:`describe` and override the other hooks only where they differ.
    """

    ready_mode: str = "health"  # "health" (GET /health) or "file" (worker ready file)
    huge_pages: bool = False  # the engine process asks for huge pages by default (bakeoff/host/hugepages.py)
    api: str = "completions"
    # the engine's own environment: its folder's ``env_spec`` (() -> bakeoff.host.envs.EnvSpec), made
    # by :meth:`ensure_env`; None: the engine runs in bakeoff's environment or says its own env_specs
    engine_env: ClassVar[Callable[[], envs.EnvSpec] | None] = None
    log_name: ClassVar[str] = "env.log"  # the run's engine folder file that prepare()'s lines go to
    # an engine with a worker process per rank: its title (named groups ``pp`` and ``tp``), read by
    # backends/_ranks.py to watch and verify each rank; None: a single engine process
    rank_title: ClassVar[re.Pattern | None] = None

    @classmethod
    def env_specs(cls) -> list:
        return [cls.engine_env()] if cls.engine_env is not None else []

    def __init__(self, config):
        super().__init__(config)
        self.workdir = Path(config.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc: ManagedProcess | None = None
        self.client: OpenAIClient | None = None
        self.base_url: str | None = None
        self.ready_file = self.workdir / f"{self.name}.ready.json"
        self.log_path = self.workdir / f"{self.name}.log"
        self.ready_payload: dict[str, Any] = {}
        self.failed: EngineFailure | None = None  # a hang: later requests fail fast instead of waiting again
        self._stacks: str | None = None

    # -- to implement -----------------------------------------------------------------
    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        """The command line and environment that start the engine on ``port``."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Work before the launch (the engine's environment, an export, a host probe)."""

    def _log(self, line: str) -> None:
        with open(self.workdir / self.log_name, "a") as fh:
            fh.write(line.rstrip() + "\n")

    def ensure_env(self) -> Path:
        """The engine's environment (:attr:`engine_env`, created on first use, progress to the log),
        then :meth:`check_checkpoint` in it; sets and returns :attr:`env_python`."""
        spec = self.engine_env()
        self.env_python = envs.ensure(spec, self._log)
        self.check_checkpoint(self.env_python, spec.name)
        return self.env_python

    def prepare_export(self, export: Callable[..., Any], options: Any, timeout_s: float, use_cache: bool) -> None:
        """The export-then-serve backends' :meth:`prepare`: a local checkpoint folder, the environment,
        the export (``export(model, options, log=, timeout_s=, use_cache=)``, cached by the adapter) into
        :attr:`export_result`, written to ``export.json`` in the run's engine folder.

        Raises:
            EngineFailure: ``unavailable`` for a hub id (no hub access here); what the export raises.
        """
        if not Path(self.config.model).is_dir():
            raise EngineFailure("unavailable", f"{self.name} exports local checkpoint folders; {self.config.model!r} "
                                "is not one (no hub access here)")
        self.ensure_env()
        self.export_result = export(self.config.model, options, log=self._log, timeout_s=timeout_s, use_cache=use_cache)
        (self.workdir / "export.json").write_text(self.export_result.model_dump_json(indent=1))

    def check_checkpoint(self, python, env_name: str) -> None:
        """Before the engine reads the checkpoint: its environment must read the config and tokenizer
        files as the reference's does (:mod:`backends._checkpoint_read`); the readings are written to
        ``checkpoint_read.json`` in the run's engine folder.

        Raises:
            EngineFailure: ``config-rejected`` naming the file and both transformers versions.
        """
        readings = check(python, self.config.model, env_name, log=self._log)
        if readings is not None:
            (self.workdir / "checkpoint_read.json").write_text(json.dumps(readings, indent=1))

    def classify_start_failure(self, exc: EngineFailure) -> EngineFailure:
        """A start failure as this engine's words classify it (default: unchanged)."""
        return exc

    def expected_ranks(self) -> int | None:
        """How many rank processes the options ask for (with :attr:`rank_title`); None: not known."""
        return None

    def served_model(self) -> str:
        """The model name requests carry."""
        return self.config.model

    def describe(self, startup_s: float) -> BackendInfo:
        """What the engine stated once serving (versions, KV capacity, fallbacks)."""
        raise NotImplementedError

    def start(self) -> BackendInfo:
        """The template (class docstring). Raises what :meth:`prepare` and :meth:`launch` raise."""
        self.prepare()
        try:
            startup_s = self.launch(free_port())
        except EngineFailure as exc:
            raise self.classify_start_failure(exc) from None
        _ranks.after_start(self)
        self.make_client(self.served_model())
        self.info = self.describe(round(startup_s, 2))
        self.info.notes["huge_pages"] = self.huge_pages_note()
        self.info.notes.update(getattr(self, "rank_notes", {}))
        return self.info

    def huge_pages_note(self) -> str:
        """What the engine's processes were asked to do about huge pages, and what they hold on them now."""
        _, how = hugepages.engine_env(wanted=self.huge_pages)
        pages = hugepages.anon_huge_pages(self.proc.members()) if self.proc is not None else None
        return how + (f"; engine processes after start: AnonHugePages {pages[0]:g} MiB of Rss {pages[1]:g} MiB"
                      if pages else "")

    def extra_body(self) -> dict[str, Any]:
        return {}

    def greedy_body(self) -> dict[str, Any]:
        """Fields every request at temperature 0 carries: the engine's sampling options that change a
        greedy choice, neutral (:data:`bakeoff.loadgen.client.NEUTRAL_VLLM` and the like). None for
        bakeoff's own workers, whose engines decode greedy requests greedily themselves."""
        return {}

    # -- lifecycle ----------------------------------------------------------------------
    def launch(self, port: int) -> float:
        """Start the child and wait until it serves. Returns startup seconds.

        Raises:
            EngineFailure: when the child exits first: ``unsupported-architecture`` or
                ``load-failure`` by the engine's words (:mod:`bakeoff.analysis.failures`),
                ``runtime-crash`` when a signal killed it; ``hang`` when the start deadline
                passes; each with the log tail as evidence.
        """
        cmd, env = self.command(port)
        env = _ranks.prepare_env(self, env or {})
        no_tokenizer = None if any(a.startswith("--tokenizer") for a in cmd) else missing_tokenizer(self.config.model)
        if no_tokenizer:  # a tokenizer given apart (vLLM --tokenizer) is the engine's to check
            raise EngineFailure("load-failure", no_tokenizer, {"checkpoint_files.txt": "\n".join(
                sorted(p.name for p in Path(self.config.model).iterdir()))})
        # Every process the engine starts inherits this: it finds strays even once reparented.
        env = dict(env or {}, BAKEOFF_ENGINE_WORKDIR=str(self.workdir.resolve()))
        self.launch_cmd = cmd
        self.base_url = f"http://127.0.0.1:{port}"
        self.serves_on_loopback = True
        if self.ready_file.exists():
            self.ready_file.unlink()
        t0 = time.monotonic()
        self.proc = ManagedProcess(cmd, self.log_path, env=env,
                                   memory_limit_gib=getattr(self.config, "memory_limit_gib", None))
        deadline = t0 + self.config.start_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self.proc.stop()  # reap the rest of the group (and flush the log)
                raise cuda_evidence(self._start_failure(code, cmd), self.proc.tail(300), "start")
            if self._is_ready():
                break
            if time.monotonic() > deadline:
                tail_text, stacks = self.proc.tail(120), self.proc.dump_stacks()
                self.stop()
                raise EngineFailure("hang", f"{self.name} not ready within {self.config.start_timeout_s:.0f} s",
                                    {"engine.log.tail": tail_text, "stacks.txt": stacks, "command.txt": " ".join(cmd)})
            time.sleep(0.25)
        return time.monotonic() - t0

    def _start_failure(self, code: int, cmd: list[str]) -> EngineFailure:
        """The failure of a child that exited during start: killed by a signal -> ``runtime-crash``;
        else the class the engine's words name (:func:`bakeoff.analysis.failures.classify_start`), by
        default ``load-failure``; the summary is the engine's line."""
        log = self.proc.tail(300)
        known = classify_start(log)
        fclass = "runtime-crash" if died_by_signal(code) else (known.failure_class if known else "load-failure")
        cause = known.line if known else death_cause(code, log)
        return EngineFailure(fclass, f"{self.name} {describe_exit(code, log)} during start: {cause}",
                             {"engine.log.tail": self.proc.tail(120), "command.txt": " ".join(cmd),
                              "exit.txt": f"return code {code}: {describe_exit(code, log)}"
                                          + (f"\nrecognised: {known.kind} -> {known.failure_class}" if known else "")})

    def _is_ready(self) -> bool:
        if self.ready_mode == "file":
            if not self.ready_file.is_file():
                return False
            self.ready_payload = json.loads(self.ready_file.read_text())
            return True
        status, _ = http_get(self.base_url + "/health", timeout_s=2)
        return status == 200

    def make_client(self, served_model: str) -> OpenAIClient:
        """The client of the launched engine: a request without a byte for the progress timeout is
        checked against the CPU time of the engine's process group (:func:`cpu_progress`)."""
        timeout_s = self.config.progress_timeout_s
        self.client = OpenAIClient(self.base_url, served_model, api=self.api, extra_body=self.extra_body(),
                                   greedy_body=self.greedy_body(), read_timeout_s=timeout_s,
                                   progress=(_ranks.progress(self) or cpu_progress(self.proc)) if self.proc else None,
                                   deadline_s=self.config.request_deadline_factor * timeout_s)
        return self.client

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if self.client is None:
            raise EngineFailure("load-failure", f"{self.name} is not started")
        if self.failed is not None:  # hung before: fail fast, do not wait the progress deadline again
            raise EngineFailure(self.failed.failure_class, f"engine hung earlier: {self.failed.message}")
        events = self.client.stream(request)
        try:
            async for ev in events:
                yield ev
        except GeneratorExit:  # the consumer stopped reading: the client's stream closed now (the request cancelled)
            await events.aclose()
            raise
        except EngineFailure as exc:
            if self.proc is not None and exc.failure_class in ("transport-distortion", "runtime-crash"):
                await self._settle()
            if self.proc is not None and not self.proc.alive():
                log = self.proc.tail(300)
                raise _ranks.name_lost_rank(self, shape_refusal(cuda_evidence(EngineFailure(
                    "runtime-crash", f"{self.name} {describe_exit(self.proc.poll(), log)} while serving: "
                    f"{death_cause(self.proc.poll(), log)}",
                    {"engine.log.tail": self.proc.tail(120), "client_error.txt": exc.message}),
                    exc.message + "\n" + self.proc.tail(300), "serving"), self.proc.head_and_tail())) from None
            _ranks.name_lost_rank(self, exc)  # a hang whose rank is gone is that rank's crash
            _ranks.hang_evidence(self, exc)
            if self.proc is not None and exc.failure_class == "hang":
                if self._stacks is None:  # once: concurrent requests hang together
                    self._stacks = self.proc.dump_stacks()
                stopped = _stopped_members(self.proc)
                if stopped:
                    exc.message = f"{exc.message}; engine process {', '.join(map(str, stopped))} is stopped (SIGSTOP)"
                exc.evidence.setdefault("stacks.txt", self._stacks)
                exc.evidence.setdefault("engine.log.tail", self.proc.tail(120))
                self.failed = exc
            if self.proc is not None and exc.failure_class == "runtime-crash":
                # the server is up but its engine failed: name the root cause from its log
                cause = last_error_line(self.proc.tail(300))
                exc.message = f"{exc.message} | engine log: {cause}"
                exc.evidence.setdefault("engine.log.tail", self.proc.tail(120))
                shape_refusal(cuda_evidence(exc, exc.message + "\n" + self.proc.tail(300), "serving"),
                              self.proc.head_and_tail())
            raise

    async def _settle(self, wait_s: float = 1.0) -> None:
        """A connection cut by a dying engine is seen before its exit: give the exit ``wait_s`` seconds
        (without blocking other requests) so the failure is named as the crash it is."""
        deadline = time.monotonic() + wait_s
        while self.proc.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    def metrics(self) -> dict[str, Any]:
        if not self.base_url:
            return {}
        status, body = http_get(self.base_url + "/metrics", timeout_s=10)
        return parse_prometheus(body) if status == 200 else {}

    def log_tail(self, lines: int = 80) -> str:
        return self.proc.tail(lines) if self.proc is not None else ""

    def option_report(self):
        """What the engine said about the options the user set (:mod:`backends._options`), or
        None before a start. Default: the backend's ``fallbacks`` (bakeoff's workers state one
        when they serve otherwise than asked, e.g. transformers' ``batching``); nothing else is
        verified. Engines with their own log rules
        (vLLM, ORT GenAI) override it."""

        if self.info is None:
            return None
        opts = dict(self.config.options)
        rep = OptionReport(engine=self.info.engine, set_options=opts)
        for st in fallback_statements(self.info.fallbacks, opts, self.info.engine):
            rep.add(st)
        touched = {s.option for s in rep.ignored()}
        rep.unverifiable = {k: f"{self.info.engine} states nothing about it" for k in opts if k not in touched}
        return rep

    def stop(self) -> None:
        _ranks.finish(self)
        if self.proc is not None:
            self.proc.stop()


# CPU seconds per second (cores) over a window of silence at which a launched engine counts as
# computing. An idle engine (a server's event loop, worker threads parked on a futex or a pipe)
# uses well under 1% of a core; one computing a prefill on a contended 2-core host still gets
# tens of percent. 10% sits between with room on both sides. A process group that spins while
# wedged (a busy-wait, a GPU sync spin) counts as computing: it ends at the deadline as slow.
CPU_COMPUTING_CORES = 0.10


def cpu_progress(proc: ManagedProcess) -> Progress:
    """The hang rule's reading of an engine bakeoff launched: its process group's CPU time."""
    return Progress(proc.cpu_seconds, "CPU s", CPU_COMPUTING_CORES,
                    f"CPU time of the engine's process group {proc.pgid} (psutil)")


def _stopped_members(proc: ManagedProcess) -> list[int]:
    """PIDs of the engine's processes that are stopped (SIGSTOP / SIGTSTP, a debugger)."""
    import psutil

    out = []
    for pid in proc.members():
        try:
            if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
                out.append(pid)
        except psutil.Error:
            continue
    return out
