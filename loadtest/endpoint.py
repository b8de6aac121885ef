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


def _list_models(base: str, headers: dict[str, str], timeout_s: float) -> list[dict]:
    resp = httpx.get(f"{base}/models", headers=headers, timeout=timeout_s)
    resp.raise_for_status()
    return resp.json().get("data") or []


def discover_model(base: str, headers: dict[str, str], timeout_s: float = 30.0) -> str:
    """The first model /v1/models lists; a clear error when the server will not say."""
    try:
        models = _list_models(base, headers, timeout_s)
    except (httpx.HTTPError, ValueError) as e:
        raise SystemExit(f"could not list models at {base}/models ({e}); pass --model NAME") from e
    if not models:
        raise SystemExit(f"{base}/models lists no models; pass --model NAME")
    return models[0]["id"]


def served_context_len(base: str, headers: dict[str, str], model: str, timeout_s: float = 30.0) -> int | None:
    """The model's context length as /v1/models states it (`max_model_len`: Duet, vLLM, SGLang),
    or None when the server does not say."""
    try:
        models = _list_models(base, headers, timeout_s)
    except (httpx.HTTPError, ValueError):
        return None
    for card in models:
        if card.get("id") == model and isinstance(card.get("max_model_len"), int):
            return card["max_model_len"]
    return None
