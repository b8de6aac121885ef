"""The OpenAI API on top of a backend: the endpoints, prompts from the chat template,
sampling and structured-output grammars from a request, tool calls into the prompt and out
of the answer, stop strings, detokenized generation streams, and the response objects of
chat completions, completions and the Responses API."""
