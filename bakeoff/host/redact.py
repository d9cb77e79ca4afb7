"""One redaction step for everything bakeoff writes (tokens, API keys, Authorization headers)."""

from __future__ import annotations

import os
import re

SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|APIKEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL)", re.I)
PATTERNS = [
    re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"),
    re.compile(r"\bsk-(?:ant-)?[A-Za-z0-9_\-]{16,}\b"),
    # header forms: `Authorization: Bearer x`, `authorization=x`, JSON/dict `"Authorization": "Bearer x"`
    re.compile(r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?)(bearer\s+)?[^\s\"',}]+"),
    re.compile(r"(?i)(x-api-key[\"']?\s*[:=]\s*[\"']?)[^\s\"',}]+"),
]
MASK = "***REDACTED***"


def secret_values(environ: dict[str, str] | None = None) -> list[str]:
    """Values of environment variables whose names look secret, longest first.

    Args:
        environ: mapping to read (defaults to ``os.environ``).

    Returns:
        Values of at least 6 characters, so that short flags are not masked everywhere.
    """
    env = os.environ if environ is None else environ
    vals = {v for k, v in env.items() if SECRET_NAME.search(k) and v and len(v) >= 6}
    return sorted(vals, key=len, reverse=True)


def redact(text: str, environ: dict[str, str] | None = None) -> str:
    """Mask secret values and secret-looking patterns in ``text``.

    Args:
        text: any text about to be written.
        environ: environment to take secret values from (defaults to ``os.environ``).

    Returns:
        The text with each secret replaced by ``***REDACTED***``.
    """
    for value in secret_values(environ):
        text = text.replace(value, MASK)
    for pat in PATTERNS:
        if pat.groups:
            text = pat.sub(lambda m: (m.group(1) or "") + MASK, text)
        else:
            text = pat.sub(MASK, text)
    return text


def redact_env(environ: dict[str, str]) -> dict[str, str]:
    """Copy of an environment mapping with secret-named values masked."""
    return {k: (MASK if SECRET_NAME.search(k) else redact(v)) for k, v in environ.items()}
