"""vLLM's released source distributions, fetched from the package index pip uses and read without installing.

The archive is cached outside the repository (`KIMI_EAGLE_CACHE`, default `~/.cache/kimi-eagle`) and checked
against the sha256 the index publishes; nothing of it is committed or installed. The index is the one pip is told
to use (`PIP_INDEX_URL`), else pip's own default, asked for in its JSON form (PEP 691).
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import urllib.request
from pathlib import Path

INDEX_TIMEOUT_S = 60


class SourceUnavailableError(RuntimeError):
    """The index could not be reached or has no such release; the message says which and why."""


def cache_dir() -> Path:
    return Path(os.environ.get("KIMI_EAGLE_CACHE", Path.home() / ".cache" / "kimi-eagle")) / "vllm-sdist"


def index_url() -> str:
    configured = os.environ.get("PIP_INDEX_URL")
    if configured:
        return configured.rstrip("/")
    from pip._internal.models.index import PyPI  # pip's default index, not named here

    return PyPI.simple_url.rstrip("/")


def _release_file(version: str) -> dict:
    request = urllib.request.Request(f"{index_url()}/vllm/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=INDEX_TIMEOUT_S) as response:
            files = json.load(response)["files"]
    except (OSError, ValueError, KeyError) as exc:
        raise SourceUnavailableError(f"the package index ({index_url()}) could not be read: {exc}") from None
    name = f"vllm-{version}.tar.gz"
    for entry in files:
        if entry["filename"] == name:
            return entry
    raise SourceUnavailableError(f"the package index has no {name} (vLLM's source distribution of {version})")


def sdist(version: str) -> Path:
    """vLLM `version`'s source distribution, from the cache or fetched once."""
    path = cache_dir() / f"vllm-{version}.tar.gz"
    if path.is_file():
        return path
    entry = _release_file(version)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(entry["url"], timeout=INDEX_TIMEOUT_S) as response, partial.open("wb") as out:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise SourceUnavailableError(f"vllm-{version}.tar.gz could not be fetched: {exc}") from None
    expected = entry.get("hashes", {}).get("sha256")
    if expected and digest.hexdigest() != expected:
        partial.unlink(missing_ok=True)
        raise SourceUnavailableError(f"vllm-{version}.tar.gz does not match the index's sha256 {expected}")
    partial.rename(path)
    return path


class SourceTree:
    """The files of one vLLM release, by their path inside the `vllm` package (`config/speculative.py`): from a
    source distribution, or from an installed package folder."""

    def __init__(self, version: str, archive: Path | None = None, package_dir: Path | None = None) -> None:
        self.version = version
        self._package_dir = package_dir
        self._members: dict[str, tarfile.TarInfo] = {}
        self._tar = tarfile.open(archive) if archive is not None else None  # noqa: SIM115 - read while the tree lives
        if self._tar is not None:
            for member in self._tar.getmembers():
                parts = member.name.split("/", 2)  # vllm-X/vllm/path
                if len(parts) == 3 and parts[1] == "vllm" and member.isfile():
                    self._members[parts[2]] = member

    @classmethod
    def release(cls, version: str) -> SourceTree:
        return cls(version, archive=sdist(version))

    @classmethod
    def installed(cls) -> SourceTree:
        import vllm

        return cls(vllm.__version__, package_dir=Path(vllm.__file__).parent)

    def read(self, path: str) -> str | None:
        if self._package_dir is not None:
            file = self._package_dir / path
            return file.read_text() if file.is_file() else None
        member = self._members.get(path)
        if member is None:
            return None
        handle = self._tar.extractfile(member)
        return handle.read().decode() if handle else None

    def module_source(self, module: str) -> tuple[str, str] | None:
        """(path, text) of a dotted `vllm.*` module, or None where the release has no such module."""
        relative = module.split(".", 1)[1].replace(".", "/") if "." in module else ""
        for path in (f"{relative}.py", f"{relative}/__init__.py"):
            text = self.read(path.lstrip("/"))
            if text is not None:
                return path, text
        return None
