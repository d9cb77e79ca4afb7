"""``--backend-opt key=value``: parsed once into values, validated against a backend's pydantic
Options model, and written back as ``key=value`` only to hand them to a child command line."""

from __future__ import annotations

import json
import math
import re
import types
import typing
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ValidationError

from bakeoff.api.errors import UserError


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")  # JSON's NaN / Infinity / -Infinity


def parse_value(raw: str) -> Any:
    """The value of ``key=VALUE``: JSON where it parses (``3``, ``true``, ``{...}``), else the text.

    Raises:
        ValueError: ``NaN`` / ``Infinity`` (a bound no option means), or nesting beyond recursion.
    """
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except json.JSONDecodeError:
        return raw
    except RecursionError:
        raise ValueError("nested too deep") from None


def format_kv(key: str, value: Any) -> str:
    """``key=VALUE`` that :func:`parse_kv` reads back as ``value`` (text as it is where it would not
    parse as JSON, else JSON)."""
    if isinstance(value, str):
        try:
            same = parse_value(value) == value
        except ValueError:
            same = False
        if same:
            return f"{key}={value}"
    return f"{key}={json.dumps(value, separators=(',', ':'))}"


def parse_kv(items: list[str], flag: str = "--backend-opt") -> dict[str, Any]:
    """Parse ``["k=v", ...]``; values are JSON where they parse (``3``, ``true``, ``{...}``);
    ``env.NAME=VALUE`` items gather, as text, into one ``env`` dict (an engine's environment).

    Raises:
        UserError: for an item without ``=``, with an empty key, a key given twice (which value
            was meant is ambiguous), or a value NaN / Infinity.
    """
    out: dict[str, Any] = {}
    by_item = False  # "env" in out came from env.NAME items
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"malformed {flag} {item!r}: expected key=value, e.g. {flag} max_model_len=2048")
        if key.startswith(ENV_PREFIX):
            if "env" in out and not by_item:
                raise UserError(f"{flag} env given both whole and as {key}; pass one form")
            _env_item(out, key[len(ENV_PREFIX):], raw, flag, item)
            by_item = True
            continue
        try:
            value = parse_value(raw)
        except ValueError as exc:
            raise UserError(f"{flag} {key}={raw[:40]!r}: {exc}; pass a finite value") from None
        if key in out:
            raise UserError(f"{flag} {key} given twice ({key}={out[key]!r} and {item!r}); pass it once")
        out[key] = value
    return out


ENV_PREFIX = "env."  # --backend-opt env.NAME=VALUE: an environment variable for the engine's processes
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# bakeoff sets these for every engine process (its worker code on PYTHONPATH, the rank hook): a user's
# value would be rewritten, and the rank check would then blame the engine for bakeoff's rewrite
RESERVED_ENV = ("PYTHONPATH",)
RESERVED_ENV_PREFIX = "BAKEOFF_"
MAX_ENV_BYTES = 128 * 1024 - 1  # Linux's MAX_ARG_STRLEN for one NAME=value string, its NUL included


def check_engine_env(env: dict[str, str]) -> dict[str, str]:
    """An ``env`` option as the engine's processes can be given it: names of letters, digits and
    ``_``, not bakeoff's own (``PYTHONPATH``, ``BAKEOFF_*``), values without NUL and within Linux's
    limit for one variable.

    Raises:
        ValueError: naming the variable and what to do (pydantic makes it the option's error).
    """
    for name, value in env.items():
        if not ENV_NAME.fullmatch(name):
            raise ValueError(f"env name {name[:40]!r} is not a variable name (letters, digits, _)")
        if name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIX):
            raise ValueError(f"env {name} is bakeoff's to set for the engine's processes (PYTHONPATH and BAKEOFF_* are); "
                             "set another variable")
        if "\0" in value:
            raise ValueError(f"env {name} holds a NUL byte, which no environment variable can carry")
        if len(f"{name}={value}".encode("utf-8", "surrogateescape")) > MAX_ENV_BYTES:
            raise ValueError(f"env {name} is longer than one variable may be ({MAX_ENV_BYTES:,} bytes); pass a file path")
    return env


EngineEnv = Annotated[dict[str, str], AfterValidator(check_engine_env)]


def _env_item(out: dict[str, Any], name: str, raw: str, flag: str, item: str) -> None:
    """``env.NAME=VALUE`` into ``out["env"][NAME]``, the value as text (never JSON: ``0|1`` stays ``0|1``)."""
    if not ENV_NAME.fullmatch(name):
        raise UserError(f"malformed {flag} {item!r}: env.NAME needs a variable name (letters, digits, _), "
                        f"e.g. {flag} env.OMP_NUM_THREADS=4")
    env = out.setdefault("env", {})
    if name in env:
        raise UserError(f"{flag} env.{name} given twice; pass it once")
    env[name] = raw


def _non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, (list, tuple, set)):
        return any(_non_finite(v) for v in value)
    return False


def _takes_bool(annotation: Any) -> bool:
    """Whether a field's type admits a bool (``bool``, ``bool | None``, ``Any``, a dict or list of anything)."""
    if annotation is bool or annotation is Any:
        return True
    args = typing.get_args(annotation)
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and any(_takes_bool(a) for a in args)


def parse_options(backend: str, model: type[BaseModel], options: dict[str, Any]) -> BaseModel:
    """Validate options against a backend's ``Options`` model.

    Raises:
        UserError: one line naming the bad key and the valid keys (a number that is NaN or
            infinite, e.g. ``inf`` given as text, is a bad value).
    """
    if "env" in options and "env" in model.model_fields and not isinstance(options["env"], dict):
        raise UserError(f"--backend-opt env takes one variable per item: env.NAME=VALUE, e.g. env.OMP_NUM_THREADS=4 "
                        f"(backend {backend})")
    try:
        parsed = model.model_validate(options)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err.get("loc", ())) or "?"
        if key.split(".")[0] == "env" and err.get("type") == "value_error":  # check_engine_env's own words
            raise UserError(f"--backend-opt {str(err.get('msg')).removeprefix('Value error, ')} "
                            f"(backend {backend})") from None
        valid = ", ".join(sorted(model.model_fields))
        if err.get("type") == "extra_forbidden":
            raise UserError(f"unknown option {key!r} for backend {backend}; valid options: {valid}") from None
        raise UserError(f"bad value for option {key!r} of backend {backend}: {err.get('msg')}; valid options: {valid}") from None
    except RecursionError:
        raise UserError(f"an option of backend {backend} is nested too deep; pass plain values") from None
    for key, value in options.items():  # pydantic's lax mode reads true as 1: a flag is no number
        if isinstance(value, bool) and key in model.model_fields and not _takes_bool(model.model_fields[key].annotation):
            valid = ", ".join(sorted(model.model_fields))
            raise UserError(f"bad value for option {key!r} of backend {backend}: {str(value).lower()} is not a number or "
                            f"text; valid options: {valid}")
    for key in parsed.model_fields_set:
        if _non_finite(getattr(parsed, key)):
            raise UserError(f"bad value for option {key!r} of backend {backend}: not a finite number; pass a finite value")
    return parsed


def split_backend_opts(items: list[str], backends_: list[str], flag: str = "--backend-opt",
                       prefixes: bool = True) -> dict[str, dict[str, Any]]:
    """``[BACKEND:]KEY=VALUE`` items -> parsed options per backend (no prefix: every backend).

    Raises:
        UserError: a malformed item, a key given twice for one backend, a prefix that names a
            backend not among ``backends_``.
    """
    per: dict[str, list[str]] = {b: [] for b in backends_}
    for item in items:
        head, sep, rest = item.partition(":")
        if prefixes and sep and "=" not in head and head in per:
            per[head].append(rest)
        elif prefixes and sep and "=" not in head and head not in per:
            raise UserError(f"{flag} {item!r} names backend {head!r}, which is not among --backends {','.join(backends_)}")
        else:
            for b in per:
                per[b].append(item)
    return {b: parse_kv(opts, flag) for b, opts in per.items()}
