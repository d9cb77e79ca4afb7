"""A child that dies by a signal while starting (segfault, OOM kill) is ``runtime-crash`` naming
the signal, with nothing left running. Split from tests/test_faults.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.test_faults import assert_no_process_left


class _CrashingChild:
    """A ChildServerBackend whose child dies by a signal while starting (no engine needed)."""

    @staticmethod
    def make(code: str, workdir: Path):
        from backends._server import ChildServerBackend
        from bakeoff.api.specs import BackendConfig, Spec

        class Crash(ChildServerBackend):
            name, Options, ready_mode = "crash", Spec, "file"

            def command(self, port):
                return [sys.executable, "-c", code], dict(os.environ)

            def start(self):
                return self.launch(0)
        return Crash(BackendConfig(backend="crash", model="m", workdir=str(workdir), start_timeout_s=60))


@pytest.mark.parametrize("code, meaning", [
    ("import ctypes; ctypes.string_at(0)", "segmentation fault (SIGSEGV)"),
    ("import os, signal; print('Killed', flush=True); os.kill(os.getpid(), signal.SIGKILL)", "after running out of memory"),
])
def test_signal_death_during_start_is_runtime_crash(tmp_path, code, meaning):
    from bakeoff.api.errors import EngineFailure

    backend = _CrashingChild.make(code, tmp_path)
    with pytest.raises(EngineFailure) as err:
        backend.start()
    backend.stop()
    assert err.value.failure_class == "runtime-crash" and meaning in err.value.message, err.value.message
    assert meaning in err.value.evidence["exit.txt"]
    assert_no_process_left(tmp_path)
