"""The artifacts store: run directories written atomically, never overwritten.

Layout (docs/design.md "Artifacts")::

    artifacts/runs/<utc>_<backend>_<model-slug>_<short-id>/
        run.json  verdict.json  checks/<check>.json  evidence/<check>/...  requests.jsonl
    artifacts/reports/<name>/  report.md  index.html  *.png
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bakeoff.api.errors import UserError
from bakeoff.host.redact import redact


# one JSON line per completed sweep point, appended while the sweep runs (evaluations/test_throughput.py)
# and read by the live view (cli/progress.py); not part of the check's JSON
SWEEP_POINTS_LOG = "evidence/throughput.sweep/points.jsonl"

_UMASK = os.umask(0o022)  # read once, at import (os.umask can only be read by setting it)
os.umask(_UMASK)


MAX_JSON_BYTES = 512 * 2**20  # a run's JSON file larger than this is not bakeoff's (a sweep's verdict is a few MB)


def _json_int(text: str) -> int | float:
    return int(text) if len(text) <= 300 else float(text)


def read_json(path: Path) -> Any:
    """The JSON in ``path``, a file of a run directory that anyone may have put there.

    The file is opened without blocking and checked to be a regular file before a byte is read
    (a FIFO named ``verdict.json`` would otherwise wait for a writer forever; a device would
    never end); nesting deeper than Python's recursion limit is a ``ValueError``, not a
    ``RecursionError``.

    Raises:
        OSError: the file cannot be opened or read.
        ValueError: not a regular file, too large, not UTF-8 (a BOM or UTF-16 included), not JSON, or
            nested too deep.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device")
        raise ValueError(f"{Path(path).name} is {kind}, not a regular file")
    with os.fdopen(fd, "rb") as fh:
        if st.st_size > MAX_JSON_BYTES:
            raise ValueError(f"{Path(path).name} holds {st.st_size / 2**20:.0f} MiB, more than bakeoff writes")
        data = fh.read(MAX_JSON_BYTES + 1)
    try:
        # what bakeoff writes; UTF-16 or a BOM is not its file. An integer of over 300 digits (past any
        # float: a damaged file) reads as an infinity, which every figure shows as – (not an OverflowError)
        return json.loads(data.decode("utf-8"), parse_int=_json_int)
    except RecursionError:
        raise ValueError(f"{Path(path).name} nests deeper than any JSON bakeoff writes") from None


def atomic_write_text(path: Path, text: str) -> Path:
    """Write ``text`` (redacted) to ``path`` through a temp file and a rename.

    Raises:
        OSError: when the disk refuses the write; the previous file, if any, is intact.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        # a lone surrogate (a run's JSON may hold "\\ud800") is written escaped, not refused
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as fh:
            fh.write(redact(text))
            fh.flush()
            os.fchmod(fh.fileno(), 0o666 & ~_UMASK)  # mkstemp's 0600 would keep a shared report from readers
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def atomic_write_json(path: Path, data: Any) -> Path:
    """Write JSON atomically (indented, redacted)."""
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def slug(text: str, limit: int = 40) -> str:
    """File-name-safe slug of a model name or path."""
    text = text.rstrip("/").split("/")[-1] if "/" in text and not text.startswith("fixture:") else text
    text = text.replace("fixture:", "")
    return re.sub(r"[^A-Za-z0-9.\-]+", "-", text).strip("-")[:limit] or "model"


def is_run_meta(meta: Any) -> bool:
    """Whether ``meta`` (a parsed ``run.json``) holds what resuming a run reads from it:
    ``backend``, ``model``, ``options`` (an object) and ``profile``."""
    return (isinstance(meta, dict) and {"backend", "model", "options", "profile"} <= set(meta)
            and isinstance(meta["options"], dict))


ARTIFACTS_FIX = "pass --artifacts DIR with a writable folder"


def check_creatable(path: Path, what: str = "artifacts folder", fix: str = ARTIFACTS_FIX) -> Path:
    """Check, creating nothing, that ``path`` is a writable folder or could be created as one.

    Walks up to the nearest part of ``path`` that exists: it must be a folder (not a file),
    and a real probe (a temporary folder made and removed at once) must succeed there, since
    ``os.access`` says yes to root on any permission bits (CI runs as root). Used before
    anything expensive runs (a fixture build, an engine environment) so that a folder that
    will refuse the results is refused first.

    Args:
        path: the folder that will be written.
        what: how the error names it (``artifacts folder``, ``fixture cache``...).
        fix: what the user should do, ending the error line.

    Returns:
        ``path``.

    Raises:
        UserError: one line: ``{what} {path} is not writable ({reason}); {fix}``.
    """
    path = Path(path).expanduser()
    target = probe_at = Path(os.path.abspath(path))

    def refuse(reason: str, at: bool = True) -> UserError:  # names the part that refused when it is an ancestor
        where = f": {probe_at}" if at and probe_at != target else ""
        return UserError(f"{what} {path} is not writable ({reason}{where}); {fix}")

    while True:
        try:
            os.stat(probe_at)
            break
        except (FileNotFoundError, NotADirectoryError):  # missing, or below a file (found further up)
            if probe_at.parent == probe_at:
                raise refuse("no part of it exists") from None
            probe_at = probe_at.parent
        except OSError as exc:  # no permission to look, a name too long, a symlink loop
            raise refuse(exc.strerror or str(exc)) from None
    if not probe_at.is_dir():
        raise refuse("a file, not a folder" if probe_at == target else f"{probe_at} is a file, not a folder", at=False)
    # A real write decides, not os.access: access() answers for the real uid and says yes to
    # root whatever the permission bits, and cannot tell why it says no (a read-only mount, an
    # immutable folder, missing permission). A refused probe writes nothing; one that works
    # is removed at once.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".bakeoff-write-probe-", dir=probe_at))
    except FileNotFoundError:  # a folder that exists, on a filesystem that makes none there (/proc, /sys)
        raise refuse("its filesystem makes no folders there: mkdir answered 'No such file or directory'") from None
    except OSError as exc:
        raise refuse(exc.strerror or str(exc)) from None
    return path


def check_writable(root: Path, what: str = "artifacts folder", fix: str = ARTIFACTS_FIX) -> Path:
    """Make sure ``root`` exists and is writable (:func:`check_creatable`, then create it).

    Raises:
        UserError: when it cannot be created or written.
    """
    check_creatable(root, what, fix)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{what} {root} is not writable ({exc.strerror or exc}); {fix}") from None
    return root


def plain_name(name: str, flag: str) -> str:
    """A report name under ``artifacts/reports/``: one plain path component.

    Raises:
        UserError: empty, a path (``/``, ``..``), hidden, or holding a control character.
    """
    if (not name or name != Path(name).name or name in (".", "..") or name.startswith(".") or "\\" in name
            or not name.isprintable()):
        raise UserError(f"{flag} {name!r} is not a plain name; reports go to artifacts/reports/NAME: pass a name "
                        "such as latest or cpu-vs-h200")
    if len(name.encode()) > 128:  # a file name has 255 bytes at most; the run would fail at its very end
        raise UserError(f"{flag} {name[:40]!r}... is {len(name.encode())} bytes long; pass a name of at most 128")
    return name


def check_artifacts(root: Path, report: str | None = None) -> Path:
    """Check, creating nothing, that ``root`` (an ``--artifacts`` folder) can hold
    ``runs/`` and, when ``report`` is given, ``reports/<report>/``.

    Raises:
        UserError: a folder that is a file, cannot be created or cannot be written.
    """
    check_creatable(root)
    for sub in ["runs"] + ([f"reports/{report}"] if report else []):
        check_creatable(Path(root) / sub, "artifacts folder", ARTIFACTS_FIX)
    return root


class RunDir:
    """One run directory. Created once; files inside are written atomically.

    Args:
        path: the directory (must already exist; use :meth:`create`).
    """

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def create(cls, root: Path, backend: str, model: str) -> "RunDir":
        """Create a new, unique run directory under ``root/runs``.

        Raises:
            UserError: if ``root`` is not writable.
        """
        runs = check_writable(Path(root)) / "runs"
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        for _ in range(20):
            name = f"{stamp}_{backend}_{slug(model)}_{secrets.token_hex(3)}"
            path = runs / name
            try:
                path.mkdir(parents=True, exist_ok=False)
                return cls(path)
            except FileExistsError:
                if not runs.is_dir():
                    raise UserError(f"{runs} is a file, not a folder; pass --artifacts DIR whose runs/ is a folder") from None
                continue
            except OSError as exc:  # runs/ is a file (NotADirectoryError), no space, no permission
                raise UserError(f"cannot create a run directory under {runs} ({exc.strerror or exc}); "
                                "pass --artifacts DIR with a writable folder") from None
        raise RuntimeError("could not create a unique run directory")

    @property
    def run_id(self) -> str:
        return self.path.name

    def write_json(self, rel: str, data: Any) -> str:
        """Write JSON at ``rel`` inside the run; returns ``rel``."""
        atomic_write_json(self.path / rel, data)
        return rel

    def write_text(self, rel: str, text: str) -> str:
        """Write text at ``rel`` inside the run; returns ``rel``."""
        atomic_write_text(self.path / rel, text)
        return rel

    def evidence(self, check: str, name: str, content: Any) -> str:
        """Write one evidence file for ``check``; dicts/lists become JSON.

        Returns:
            The path relative to the run directory.
        """
        rel = f"evidence/{check}/{name}"
        if isinstance(content, (dict, list)):
            return self.write_json(rel, content)
        return self.write_text(rel, str(content))

    def append_jsonl(self, rel: str, rows: list[dict]) -> str:
        """Append rows to a JSON-lines file (opt-in per-request logs)."""
        path = self.path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            for row in rows:
                fh.write(redact(json.dumps(row, default=str)) + "\n")
        return rel


def list_runs(paths: list[Path]) -> list[Path]:
    """Run directories (folders holding ``verdict.json``) found in or at ``paths``, sorted."""
    found: list[Path] = []
    for p in paths:
        p = Path(p)
        if (p / "verdict.json").exists():  # any kind of file: reading it says what is wrong with it
            found.append(p)
        elif p.is_dir():
            found.extend(sorted(q.parent for q in p.glob("**/verdict.json")))
    return sorted(set(found), key=lambda q: q.name)
