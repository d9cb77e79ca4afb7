"""Declarative, recorded edits of a checkpoint's JSON files, applied to a copy.

A released checkpoint is sometimes a config edit away from loading in an engine (an MTP
head its quantization recipe forgot to ignore, a ``torch_dtype`` the engine refuses). This
adapter makes such an edit explicit and reproducible:

- the source folder is never modified: a new folder gets copies of the small files and
  links (hard links where possible, symbolic links otherwise) to the weights;
- each patch is recorded with the value before and after (``bakeoff-patches.json`` in the
  copy, and :meth:`PatchedCheckpoint.evidence` for a run's evidence folder);
- the copy's folder name carries a hash of the source and of the patches, so a run's cache
  key changes when a patch does, and the same patches on the same source reuse the copy.

Patch syntax on the command line (``--patch``, one patch per flag)::

    PATH=VALUE       set a key (intermediate objects are created)   torch_dtype=bfloat16
    PATH+=VALUE      append to a list (created if absent; a value
                     already in the list is left, recorded as unchanged)
                                                     quantization_config.ignore+=re:.*mtp.*
    PATH-=VALUE      remove one value from a list                    quantization_config.ignore-=lm_head
    del:PATH         remove a key                                    del:quantization_config

``PATH`` is dot-separated keys (a purely numeric part indexes a list). ``VALUE`` is parsed as
JSON when it parses (``3``, ``true``, ``null``, ``[1,2]``, ``"x"``), else taken as a string
(``bfloat16``, ``re:.*mtp.*``). A ``FILE.json:`` prefix edits another JSON file of the
checkpoint, e.g. ``generation_config.json:eos_token_id=2``; the default is ``config.json``.

Example:
    >>> from adapters.checkpoint_patches import apply_patches, parse_patch
    >>> pc = apply_patches("/models/m", [parse_patch("quantization_config.ignore+=re:.*mtp.*")])
    >>> pc.path, pc.key        # serve pc.path instead of /models/m
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from bakeoff.host.envs import cache_root
from bakeoff.api.errors import UserError
from bakeoff.api.specs import Spec

RECORD = "bakeoff-patches.json"
# Files linked rather than copied: weights and anything large (bytes).
LINK_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx", ".data", ".npz", ".msgpack", ".h5")
LINK_MIN_BYTES = 16 * 2**20
_MISSING = "<absent>"


class Patch(Spec):
    """One edit of one JSON file of a checkpoint.

    Attributes:
        op: ``set`` a key, ``append`` a value to a list, ``remove`` a key (``value`` unset)
            or one value from a list (``value`` set).
        path: dot-separated keys into the JSON document, e.g. ``quantization_config.ignore``.
        value: the value to set, append or remove.
        file: the JSON file, relative to the checkpoint folder.
    """

    op: Literal["set", "append", "remove"]
    path: str = Field(min_length=1)
    value: Any = None
    file: str = "config.json"

    def describe(self) -> str:
        """The patch in command-line syntax."""
        prefix = "" if self.file == "config.json" else f"{self.file}:"
        plain = isinstance(self.value, str) and _parse_value(self.value) == self.value
        val = self.value if plain else json.dumps(self.value)
        if self.op == "set":
            return f"{prefix}{self.path}={val}"
        if self.op == "append":
            return f"{prefix}{self.path}+={val}"
        return f"{prefix}{self.path}-={val}" if self.value is not None else f"del:{prefix}{self.path}"


class PatchChange(Spec):
    """What one patch did: the value at its path before and after (``<absent>`` when missing)."""

    patch: str
    file: str
    path: str
    before: Any
    after: Any
    changed: bool


class PatchedCheckpoint(Spec):
    """A patched copy of a checkpoint.

    Attributes:
        path: the patched folder: load this instead of the source.
        source: the source folder (absolute), untouched.
        patches: the patches, in order.
        key: sha256 (hex) of the source fingerprint and the patches: the cache key.
        diff: one :class:`PatchChange` per patch.
        reused: True when an existing copy with the same key was reused.
    """

    path: str
    source: str
    patches: list[Patch]
    key: str
    diff: list[PatchChange]
    reused: bool = False

    def record(self) -> dict[str, Any]:
        """The patch record (what ``bakeoff-patches.json`` holds)."""
        return self.model_dump(mode="json", exclude={"reused"})

    def evidence(self) -> dict[str, str]:
        """``{file name: text}`` for a run's evidence folder."""
        return {"checkpoint-patches.json": json.dumps(self.record(), indent=2, default=str)}


_PATCH_RE = re.compile(r"^(?:(?P<file>[\w.\-/]+\.json):)?(?P<path>[^=+\-]+?)(?P<op>\+=|-=|=)(?P<value>.*)$", re.S)
_PATH_RE = re.compile(r"^[^.\s=]+(\.[^.\s=]+)*$")


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


MAX_PATH_KEYS = 32  # a config nested deeper is no checkpoint's; 5,000 keys overflowed the JSON writer


def _shallow(path: str, text: str) -> str:
    """``path`` if it names at most :data:`MAX_PATH_KEYS` keys; else UserError quoting ``text``."""
    if path.count(".") >= MAX_PATH_KEYS:
        raise UserError(f"malformed patch {text[:60]!r}...: its path is deeper than {MAX_PATH_KEYS} keys")
    return path


def parse_patch(text: str) -> Patch:
    """Parse one patch from command-line syntax (see the module docstring).

    Raises:
        UserError: one line naming the bad patch and showing the syntax.
    """
    syntax = ("expected PATH=VALUE, PATH+=VALUE, PATH-=VALUE or del:PATH "
              "(e.g. quantization_config.ignore+=re:.*mtp.*, torch_dtype=bfloat16)")
    raw = text.strip()
    if raw.startswith("del:"):
        target = raw[4:]
        file, _, path = target.rpartition(":") if ".json:" in target else ("", "", target)
        if not path or not _PATH_RE.match(path) or (file and not file.endswith(".json")):
            raise UserError(f"malformed patch {text!r}: {syntax}")
        return Patch(op="remove", path=_shallow(path, text), file=file or "config.json")
    m = _PATCH_RE.match(raw)
    if not m or not _PATH_RE.match(m.group("path").strip()):
        raise UserError(f"malformed patch {text!r}: {syntax}")
    op = {"=": "set", "+=": "append", "-=": "remove"}[m.group("op")]
    value = _parse_value(m.group("value"))
    if op != "set" and m.group("value") == "":
        raise UserError(f"malformed patch {text!r}: PATH+=VALUE and PATH-=VALUE need a value; "
                        "use del:PATH to remove a key")
    return Patch(op=op, path=_shallow(m.group("path").strip(), text), value=value, file=m.group("file") or "config.json")


def parse_patches(items: list[str]) -> list[Patch]:
    """Parse several command-line patches. Raises UserError on the first malformed one."""
    return [parse_patch(item) for item in items]


def _walk(doc: Any, parts: list[str], create: bool, where: str) -> tuple[Any, str | int]:
    """The container holding the last part of a path, and that part's key/index."""
    node = doc
    for i, part in enumerate(parts[:-1]):
        key = int(part) if isinstance(node, list) and part.isdigit() else part
        if isinstance(node, dict):
            if key not in node:
                if not create:
                    raise UserError(f"{where}: no key {'.'.join(parts[:i + 1])!r} in the checkpoint")
                node[key] = {}
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            raise UserError(f"{where}: {'.'.join(parts[:i + 1])!r} is not an object or list index")
    last = parts[-1]
    if isinstance(node, list) and last.isdigit():
        return node, int(last)
    if not isinstance(node, dict):
        raise UserError(f"{where}: {'.'.join(parts[:-1])!r} is not an object")
    return node, last


def _get(container: Any, key: str | int) -> Any:
    try:
        return copy.deepcopy(container[key])
    except (KeyError, IndexError):
        return _MISSING


def apply_to_document(doc: dict[str, Any], patch: Patch) -> PatchChange:
    """Apply one patch to a parsed JSON document in place.

    Raises:
        UserError: when the path does not fit the document (a missing key for ``remove``, a
            list expected and something else found...).
    """
    where = f"patch {patch.describe()!r}"
    container, key = _walk(doc, patch.path.split("."), create=patch.op != "remove", where=where)
    before = _get(container, key)
    if patch.op == "set":
        container[key] = copy.deepcopy(patch.value)
    elif patch.op == "append":
        if before == _MISSING or before is None:
            container[key] = []
        elif not isinstance(container[key], list):
            raise UserError(f"{where}: {patch.path!r} is a {type(container[key]).__name__}, not a list")
        if patch.value not in container[key]:
            container[key].append(copy.deepcopy(patch.value))
    else:
        if before == _MISSING:
            raise UserError(f"{where}: no key {patch.path!r} in {patch.file}")
        if patch.value is None:
            del container[key]
        elif not isinstance(before, list):
            raise UserError(f"{where}: {patch.path!r} is a {type(before).__name__}, not a list")
        elif patch.value not in before:
            raise UserError(f"{where}: {patch.value!r} is not in {patch.path!r} ({before!r})")
        else:
            container[key].remove(patch.value)
    after = _get(container, key)
    return PatchChange(patch=patch.describe(), file=patch.file, path=patch.path, before=before, after=after,
                       changed=before != after)


def _is_linked(path: Path) -> bool:
    return path.suffix in LINK_SUFFIXES or path.stat().st_size >= LINK_MIN_BYTES


def source_fingerprint(model_path: Path) -> dict[str, Any]:
    """What identifies the source: its absolute path, small files by content hash, large ones
    by size and modification time (ns)."""
    files: dict[str, Any] = {}
    for f in sorted(p for p in model_path.rglob("*") if p.is_file() and p.name != RECORD):
        rel = str(f.relative_to(model_path))
        if _is_linked(f):
            st = f.stat()
            files[rel] = [st.st_size, st.st_mtime_ns]
        else:
            files[rel] = hashlib.sha256(f.read_bytes()).hexdigest()
    return {"source": str(model_path), "files": files}


def patch_key(model_path: str | Path, patches: list[Patch]) -> str:
    """sha256 (hex) of the source fingerprint and the patches: the patched copy's cache key."""
    blob = json.dumps({"source": source_fingerprint(Path(model_path).resolve()),
                       "patches": [p.model_dump(mode="json") for p in patches]}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        os.symlink(src, dst)


def apply_patches(model_path: str | Path, patches: list[Patch | str], cache_dir: str | Path | None = None) -> PatchedCheckpoint:
    """Apply patches to a copy of a checkpoint folder.

    Args:
        model_path: the source checkpoint folder (never modified).
        patches: :class:`Patch` objects or command-line strings.
        cache_dir: where patched copies live; default ``cache_root()/patched``.

    Returns:
        The patched copy, its cache key and what each patch changed. A copy with the same key
        is reused (its recorded diff is returned).

    Raises:
        UserError: a missing source folder or JSON file, a malformed patch or a patch that
            does not fit the checkpoint.
    """
    src = Path(model_path).resolve()
    if not (src / "config.json").is_file():
        raise UserError(f"{model_path} is not a checkpoint folder (no config.json); patches apply to local folders")
    plist = [parse_patch(p) if isinstance(p, str) else p for p in patches]
    if not plist:
        raise UserError("no patches given")
    key = patch_key(src, plist)
    root = Path(cache_dir) if cache_dir else cache_root() / "patched"
    dest = root / f"{re.sub(r'[^A-Za-z0-9_.-]', '-', src.name)[:60]}-patched-{key[:16]}"
    if (dest / RECORD).is_file():
        rec = json.loads((dest / RECORD).read_text())
        return PatchedCheckpoint(**{**rec, "path": str(dest), "reused": True})
    docs: dict[str, dict] = {}
    diff: list[PatchChange] = []
    for p in plist:
        if p.file not in docs:
            f = src / p.file
            try:
                docs[p.file] = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise UserError(f"patch {p.describe()!r}: cannot read {f}: {exc}") from None
        diff.append(apply_to_document(docs[p.file], p))
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=root))
    try:
        for f in sorted(src.rglob("*")):
            rel = f.relative_to(src)
            out = tmp / rel
            if f.is_dir():
                out.mkdir(parents=True, exist_ok=True)
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            if str(rel) in docs or f.name == RECORD:
                continue
            _link(f, out) if _is_linked(f) else shutil.copy2(f, out)
        for name, doc in docs.items():
            (tmp / name).write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
        result = PatchedCheckpoint(path=str(dest), source=str(src), patches=plist, key=key, diff=diff)
        (tmp / RECORD).write_text(json.dumps(result.record(), indent=2, default=str))
        try:
            os.rename(tmp, dest)
        except OSError:  # another process made the same copy first: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
            return PatchedCheckpoint(**{**json.loads((dest / RECORD).read_text()), "path": str(dest), "reused": True})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result
