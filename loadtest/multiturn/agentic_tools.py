"""Tool definitions for the agentic workload: what a coding or operations agent is typically
given. Only their shape matters (they fill the shared prefix); nothing is ever executed."""
from __future__ import annotations


def _fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


def _s(description: str) -> dict:
    return {"type": "string", "description": description}


def _i(description: str) -> dict:
    return {"type": "integer", "description": description}


TOOLS: list[dict] = [
    _fn("search_code", "Search the repository for a regular expression and return matching lines with paths.",
        {"pattern": _s("regular expression to search for"), "path": _s("folder to search under"),
         "max_results": _i("stop after this many matches")}, ["pattern"]),
    _fn("read_file", "Read a file of the repository, optionally a range of lines.",
        {"path": _s("file path relative to the repository root"), "start_line": _i("first line, 1-based"),
         "end_line": _i("last line, inclusive")}, ["path"]),
    _fn("write_file", "Replace the whole content of a file, creating it if needed.",
        {"path": _s("file path relative to the repository root"), "content": _s("the new content")},
        ["path", "content"]),
    _fn("run_tests", "Run the test suite or a subset of it and return the summary and failures.",
        {"selector": _s("test file, class or function to run"), "timeout_s": _i("seconds before giving up"),
         "verbose": {"type": "boolean", "description": "print each test's name"}}, []),
    _fn("run_shell", "Run a shell command in the sandbox and return its exit code, stdout and stderr.",
        {"command": _s("the command line"), "cwd": _s("working folder"), "timeout_s": _i("seconds")},
        ["command"]),
    _fn("http_get", "Fetch a URL and return the status and the first part of the body.",
        {"url": _s("absolute URL"), "headers": {"type": "object", "description": "extra request headers"}},
        ["url"]),
    _fn("query_database", "Run a read-only SQL query against the analytics database.",
        {"sql": _s("a SELECT statement"), "limit": _i("row limit")}, ["sql"]),
    _fn("list_directory", "List the entries of a folder with their sizes and kinds.",
        {"path": _s("folder path"), "recursive": {"type": "boolean", "description": "descend into subfolders"}},
        ["path"]),
    _fn("create_ticket", "Open an issue in the tracker.",
        {"title": _s("one-line summary"), "body": _s("details in Markdown"),
         "priority": {"type": "string", "enum": ["low", "medium", "high"], "description": "urgency"}},
        ["title", "body"]),
    _fn("get_metrics", "Read a time series from the monitoring system.",
        {"query": _s("PromQL expression"), "minutes": _i("how far back to look"), "step_s": _i("resolution")},
        ["query"]),
]


def tool_set(n: int) -> list[dict]:
    """The first n tools; past the list, numbered copies (tool_2 ...) so the prefix can grow."""
    out = []
    for i in range(n):
        base = TOOLS[i % len(TOOLS)]
        if i < len(TOOLS):
            out.append(base)
        else:
            fn = dict(base["function"], name=f"{base['function']['name']}_{i // len(TOOLS) + 1}")
            out.append({"type": "function", "function": fn})
    return out
