"""Child processes for engines: own process group, log to a file, stop leaves nothing behind."""

from __future__ import annotations

import errno
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from bakeoff.host.redact import redact

# Exit codes / signals -> what they usually mean, for evidence.
SIGNAL_MEANING = {
    signal.SIGKILL: "killed (SIGKILL: OOM killer or external kill)",
    signal.SIGSEGV: "segmentation fault (SIGSEGV)",
    signal.SIGABRT: "aborted (SIGABRT)",
    signal.SIGBUS: "bus error (SIGBUS)",
    signal.SIGTERM: "terminated (SIGTERM)",
}


# Log lines the kernel's OOM killer or an exhausted address space leave behind.
OOM_MARKERS = ("Killed", "out of memory", "Out of memory", "MemoryError", "std::bad_alloc", "Cannot allocate memory")


def sigterm_as_interrupt(on_interrupt=None) -> None:
    """SIGTERM (a CI job's timeout, a machine shutdown) ends this process like Ctrl-C: a
    ``KeyboardInterrupt`` raised where it runs, so its ``finally`` blocks stop engines and keep what
    was written. One interruption only: a second SIGTERM or SIGINT is ignored, not raised inside the
    teardown the first one started (a second Ctrl-C there once left pytest's exit status OK and the
    cut-off run recorded as finished: issue 36's census, 5.24). ``on_interrupt()`` is called first,
    so the caller knows the run was interrupted whatever its framework concludes. SIGINT is taken
    only where Python's own handler has it (an ignored SIGINT stays ignored). A no-op off the main
    thread (Python sets handlers there only)."""
    def handler(signum, frame):
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        if on_interrupt is not None:
            on_interrupt()
        raise KeyboardInterrupt(f"signal {signum}")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, handler)


def ignore_sigterm() -> None:
    """Ignore SIGTERM from now on (an interruption is already being handled)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the parent dies (Linux PR_SET_PDEATHSIG), so
    an engine does not outlive a bakeoff that was SIGKILLed."""
    try:
        # lazy: keeps `bakeoff --help` fast (ctypes 4 ms; this module is on its path); only engine children use it
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def child_preexec(memory_limit_gib: float | None = None):
    """The ``preexec_fn`` of an engine child: die with the parent, and optionally cap its
    address space (``RLIMIT_AS``) at ``memory_limit_gib`` GiB.

    The cap is meant for Python workers (transformers, ORT GenAI): past it, allocations fail
    with ``MemoryError`` / ``std::bad_alloc`` instead of the host's OOM killer picking a
    victim. It does not suit vLLM or TensorRT-LLM, whose virtual size (reserved, not resident)
    is many times their memory use. Children of the child inherit the cap.
    """
    if not memory_limit_gib:
        return _die_with_parent
    limit = int(memory_limit_gib * 2**30)

    def preexec() -> None:
        _die_with_parent()
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return preexec


def background_preexec() -> None:
    """The ``preexec_fn`` of work that runs beside measurements (engine environments installed while
    an engine is measured, ``bakeoff qualify``): dies with its parent, and runs at the lowest CPU
    priority so that a measurement on a small host keeps the CPU it would have alone.

    Two levers, both needed on Linux: ``nice 19`` ranks the process below others of its scheduler
    group, and the group's own weight (``/proc/self/autogroup``, the group of the session the child
    opened with ``start_new_session=True``) ranks the group below the engine's, which runs in a
    session (so a group) of its own: with autogroups, a nice inside one group does not lower its
    share against another. Where either is not available, the other still applies.
    """
    _die_with_parent()
    for attempt in range(3):  # the kernel takes one autogroup change per 100 ms from a process
        try:  # without CAP_SYS_ADMIN (EAGAIN otherwise): wait out another process's change
            with open("/proc/self/autogroup", "w") as fh:
                fh.write("19")
            break
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                break
            time.sleep(0.11)
    try:
        os.nice(19)
    except OSError:
        pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def oom_suspected(code: int | None, log: str = "") -> bool:
    """Whether an exit looks like memory exhaustion: SIGKILL (exit -9, or 137 through a shell)
    with the OOM killer's or the allocator's words in the log, or those words alone."""
    return code != 0 and any(m in (log or "") for m in OOM_MARKERS)


def describe_exit(code: int | None, log: str = "") -> str:
    """Human text for a ``Popen.returncode`` (negative = killed by signal).

    Args:
        code: the return code.
        log: the child's log tail; when it shows memory exhaustion, the text says so.
    """
    if code is None:
        return "still running"
    if code < 0:
        try:
            sig = signal.Signals(-code)
        except ValueError:
            return f"killed by signal {-code}"
        text = SIGNAL_MEANING.get(sig, f"killed by {sig.name}")
        if sig == signal.SIGKILL and oom_suspected(code, log):
            text = "killed (SIGKILL) after running out of memory (OOM killer; the log says so)"
        return text
    if code == 128 + signal.SIGKILL and oom_suspected(code, log):
        return "exited with code 137 (SIGKILL through a shell: OOM killer or external kill)"
    return f"exited with code {code}"


def died_by_signal(code: int | None) -> bool:
    """Whether a return code means the child was killed by a signal (also 128+N through a shell)."""
    return code is not None and (code < 0 or code in (128 + signal.SIGKILL, 128 + signal.SIGSEGV))


def tail(path: Path | str, lines: int = 80, max_bytes: int = 256_000) -> str:
    """Last ``lines`` lines of a (possibly large) log file, redacted; '' if absent."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return redact("\n".join(data.splitlines()[-lines:]))


def head(path: Path | str, max_bytes: int = 512_000) -> str:
    """The first ``max_bytes`` of a log file, redacted; '' if absent. A root cause is written
    before the per-request errors it causes, which can push it out of any tail."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes).decode("utf-8", "replace")
    except OSError:
        return ""
    return redact(data)


def thread_cpu_ns(pid: int) -> int | None:
    """Nanoseconds on a CPU of a process's live threads (``/proc/PID/task/*/schedstat``, first field);
    None where the kernel keeps no schedstat or the process is gone."""
    total, seen = 0, False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                total += int(fh.read().split()[0])
            seen = True
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total if seen else None


class ManagedProcess:
    """A child process in its own session/process group, logging to a file.

    Args:
        cmd: the command line.
        log_path: stdout and stderr go here.
        env: full environment for the child.
        cwd: working directory.
        memory_limit_gib: cap on the child's address space in GiB (``RLIMIT_AS``), for
            Python workers only (see :func:`child_preexec`); None = no cap.
    """

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: str | None = None,
                 memory_limit_gib: float | None = None):
        self.cmd = list(cmd)
        self.log_path = Path(log_path)
        self._env = env
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "a", encoding="utf-8", buffering=1)
        self.popen = subprocess.Popen(
            self.cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=child_preexec(memory_limit_gib),
        )
        self.pgid = self.popen.pid
        self.last_output_ns = time.monotonic_ns()
        # The engine's output passes through the redaction step before it touches the disk.
        self._pump = threading.Thread(target=self._copy_log, name=f"log-{self.pid}", daemon=True)
        self._pump.start()

    def _copy_log(self) -> None:
        secrets_env = {**os.environ, **(self._env or {})}  # secrets given to the child alone are masked too
        assert self.popen.stdout is not None
        for raw in iter(self.popen.stdout.readline, b""):
            self.last_output_ns = time.monotonic_ns()
            try:
                self._log.write(redact(raw.decode("utf-8", "replace"), secrets_env))
            except (ValueError, OSError):  # log closed or disk full: keep draining the pipe
                pass
        self.popen.stdout.close()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 80) -> str:
        return tail(self.log_path, lines)

    def head_and_tail(self, lines: int = 300) -> str:
        """The log's start (bounded, :func:`head`) and its last ``lines`` lines: where a root
        cause is looked for once many requests have failed after it."""
        return head(self.log_path) + "\n" + tail(self.log_path, lines)

    def group_alive(self) -> bool:
        """Whether any process of the group is still alive."""
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def members(self) -> list[int]:
        """PIDs of the live processes of this process group (the engine and its children)."""
        import psutil

        pids = []
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(p.pid) == self.pgid:
                    pids.append(p.pid)
            except (ProcessLookupError, PermissionError):
                continue
        return pids

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system, seconds) the group's live processes have used, with that of the
        children each of them reaped (a worker's engine child that exited still counts, once);
        None when no process of the group is left. The progress reading of the hang rule
        (:mod:`bakeoff.loadgen.progress`): a few milliseconds on a host with a few hundred processes."""
        import psutil

        total, seen = 0.0, 0
        for pid in self.members():
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system + t.children_user + t.children_system
            seen += 1
        return total if seen else None

    def cpu_seconds_by_pid(self) -> dict[int, float]:
        """CPU seconds each live process of the group has run, its own (not its reaped children's): the
        split of a sweep point's CPU per token (:mod:`bakeoff.loadgen.serving_cpu`). Read in nanoseconds
        from each thread's ``/proc/PID/task/TID/schedstat`` (``/proc/PID/stat`` counts 10 ms ticks: a
        sweep point of a few hundred tokens read 0 or 78 us per token for the same worker), ticks where
        the kernel keeps no schedstat."""
        import psutil

        out: dict[int, float] = {}
        for pid in self.members():
            ns = thread_cpu_ns(pid)
            if ns is not None:
                out[pid] = ns / 1e9
                continue
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            out[pid] = t.user + t.system
        return out

    def dump_stacks(self, timeout_s: float = 20.0) -> str:
        """Stacks of every thread of every Python process of the group, via ``py-spy dump``.

        Used as evidence of a ``hang`` (e.g. workers stuck in a futex). Returns what could
        be collected; never raises.
        """
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(exe).exists():
            return "py-spy not installed: no stacks collected"
        import psutil

        out = []
        for pid in self.members():
            try:
                state = psutil.Process(pid).status()
            except psutil.Error:
                state = "gone"
            try:
                res = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s)
                if res.returncode != 0 or "Failed to get stack traces" in res.stdout + res.stderr:
                    # a stopped (SIGSTOP) or wedged process cannot be paused: read its memory as it is
                    res = subprocess.run([exe, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True,
                                         text=True, timeout=timeout_s)
                out.append(f"=== pid {pid} (state: {state}) ===\n{res.stdout or res.stderr}")
            except (OSError, subprocess.TimeoutExpired) as exc:
                out.append(f"=== pid {pid} (state: {state}) === py-spy failed: {exc}")
        return redact("\n".join(out) or "no live process in the group")

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the whole process group, then SIGKILL after ``grace_s``. Idempotent.

        Returns:
            The child's return code.
        """
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            if not self.group_alive() and self.popen.poll() is not None:
                break
            try:
                os.killpg(self.pgid, sig)
                if sig == signal.SIGTERM:  # a stopped (SIGSTOP) process handles SIGTERM only once continued
                    os.killpg(self.pgid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.popen.poll()
                if not self.group_alive():
                    break
                time.sleep(0.1)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._pump.join(timeout=5)
        if not self._log.closed:
            self._log.close()
        return self.popen.returncode
