#!/usr/bin/env python
"""Generate the Python gRPC stubs for proto/splitserve/v1/*.proto.

Usage (from the repository root)::

    python scripts/gen_protos.py          # regenerate splitserve/v1/*_pb2*.py[i]
    python scripts/gen_protos.py --check  # exit 1 if the committed stubs are stale

Protos are compiled with ``-I proto`` so that generated modules import each
other as ``splitserve.v1.<name>_pb2``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PACKAGE_DIR = Path("splitserve") / "v1"
INIT_TEXT = '"""Generated protobuf / gRPC modules for splitserve.v1 (scripts/gen_protos.py)."""\n'
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """The .proto sources, relative to PROTO_ROOT, in a stable order."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def expected_outputs(out_dir: Path) -> list[Path]:
    """Paths generate() writes for the current .proto sources."""
    outs = [out_dir / PACKAGE_DIR / "__init__.py"]
    for proto in proto_files():
        stem = proto.with_suffix("")
        outs.extend(out_dir / f"{stem}{suffix}" for suffix in GENERATED_SUFFIXES)
    return sorted(outs)


def generated_files(out_dir: Path) -> list[Path]:
    """Generated files currently present under out_dir/splitserve/v1."""
    pkg = out_dir / PACKAGE_DIR
    if not pkg.is_dir():
        return []
    found = [p for p in pkg.iterdir() if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)]
    init = pkg / "__init__.py"
    if init.exists():
        found.append(init)
    return sorted(found)


def _well_known_include() -> str:
    """grpc_tools' bundled google/protobuf/*.proto include directory."""
    return str(resources.files("grpc_tools") / "_proto")


def generate(out_dir: Path) -> list[Path]:
    """Compile all protos into out_dir (package layout splitserve/v1/...).

    Also writes splitserve/v1/__init__.py if it is missing. Returns the
    generated paths, sorted.
    """
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    protos = proto_files()
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / PACKAGE_DIR}")
    (out_dir / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{_well_known_include()}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in protos),  # relative to -I proto: keeps import paths stable
    ]
    # protoc resolves the relative proto names against the -I roots.
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    init = out_dir / PACKAGE_DIR / "__init__.py"
    if not init.exists():
        init.write_text(INIT_TEXT)
    outs = expected_outputs(out_dir)
    missing = [p for p in outs if not p.exists()]
    if missing:
        raise RuntimeError(f"protoc did not produce: {', '.join(map(str, missing))}")
    return outs


def check(repo_root: Path = REPO_ROOT) -> list[str]:
    """Return a list of problems (stale, missing or extra generated files)."""
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        fresh = {p.relative_to(fresh_root) for p in generate(fresh_root)}
        committed = {p.relative_to(repo_root) for p in generated_files(repo_root)}
        for rel in sorted(fresh - committed):
            problems.append(f"missing: {rel}")
        for rel in sorted(committed - fresh):
            problems.append(f"extra (no matching .proto): {rel}")
        for rel in sorted(fresh & committed):
            if rel.name == "__init__.py":
                continue  # hand-editable; only its presence matters
            if (fresh_root / rel).read_bytes() != (repo_root / rel).read_bytes():
                problems.append(f"stale: {rel}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="verify the committed stubs are up to date; do not write",
    )
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        if problems:
            for line in problems:
                print(line, file=sys.stderr)
            print(
                "generated stubs are out of date: run `python scripts/gen_protos.py`",
                file=sys.stderr,
            )
            return 1
        print("generated stubs are up to date")
        return 0
    for path in generate(REPO_ROOT):
        print(path.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
