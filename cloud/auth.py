"""Optional bearer-token access control for the template API.

Tokens come from a file (``--tokens-file``) or the ``SAKURA_TOKENS`` environment variable.
One entry per line (in the variable, entries may also be separated by ``;``)::

    # comment
    s3cr3t-token-for-everything
    partner-token   face-swap-01,try-on-02      # only these template ids

A token is an RFC 6750 ``b64token`` (``[A-Za-z0-9._~+/-]+=*``) of at least 16 characters.
Clients send ``Authorization: Bearer <token>``. Verification hashes the presented token and
compares it with every configured token's hash using :func:`hmac.compare_digest`, without
early exit, so timing reveals neither which token nor how much of it matched.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sakura.cloud.errors import AuthConfigError
from sakura.cloud.layout import valid_template_id

TOKENS_ENV = "SAKURA_TOKENS"
MIN_TOKEN_LENGTH = 16
_TOKEN_RE = re.compile(r"^[A-Za-z0-9._~+/-]+=*$")


@dataclass(frozen=True)
class Grant:
    """What a verified token may access: every template (``templates is None``) or a set."""

    templates: frozenset[str] | None = None

    def allows(self, template_id: str) -> bool:
        return self.templates is None or template_id in self.templates


@dataclass(frozen=True)
class TokenSet:
    """Configured tokens, stored only as SHA-256 digests, each with its grant."""

    entries: tuple[tuple[bytes, Grant], ...] = field(default=())

    def __len__(self) -> int:
        return len(self.entries)

    @classmethod
    def from_mapping(cls, tokens: Mapping[str, Iterable[str] | None]) -> TokenSet:
        """``{token: None}`` grants everything, ``{token: ["id1", "id2"]}`` those templates."""
        entries = []
        for token, scope in tokens.items():
            _check_token(token, "token")
            grant = Grant(None if scope is None else frozenset(_check_ids(scope, "token scope")))
            entries.append((_digest(token), grant))
        if not entries:
            raise AuthConfigError("no tokens configured")
        return cls(tuple(entries))

    @classmethod
    def parse(cls, text: str, source: str = "tokens") -> TokenSet:
        """Parse the tokens-file format (see module docstring)."""
        tokens: dict[str, list[str] | None] = {}
        for lineno, raw in enumerate(re.split(r"[\n;]", text), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split(None, 1)
            token = parts[0]
            where = f"{source} entry {lineno}"
            _check_token(token, where)
            scope = None
            if len(parts) == 2:
                scope = [s.strip() for s in parts[1].split(",") if s.strip()]
                _check_ids(scope, where)
            if token in tokens:
                raise AuthConfigError(f"{where}: duplicate token")
            tokens[token] = scope
        if not tokens:
            raise AuthConfigError(f"{source} holds no tokens")
        return cls.from_mapping(tokens)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> TokenSet:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise AuthConfigError(f"cannot read tokens file {path}: {exc}") from exc
        return cls.parse(text, f"tokens file {path}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TokenSet | None:
        value = (os.environ if environ is None else environ).get(TOKENS_ENV)
        if value is None:
            return None
        # set but blank (e.g. an empty secret in a deployment): refuse to start without
        # auth; unset the variable for an open API
        if not value.strip():
            raise AuthConfigError(f"${TOKENS_ENV} is set but holds no tokens; unset it to "
                                  "serve without auth")
        return cls.parse(value, f"${TOKENS_ENV}")

    def verify(self, token: str | None) -> Grant | None:
        """The grant of ``token``, or ``None`` if it is missing or unknown (constant time)."""
        presented = _digest(token or "")
        found: Grant | None = None
        for digest, grant in self.entries:
            if hmac.compare_digest(digest, presented):
                found = grant
        return found if token else None


def load_tokens(
    tokens_file: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> TokenSet | None:
    """Tokens from ``tokens_file`` if given, else from ``$SAKURA_TOKENS``, else ``None`` (open)."""
    if tokens_file is not None:
        return TokenSet.from_file(tokens_file)
    return TokenSet.from_env(environ)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive)."""
    if not authorization:
        return None
    parts = authorization.strip().split(None, 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    token = parts[1].strip()
    return token if _TOKEN_RE.fullmatch(token) else None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def _check_token(token: str, where: str) -> None:
    if not isinstance(token, str) or not _TOKEN_RE.fullmatch(token):
        raise AuthConfigError(f"{where}: a token must match [A-Za-z0-9._~+/-]+=*")
    if len(token) < MIN_TOKEN_LENGTH:
        raise AuthConfigError(f"{where}: a token must have at least {MIN_TOKEN_LENGTH} characters")


def _check_ids(ids: Iterable[str], where: str) -> list[str]:
    ids = list(ids)
    for template_id in ids:
        if not valid_template_id(template_id):
            raise AuthConfigError(f"{where}: invalid template id {template_id[:80]!r}")
    if not ids:
        raise AuthConfigError(f"{where}: empty template scope")
    return ids
