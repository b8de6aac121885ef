"""Nothing in the repository cites what the repository does not hold.

Over every tracked text file (code, docs, manifests, scripts):
  * a relative markdown link `[text](target)` in a .md file points at a file or folder here;
  * a link's `#anchor` and a cited section (`docs/ARCHITECTURE.md, "Failure rules"`) name a
    heading of that document;
  * a path under a top-level folder (`docs/...`, `shared/...`, `tests/...`, ...) names a file
    or folder here, as does every path to a `.md` file and every doc cited by an upper-case
    `NAME.md` (relative to the citing file's folder or to the repository root);
  * no notes kept outside the repository are named: the team's handbook and method notes,
    the machine catalogue, absolute paths of a development machine, an issue tracker's numbers
    or the GPU-lending tool's machine kinds. The architecture is docs/ARCHITECTURE.md.

A path followed by `*`, `{` or `<` is a pattern (`tests/kernels/test_kernels_*.py`), not a citation."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".pyi", ".md", ".yaml", ".yml", ".proto", ".toml", ".sh", ".cfg", ".ini", ".txt",
                 ".dockerignore", ".gitignore"}
TEXT_NAMES = {"Dockerfile", "run"}
TOP_FOLDERS = ("docs", "services", "shared", "kernels", "protos", "loadtest", "tests", "k8s", ".ci")

# Split so that this file does not cite them itself.
FORBIDDEN = {
    "the team's handbook": re.compile("DESIGN" + r"\.md"),
    "method notes": re.compile("METHOD" + r"\.md"),
    "GPU notes kept outside": re.compile("HOPPER" + r"\.md"),
    "the machine catalogue": re.compile("KINDS" + r"\.md"),
    "an absolute path of a development machine": re.compile(r"(?<![\w.-])/" + "work/"),
    "an issue tracker's number": re.compile(r"\b[Ii]ssue" + r"s? #?\d+"),
    "the GPU-lending tool's machine kinds": re.compile(r"\bnvidia-h[12]00" + r"(-x\d)?\b"),
}

_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_TOP_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*[\w-])(?![\w*{<$])" % "|".join(re.escape(t) for t in TOP_FOLDERS))
_SECTION = re.compile(r'(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.md),? "([^"\n]+)"')
_MD_PATH = re.compile(r"(?<![\w./-])((?:\.{1,2}/)*(?:[\w.-]+/)*([\w.-]+)\.md)\b(?![*{<$])")


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return sorted({f for f in out.splitlines() if (REPO / f).is_file()})


def text_files(files: list[str]) -> list[str]:
    """The files to read: text, and not this test (it names what must not be named)."""
    return [f for f in files if (Path(f).suffix in TEXT_SUFFIXES or Path(f).name in TEXT_NAMES)
            and f != "tests/repo/test_docs_links.py"]


def read_texts(files: list[str]) -> dict[str, str]:
    return {f: (REPO / f).read_text(errors="replace") for f in text_files(files)}


def _exists(target: Path, files: set[str], folders: set[str]) -> bool:
    try:
        rel = target.resolve().relative_to(REPO).as_posix()
    except ValueError:  # outside the repository
        return False
    return rel in files or rel in folders


def _index(files) -> tuple[set[str], set[str]]:
    folders = {"."}
    for f in files:
        folders.update(p.as_posix() for p in Path(f).parents)
    return set(files), folders


def headings(md: Path) -> list[str]:
    """The headings of a markdown file (fenced code left out)."""
    found, fenced = [], False
    for line in md.read_text(errors="replace").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.append(line.lstrip("#").strip())
    return found


def slug(heading: str) -> str:
    """The anchor GitHub makes of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _resolve_md(path: str, here: Path, names: set[str], folders: set[str]) -> Path | None:
    for base in (here, REPO):
        if (base / path).suffix == ".md" and _exists(base / path, names, folders):
            return (base / path).resolve()
    return None


def broken_citations(files: list[str], texts: dict[str, str]) -> list[str]:
    """files: what the repository holds; texts: path -> content of the files to check."""
    names, folders = _index(files)
    problems = []
    for f, text in texts.items():
        here = (REPO / f).parent
        for n, line in enumerate(text.splitlines(), 1):
            where = f"{f}:{n}"
            if f.endswith(".md"):
                for target in _LINK.findall(line):
                    if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                        continue  # a URL
                    path, _, anchor = target.partition("#")
                    if path.startswith("/") or not _exists(here / (path or Path(f).name), names, folders):
                        problems.append(f"{where}: link to {target} (not in the repository)")
                    elif anchor and anchor not in {slug(h) for h in headings(here / (path or Path(f).name))}:
                        problems.append(f"{where}: link to {target} (no such heading)")
            for path, section in _SECTION.findall(line):
                md = _resolve_md(path, here, names, folders)
                if md is not None and not any(section in h for h in headings(md)):
                    problems.append(f'{where}: cites {path}, "{section}" (no such heading)')
            for path in _TOP_PATH.findall(line):
                path = path.rstrip(".")
                # `shared/engine/sampler.gumbel_noise`, `kernels/rejection_sample`: a module (and a
                # name in it) written as a path
                module = path if "." not in Path(path).name else path.rsplit(".", 1)[0]
                forms = (path, f"{path}.py", f"{module}.py")
                if not any(_exists(REPO / form, names, folders) for form in forms):
                    problems.append(f"{where}: names {path} (not in the repository)")
            for path, stem in _MD_PATH.findall(line):
                cited = "/" in path or stem.isupper()
                if cited and not any(_exists(base / path, names, folders) for base in (here, REPO)):
                    problems.append(f"{where}: names {path} (not in the repository)")
    return problems


def forbidden_names(texts: dict[str, str]) -> list[str]:
    problems = []
    for f, text in texts.items():
        for n, line in enumerate(text.splitlines(), 1):
            for what, pattern in FORBIDDEN.items():
                if pattern.search(line):
                    problems.append(f"{f}:{n}: names {what}: {line.strip()[:120]}")
    return problems


def test_every_cited_path_and_link_is_in_the_repository():
    files = tracked_files()
    problems = broken_citations(files, read_texts(files))
    assert not problems, "\n".join(problems)


def test_nothing_outside_the_repository_is_named():
    problems = forbidden_names(read_texts(tracked_files()))
    assert not problems, "\n".join(problems)


def test_the_architecture_is_in_the_repository_and_linked_from_the_readme():
    assert (REPO / "docs" / "ARCHITECTURE.md").is_file()
    assert "](docs/ARCHITECTURE.md)" in (REPO / "README.md").read_text()


def test_the_checks_catch_what_they_are_for():
    files = tracked_files()
    probe = {"tests/probe.md": "[ok](../docs/ARCHITECTURE.md) [gone](../docs/NOPE.md) see shared/nope.py and\n"
                               "NOTES_X.md; tests/test_kernels_*.py is a pattern, [web](https://example.com/a.md),\n"
                               "out.md is an output, docs/README.md and README.md are here, so are shared/engine/sampler.sample\n"
                               "[a](../docs/ARCHITECTURE.md#3-the-kv-handoff) [b](../docs/ARCHITECTURE.md#nope)\n"
                               'docs/ARCHITECTURE.md, "The engine step" docs/ARCHITECTURE.md, "No such part"\n'
                               "DES" + "IGN.md, issue" + " 12, nvidia-h100" + "-x1, /wo" + "rk/x\n"}
    assert sorted(broken_citations(files, probe)) == [
        "tests/probe.md:1: link to ../docs/NOPE.md (not in the repository)",
        "tests/probe.md:1: names ../docs/NOPE.md (not in the repository)",
        "tests/probe.md:1: names shared/nope.py (not in the repository)",
        "tests/probe.md:2: names NOTES_X.md (not in the repository)",
        "tests/probe.md:4: link to ../docs/ARCHITECTURE.md#nope (no such heading)",
        'tests/probe.md:5: cites docs/ARCHITECTURE.md, "No such part" (no such heading)',
        "tests/probe.md:6: names " + "DES" + "IGN.md (not in the repository)"]
    assert len(forbidden_names(probe)) == 4
