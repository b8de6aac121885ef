"""Secrets mounted as files (Kubernetes Secret volumes), and keeping secrets out of logs."""
from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit, urlunsplit


def read_secret_file(path: str | Path, what: str) -> str:
    """The file's text without surrounding whitespace; a clear error (naming the path, never
    the content) when it is missing or empty."""
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from None
    if not text:
        raise ValueError(f"the {what} file {path} is empty")
    return text


def read_pem(path: str | Path, what: str) -> bytes:
    """A PEM file's bytes (certificate, key or CA bundle), checked to look like PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"the {what} file {path} is not PEM")
    return data


def redact_url(url: str | None) -> str:
    """The URL with any password replaced by '***' (redis://:pw@host -> redis://:***@host)."""
    if not url:
        return str(url)
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
