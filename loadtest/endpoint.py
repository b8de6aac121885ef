"""Where the server is: the API base URL and the model it serves."""
from __future__ import annotations

from urllib.parse import urlsplit

import httpx


def api_base(base_url: str) -> str:
    """`http://host:8000` and `http://host:8000/v1` both mean the /v1 API; any other
    path (a proxy prefix such as /openai/v1) is taken as given."""
    url = base_url.rstrip("/")
    if urlsplit(url).path in ("", "/"):
        url += "/v1"
    return url


def discover_model(base: str, headers: dict[str, str], timeout_s: float = 30.0) -> str:
    """The first model /v1/models lists; a clear error when the server will not say."""
    try:
        resp = httpx.get(f"{base}/models", headers=headers, timeout=timeout_s)
        resp.raise_for_status()
        models = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise SystemExit(f"could not list models at {base}/models ({e}); pass --model NAME") from e
    if not models:
        raise SystemExit(f"{base}/models lists no models; pass --model NAME")
    return models[0]["id"]
