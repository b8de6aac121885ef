"""Lower the kernels' Triton code for an sm_90 GPU on a machine without one.

Triton's CPU interpreter (what the kernel tests run on the CPU) executes a kernel's Python
body and never runs Triton's code generator, so it accepts code the GPU compiler refuses: a
name whose type an `if` or a loop changes, a plain module global read inside @triton.jit.
The code generator itself (AST -> TTIR, then the TTIR and TTGIR passes for the target) needs
no GPU. Here every launch `fn[grid](...)` made while a launch catalogue runs
(tests/helpers/kernel_launch_cases.py) is turned into what JITFunction.run would compile on
an H100: the argument signature and specialisation from Triton's own binder for a
cuda sm_90 backend (tensor dtype -> "*bf16", int -> "i32"/"i64" by range, 16-byte alignment,
constexpr values), the launch options (num_warps, num_stages, launch_pdl), and then it is
lowered. Nothing executes: launches return None, so a wrapper runs on empty CPU tensors.

Run as a script (not `-m`, so that PYTHONPATH alone decides where `kernels` comes from):
    python tests/helpers/triton_lowering.py [--groups a,b] [--stages ttir,ttgir] OUT.json
It must run without TRITON_INTERPRET (the kernels must be real JITFunctions)."""
from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TARGET_ARCH = 90  # H100 / H200
FUNC_RE = re.compile(r"tt\.func (?:public |private )?@([\w.]+?)(?:__|\()")


# -- what the source says is launched -------------------------------------------------------------
def _jit_defs(tree: ast.Module) -> list[str]:
    def is_jit(dec):
        target = dec.func if isinstance(dec, ast.Call) else dec
        return isinstance(target, ast.Attribute) and target.attr == "jit"
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and any(map(is_jit, n.decorator_list))]


def jit_functions(kernels_dir: Path) -> dict[str, set[str]]:
    """{module: names of its @triton.jit functions} for kernels_dir/triton_*.py."""
    out = {}
    for path in sorted(kernels_dir.glob("triton_*.py")):
        out[f"kernels.{path.stem}"] = set(_jit_defs(ast.parse(path.read_text())))
    return out


def launched_kernels(kernels_dir: Path) -> set[tuple[str, str]]:
    """(module, kernel) for every jit function of kernels_dir/triton_*.py that its module
    launches with a grid: `kernel[grid](...)`."""
    found = set()
    for path in sorted(kernels_dir.glob("triton_*.py")):
        tree = ast.parse(path.read_text())
        jits = set(_jit_defs(tree))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in jits):
                found.add((f"kernels.{path.stem}", node.func.value.id))
    return found


# -- recording launches -----------------------------------------------------------------------------
@dataclass
class Launch:
    """One launch as the GPU would compile it (JITFunction.run's _pack_args)."""
    fn: Any  # the JITFunction
    signature: dict[str, str]
    constexprs: dict[tuple, Any]
    attrs: dict[tuple, Any]
    options: Any  # the backend's parsed options
    group: str  # the catalogue group that launched it

    @property
    def name(self) -> str:
        return f"{self.fn.__module__}.{self.fn.__name__}"

    def key(self) -> str:
        """What decides the TTIR: types, constexprs (specialised ints equal to 1 included) and
        options; not the alignment attributes, which only annotate it."""
        return repr((self.name, sorted(self.signature.items()), sorted(self.constexprs.items()),
                     sorted(self.options.__dict__.items())))

    def describe(self) -> str:
        names = list(self.signature)
        const = {names[p[0]]: v for p, v in self.constexprs.items() if len(p) == 1}
        sig = {k: v for k, v in self.signature.items() if v != "constexpr"}
        return (f"{self.name} (catalogue group {self.group!r})\n  signature: {sig}\n  constexprs: {const}\n"
                f"  num_warps={self.options.num_warps} num_stages={self.options.num_stages} "
                f"launch_pdl={getattr(self.options, 'launch_pdl', False)}")


@dataclass
class Recorder:
    """Replaces JITFunction.run while active: each launch is bound by Triton's binder for
    the GPU target and kept; nothing runs."""
    backend: Any
    launches: list[Launch] = field(default_factory=list)
    group: str = ""

    def __enter__(self):
        from triton.runtime.jit import JITFunction, create_function_from_signature
        recorder = self
        binders = {}

        def run(fn, *args, grid, warmup, **kwargs):
            if fn not in binders:
                binders[fn] = create_function_from_signature(fn.signature, fn.params, recorder.backend)
            bound, spec, options = binders[fn](*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(recorder.backend, kwargs, bound, spec, options)
            recorder.launches.append(Launch(fn, signature, constexprs, attrs, options, recorder.group))
            return None

        self._saved = JITFunction.run
        JITFunction.run = run
        return self

    def __exit__(self, *exc):
        from triton.runtime.jit import JITFunction
        JITFunction.run = self._saved
        return False


# -- lowering ---------------------------------------------------------------------------------------
@dataclass
class Lowered:
    launch: Launch
    error: str | None
    functions: list[str]  # qualified names of the jit functions in its TTIR (kernel and helpers)
    seconds: float


def _explain(e: BaseException) -> str:
    """The error and its causes, innermost last: a failure inside a called @triton.jit
    function is raised at the call site, with the real reason chained below it."""
    parts = []
    while e is not None and len(parts) < 8:
        parts.append(f"{type(e).__name__}: {e}".strip())
        e = e.__cause__ or e.__context__
    return "\n  caused by ".join(parts)


def lower(launch: Launch, backend, target, stages: list[str]) -> Lowered:
    """AST -> TTIR as JITFunction would compile it, then the given backend stages."""
    from triton.compiler import ASTSource
    from triton._C.libtriton import ir

    t0 = time.perf_counter()
    functions: list[str] = []
    try:
        ctx = ir.context()
        ir.load_dialects(ctx)
        backend.load_dialects(ctx)
        src = ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs)
        opts = launch.options
        module = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), ctx)
        functions = FUNC_RE.findall(str(module))
        passes: dict = {}
        backend.add_stages(passes, opts, src.language)
        metadata: dict = {}
        for stage in stages:
            module = passes[stage](module, metadata)
        del module
        error = None
    except Exception as e:  # Triton's CompilationError carries the source line and the reason
        error = _explain(e)
    return Lowered(launch, error, functions, time.perf_counter() - t0)


def run_catalogue(groups: list[str] | None, stages: list[str], first_stages: list[str]) -> dict:
    """Records the catalogue's launches, lowers each distinct one through `stages` and the
    first launch of each kernel through `first_stages` (the TTGIR passes cost ~0.15 s a
    launch: too much for all of them)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    from tests.helpers.kernel_launch_cases import GROUPS

    target = GPUTarget("cuda", TARGET_ARCH, 32)
    backend = make_backend(target)
    t0 = time.perf_counter()
    group_errors = {}
    with Recorder(backend) as rec:
        for name, cases in GROUPS.items():
            if groups and name not in groups:
                continue
            rec.group = name
            try:
                cases()
            except Exception:  # a wrapper that cannot even be called is a failure of its own
                group_errors[name] = traceback.format_exc()
    t_record = time.perf_counter() - t0
    unique: dict[str, Launch] = {}
    for launch in rec.launches:
        unique.setdefault(launch.key(), launch)
    seen: set[str] = set()
    results = []
    for launch in unique.values():
        results.append(lower(launch, backend, target, stages if launch.name in seen else first_stages))
        seen.add(launch.name)
    import kernels
    return {
        "kernels_package": str(Path(kernels.__file__).parent),
        "launches": len(rec.launches),
        "unique": len(unique),
        "record_s": round(t_record, 2),
        "lower_s": round(time.perf_counter() - t0 - t_record, 2),
        "group_errors": group_errors,
        "kernels": sorted({r.launch.name for r in results}),
        # device functions by qualified name (a kernel's own entry appears by its bare name)
        "functions": sorted({f for r in results for f in r.functions if "." in f}),
        "failures": [{"kernel": r.launch.name, "launch": r.launch.describe(), "error": r.error}
                     for r in results if r.error],
        "slowest": sorted(((round(r.seconds, 3), r.launch.name) for r in results), reverse=True)[:5],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="JSON report path")
    p.add_argument("--groups", default="", help="catalogue groups to run (comma-separated; default all)")
    p.add_argument("--stages", default="ttir", help="backend stages after AST -> TTIR, every launch")
    p.add_argument("--first-stages", default="ttir,ttgir", help="the same for each kernel's first launch")
    a = p.parse_args(argv)
    split = lambda v: [s for s in v.split(",") if s]  # noqa: E731
    report = run_catalogue(split(a.groups) or None, split(a.stages), split(a.first_stages))
    Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    # as a script, sys.path[0] is this folder: the repo (or a scratch copy of kernels/ ahead
    # of it on PYTHONPATH) must be importable
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.exit(main())
