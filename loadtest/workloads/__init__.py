"""Workloads: where prompts and output lengths come from."""
