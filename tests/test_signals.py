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
    # the child starts with SIGINT at its default whatever this process inherited: a suite started in
    # the background (``make test &``, nohup) ignores SIGINT, and an ignored SIGINT stays ignored by design
    proc = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, PYTHONPATH=str(REPO)),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(first)
    time.sleep(0.5)
    proc.send_signal(second)
    out, _ = proc.communicate(timeout=20)
    assert f"first: signal {int(first)} ['interrupted']" in out and "teardown finished" in out, out
    assert proc.returncode == 0


def test_an_ignored_sigint_stays_ignored():
    """``nohup bakeoff qualify &`` asked for SIGINT to be ignored: it is; SIGTERM still interrupts."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, PYTHONPATH=str(REPO)),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert "first: signal 15 ['interrupted']" in out and "teardown finished" in out, out
