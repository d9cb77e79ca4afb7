"""Each Python process of an engine reports the variables bakeoff asks about, as its interpreter starts.

Put first on ``PYTHONPATH`` by :func:`bakeoff.host.ranks.hook_env` when a run verifies a
multi-process engine's environment: ``/proc/PID/environ`` cannot be trusted there, because a
process that sets its title (vLLM's ranks) writes over that block. Writes
``$BAKEOFF_RANK_ENV_DIR/<pid>.json``: ``{"pid", "vars": {NAME: sha256 of the value | null}}``
for the names in ``$BAKEOFF_RANK_ENV_KEYS`` (values hashed: they may be secrets). Then runs the
``sitecustomize`` it shadows, if any. Standard library only; never raises.
"""

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys


def _report() -> None:
    folder, keys = os.environ.get("BAKEOFF_RANK_ENV_DIR"), os.environ.get("BAKEOFF_RANK_ENV_KEYS", "")
    if not folder:
        return
    seen = {}
    for k in (k for k in keys.split(",") if k):
        v = os.environ.get(k)
        seen[k] = None if v is None else hashlib.sha256(v.encode("utf-8", "surrogateescape")).hexdigest()
    tmp = os.path.join(folder, f".{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        json.dump({"pid": os.getpid(), "vars": seen}, fh)
    os.replace(tmp, os.path.join(folder, f"{os.getpid()}.json"))


def _chain() -> None:
    """The next ``sitecustomize`` on the path, as Python would have run it without this one."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)


try:
    _report()
except Exception:  # noqa: BLE001 - a report missed makes the rank unverifiable, never breaks the engine
    pass
try:
    _chain()
except Exception:  # noqa: BLE001
    pass
