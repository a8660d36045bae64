"""Crash-safe, verified sharded checkpoints with ``torch.distributed.checkpoint``.

A checkpoint directory holds versions and a pointer to the complete one::

    DIR/CURRENT            the name of the current version (replaced atomically)
    DIR/v-<id>/            DCP's files (one per rank, and .metadata)
    DIR/v-<id>/meta.json   the caller's metadata
    DIR/v-<id>/manifest.json  every file's size and SHA-256

``save_checkpoint`` writes a new version beside the old one and only then points ``CURRENT``
at it (``os.replace`` of a small file), so a process killed at any moment leaves the previous
checkpoint loadable; leftovers of an interrupted save are removed by the next save.
``load_checkpoint`` first checks the manifest (every file present, of its size and checksum)
and never writes to the directory; anything wrong is a ``CheckpointError`` whose one-line
message names the file and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

__all__ = [
    "CURRENT",
    "CheckpointError",
    "current_version",
    "load_checkpoint",
    "read_meta",
    "save_checkpoint",
    "verify_checkpoint",
]

CURRENT = "CURRENT"
MANIFEST = "manifest.json"
META = "meta.json"
KILL_AT_ENV = "FSDP_CHECKPOINT_KILL_AT"
"""Test hook: the save stage after which rank 0 kills its process group (``shards``,
``manifest``, ``current``), to prove that a kill at each stage loses nothing."""


class CheckpointError(Exception):
    """A checkpoint that is missing, incomplete or damaged; the message is one line."""


def _fsync_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _maybe_die(stage: str) -> None:
    if os.environ.get(KILL_AT_ENV) == stage and dist.get_rank() == 0:
        os.killpg(os.getpgid(0), 9)


def save_checkpoint(directory: Path, state: dict[str, Any], meta: dict[str, object]) -> Path:
    """Save ``state`` (a DCP state dict: DTensors, tensors, picklable values) as a new version of
    ``directory`` and make it current; a collective. Returns the version's directory."""
    rank = dist.get_rank()
    name = [f"v-{uuid.uuid4().hex[:12]}" if rank == 0 else ""]
    dist.broadcast_object_list(name, src=0)
    version = directory / name[0]
    if rank == 0:
        version.mkdir(parents=True)
    dist.barrier()
    dcp_save(state, checkpoint_id=str(version))
    dist.barrier()
    _maybe_die("shards")
    if rank == 0:
        _fsync_write(version / META, json.dumps(meta, indent=2))
        files = sorted(p for p in version.iterdir() if p.is_file() and p.name != MANIFEST)
        manifest = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
        _fsync_write(version / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
        _fsync_dir(version)
        _maybe_die("manifest")
        _fsync_write(directory / CURRENT, name[0] + "\n")
        _fsync_dir(directory)
        _maybe_die("current")
        for old in directory.iterdir():
            if old.is_dir() and old.name.startswith("v-") and old.name != name[0]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return version


def current_version(directory: Path) -> Path:
    """The version ``CURRENT`` points at; ``CheckpointError`` if there is none."""
    pointer = directory / CURRENT
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if not pointer.is_file():
        raise CheckpointError(f"{pointer}: missing; {directory} holds no complete checkpoint")
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{pointer}: unreadable ({exc.__class__.__name__})") from None
    if not name.startswith("v-") or "/" in name or not (directory / name).is_dir():
        raise CheckpointError(f"{pointer}: names {name[:40]!r}, which is not a version in {directory}")
    return directory / name


def _json(path: Path) -> object:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc.__class__.__name__})") from None


def verify_checkpoint(directory: Path) -> Path:
    """Check the current version against its manifest: every file listed is there with its size
    and SHA-256, and nothing else is. Reads only. Returns the version's directory."""
    version = current_version(directory)
    manifest = _json(version / MANIFEST)
    if not isinstance(manifest, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
        for v in manifest.values()
    ):
        raise CheckpointError(f"{version / MANIFEST}: not a manifest of file sizes and checksums")
    present = {p.name for p in version.iterdir() if p.is_file() and p.name != MANIFEST}
    for name in sorted(set(manifest) - present):
        raise CheckpointError(f"{version / name}: missing (listed in the manifest)")
    for name in sorted(present - set(manifest)):
        raise CheckpointError(f"{version / name}: not in the manifest")
    for name, entry in sorted(manifest.items()):
        path = version / name
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes, the manifest says {entry['bytes']} (truncated or extended)")
        if _sha256(path) != entry["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch (the file is damaged)")
    return version


def read_meta(directory: Path) -> dict[str, object]:
    """The current version's metadata, after verifying the version (no process group needed)."""
    version = verify_checkpoint(directory)
    meta = _json(version / META)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{version / META}: expected a JSON object")
    return meta


def load_checkpoint(
    directory: Path, state: dict[str, Any], verify: Callable[[Path], Path] = verify_checkpoint
) -> dict[str, object]:
    """Verify the current version (rank 0, the verdict broadcast) and load it into ``state`` in
    place (a collective); returns its metadata. Raises ``CheckpointError`` on every rank."""
    verdict: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            verdict[0] = str(verify(directory))
        except CheckpointError as exc:
            verdict[0] = exc
    dist.broadcast_object_list(verdict, src=0)
    if isinstance(verdict[0], CheckpointError):
        raise CheckpointError(str(verdict[0]))
    assert isinstance(verdict[0], str)
    version = Path(verdict[0])
    try:
        dcp_load(state, checkpoint_id=str(version))
    except Exception as exc:  # noqa: BLE001  (DCP's errors are long; the manifest passed, so say that)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise CheckpointError(
            f"{version}: verified, but torch.distributed.checkpoint could not load it: {first[:200]}"
        ) from None
    meta = _json(version / META)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{version / META}: expected a JSON object")
    return meta
