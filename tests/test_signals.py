"""One interruption only: the first SIGINT or SIGTERM raises KeyboardInterrupt and is remembered;
a second one during the teardown it started is ignored (``bakeoff/host/procs.py
sigterm_as_interrupt``). Issue 36's census (5.24): two Ctrl-C 0.6 s apart left pytest's exit status
OK and the cut-off run recorded as finished."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHILD = r'''
import sys, time
from bakeoff.host.procs import sigterm_as_interrupt
seen = []
sigterm_as_interrupt(lambda: seen.append("interrupted"))
try:
    print("ready", flush=True)
    time.sleep(30)
except KeyboardInterrupt as exc:
    print("first:", exc, seen, flush=True)
    time.sleep(1.5)  # the teardown: a second signal lands here
    print("teardown finished", flush=True)
'''


@pytest.mark.parametrize("first, second", [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGINT),
                                           (signal.SIGINT, signal.SIGTERM)])
def test_a_second_signal_does_not_cut_the_teardown_of_the_first(first, second):
    proc = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(first)
    time.sleep(0.5)
    proc.send_signal(second)
    out, _ = proc.communicate(timeout=20)
    assert f"first: signal {int(first)} ['interrupted']" in out and "teardown finished" in out, out
    assert proc.returncode == 0
