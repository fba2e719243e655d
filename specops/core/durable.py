"""Durable replacement of files: write a temporary file, fsync it, rename it over the old one, fsync the folder.

A rename is atomic, so a reader sees the old file or the new one, never a mix. It survives a power cut only
when the new file's bytes reached the disk before the rename (else the new name may point at an empty file)
and the folder's entry was synced after it (else the rename itself may be lost).
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(folder: Path) -> None:
    """Sync a folder's entries: the names created, renamed or removed in it."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def fsync_tree(folder: Path) -> None:
    """Sync every file and folder under `folder`, before a rename or a link makes it visible."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fsync_file(path)
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(folder)


def replace_durably(tmp: Path, path: Path) -> None:
    """os.replace(tmp, path) once tmp's bytes are on disk, then sync the folder so the rename is too."""
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_text_durably(path: Path, text: str) -> None:
    """Replace `path` by `text`: a crash at any moment leaves the old content or the new, never a torn file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    replace_durably(tmp, path)
