"""Credentials masked out of everything ctrain prints or raises: command lines, tool output, log lines.

One function (:func:`redact`) for text and one (:func:`redact_command`) for argument lists, used by
:class:`ctrain.errors.CommandError`, :func:`ctrain.proc.stream`, :func:`ctrain.ui.info` and the CLI's
error printer, so a password in a setting (``https://user:PASS@host/simple``) never reaches a
terminal or a log file, whichever command or message would have shown it.

Masked: a URL's ``user:password@`` (and a lone ``token@`` in http(s) URLs), ``--creds``/``--password``
style option values, ``password=``/``token:`` style values (including ``HF_TOKEN=``-style variables),
and ``Authorization``/``Bearer`` header values. Plain user names (``ssh://alice@host``) stay
readable. Masking twice gives the same text.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

MASK = "***"
# Options whose next argument (or ``=value``) is a secret.
SECRET_OPTIONS = frozenset(
    {"--creds", "--src-creds", "--dest-creds", "--password", "--passphrase", "--token", "--registry-token"}
)
_KEYS = (
    r"password|passwd|passphrase|token|secret|api[_-]?key|access[_-]?key|secret[_-]?key|"
    r"access[_-]?token|auth[_-]?token|private[_-]?token|client[_-]?secret"
)
_VALUE = r"[^\s&'\"]+"
_SCHEMES = r"(?:bearer|basic|token|digest|negotiate)"
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # scheme://user:password@ (any scheme; up to the last @ of the authority, should the password
    # hold an unencoded one; a digest after @ is an image reference, not a password)
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@:'\"]*:[^/\s'\"]*@(?!sha256:|sha512:)"), rf"\1{MASK}:{MASK}@"),
    # http(s)://token@ (a token as the user name, as GitHub and GitLab take them)
    (re.compile(r"(?i)\b((?:[a-z0-9.-]+\+)?https?://)(?!\*\*\*)[^/\s@:'\"]+@"), rf"\1{MASK}@"),
    # --creds USER:PASS, --password=PASS
    (re.compile(rf"(?i)((?:{'|'.join(map(re.escape, sorted(SECRET_OPTIONS)))})(?:=|\s+)){_VALUE}"), rf"\1{MASK}"),
    # Authorization: [Scheme ]VALUE
    (re.compile(rf"(?i)\b(authorization[\"']?\s*[:=]\s*[\"']?(?:{_SCHEMES}\s+)?)[^\s'\"]+"), rf"\1{MASK}"),
    # Bearer TOKEN, wherever it appears
    (re.compile(r"(?i)\b(bearer\s+)[\w.~+/=-]+"), rf"\1{MASK}"),
    # password=..., token: ..., "access_token": "..." (not pad_token=, not /etc/passwd:)
    (re.compile(rf"(?i)(?<![\w/.-])((?:{_KEYS})[\"']?\s*[=:]\s*[\"']?){_VALUE}"), rf"\1{MASK}"),
    # environment-style names: HF_TOKEN=..., AWS_SECRET_ACCESS_KEY=..., PIP_PASSWORD=...
    (re.compile(rf"\b([A-Z0-9_]*_(?:TOKEN|PASSWORD|PASSWD|SECRET|API_KEY|ACCESS_KEY|SECRET_KEY)=){_VALUE}"),
     rf"\1{MASK}"),
)


def redact(text: str) -> str:
    """``text`` with every credential masked (see the module docstring for what counts)."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def redact_command(args: Sequence[str | os.PathLike[str]]) -> list[str]:
    """An argument list as it may be printed: each argument masked, and the value after a
    secret-taking option (``--creds USER:PASS``) replaced whole."""
    out: list[str] = []
    for arg in map(os.fspath, args):
        out.append(MASK if out and out[-1] in SECRET_OPTIONS else redact(arg))
    return out


__all__ = ["MASK", "redact", "redact_command"]
