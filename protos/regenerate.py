"""Regenerate the committed gRPC/protobuf code from duet.proto.

Run from anywhere: `python protos/regenerate.py` (needs grpcio-tools).

protoc is run with the repository root as include path, so the generated
modules import each other as `protos.duet_pb2` and the descriptor file is named
`protos/duet.proto`. The version guards that protoc writes (runtime protobuf >=
the compiler's protobuf, grpcio >= grpcio-tools) are then lowered to the floors
in pyproject.toml, because the committed files must import on machines whose
protobuf/grpcio are older than the tools that generated them (see README.md).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTOS_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTOS_DIR.parent
PROTO_FILE = "protos/duet.proto"

# Oldest runtimes the generated code is known to work with (pyproject floors).
MIN_PROTOBUF = (6, 30, 0)
MIN_GRPCIO = "1.66.0"

_PB2_GUARD = re.compile(
    r"_runtime_version\.ValidateProtobufRuntimeVersion\(\s*"
    r"_runtime_version\.Domain\.PUBLIC,\s*\d+,\s*\d+,\s*\d+,\s*'',"
)
_GRPC_GUARD = re.compile(r"GRPC_GENERATED_VERSION = '[0-9.]+'")


def relax_version_guards(pb2_text: str, grpc_text: str) -> tuple[str, str]:
    """Lower the generated runtime-version checks to our supported floors."""
    major, minor, patch = MIN_PROTOBUF
    pb2_new, n_pb2 = _PB2_GUARD.subn(
        "_runtime_version.ValidateProtobufRuntimeVersion(\n"
        f"    _runtime_version.Domain.PUBLIC,\n    {major},\n    {minor},\n    {patch},\n    '',",
        pb2_text,
    )
    grpc_new, n_grpc = _GRPC_GUARD.subn(f"GRPC_GENERATED_VERSION = '{MIN_GRPCIO}'", grpc_text)
    if n_pb2 != 1 or n_grpc != 1:
        raise RuntimeError(
            f"generated code changed shape: found {n_pb2} protobuf and {n_grpc} grpc version "
            "guards (expected 1 each); update relax_version_guards()"
        )
    note = "# Version guard lowered by protos/regenerate.py (see protos/README.md).\n"
    return note + pb2_new, note + grpc_new


def run_protoc(out_dir: Path, *, with_pyi: bool = True) -> None:
    """Compile duet.proto into out_dir/protos/ with grpc_tools.

    Never import grpc_tools into a process that has NIXL loaded: their native
    libraries clash and the process crashes (seen with grpcio-tools 1.85 + nixl 1.5)."""
    from grpc_tools import protoc  # imported here: only needed to regenerate
    import importlib.resources

    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{REPO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
    ]
    if with_pyi:
        args.append(f"--pyi_out={out_dir}")
    args.append(str(REPO_ROOT / PROTO_FILE))
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_FILE}")


def regenerate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Generate, relax guards and write protos/duet_pb2*.py under out_dir."""
    run_protoc(out_dir)
    target = out_dir / "protos"
    pb2, grpc_file = target / "duet_pb2.py", target / "duet_pb2_grpc.py"
    pb2_text, grpc_text = relax_version_guards(pb2.read_text(), grpc_file.read_text())
    pb2.write_text(pb2_text)
    grpc_file.write_text(grpc_text)
    return [pb2, grpc_file, target / "duet_pb2.pyi"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT,
                        help="root to write protos/ into (default: the repository)")
    args = parser.parse_args(argv)
    for path in regenerate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
