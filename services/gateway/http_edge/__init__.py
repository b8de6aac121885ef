"""The gateway's HTTP edge: the FastAPI app and what guards it (connection and request
bounds, API keys, admission), OpenAI error responses, server-sent events, /openapi.json,
Prometheus metrics, and the limit and security settings."""
