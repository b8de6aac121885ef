"""OpenAI-compatible request models (chat completions, completions) and their checks.

Modules (import them directly; this file stays free of imports):
  errors    InvalidRequest: a 400-class problem with the request, naming the param
  requests  pydantic models of the request bodies, parse_chat_request / parse_completion_request
"""
