"""What is wrong with a path a command was given, in words, before the command writes anything.

A command checks its path options up front (``swarmtrain.cli``), so a file given where a folder
belongs, or a folder below a file, is one line naming the flag, not errno's ``[Errno 17] File
exists`` from a ``mkdir`` half-way through a start. The checks read the file system only; what
they cannot foresee (a read-only or pseudo file system, a race) still fails where it is written,
and ``plain_os_error`` says that in words too.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path


class PathError(ValueError):
    """A path a command was given cannot be used; the message names the flag and the fix."""


class Use(enum.Enum):
    """How a command uses a path."""

    FOLDER = "folder"  # made if absent (--state-dir, --workdir)
    NEW_FOLDER = "new folder"  # made, or an empty one filled (export --out)
    FILE = "file"  # written, its folders made if absent (--identity, --json, init's PATH)
    CONFIG = "config"  # a run.toml to read (--config)
    EXISTING_FOLDER = "existing folder"  # read (--data-dir, export --state-dir)


def plain_os_error(exc: OSError, *, making: bool = False) -> str:
    """An OSError in words, without errno's number or the temporary file it happened on.
    ``making``: it came from making a file or folder whose folders were made first, where "no
    such file" means the file system takes no new ones there (/proc, /sys)."""
    # mkdir of a path that is a file says "file exists"; opening below one, ENOTDIR.
    if isinstance(exc, (FileExistsError, NotADirectoryError)):
        return "a folder on the path is a file"
    if making and isinstance(exc, FileNotFoundError):
        return "nothing can be made there"
    return (exc.strerror or str(exc)).lower()


def make_folder(path: Path, flag: str) -> None:
    """``mkdir -p path``; raises PathError naming ``flag`` and the cause in words."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = plain_os_error(exc, making=True)
        raise PathError(f"{flag} {path}: cannot make it: {why}") from None


def path_problem(path: Path, use: Use, fix: str = "") -> str | None:
    """What stops ``path`` from serving as ``use``, with the fix, in words; None when nothing
    visible does. ``fix``: which folder to give instead, for an ``EXISTING_FOLDER`` (only the
    caller knows what the folder holds)."""
    if use is Use.EXISTING_FOLDER:
        if path.is_dir():
            return None
        problem = "a file, not a folder" if path.exists() else "no such folder"
        return f"{problem}; {fix}" if fix else problem
    if use is Use.CONFIG:
        if path.is_dir():
            return "a folder, not a file; give a run.toml"
        return None if path.exists() else f"no such file (swarmtrain init {path} writes one)"
    if use is Use.NEW_FOLDER and path.is_dir() and any(path.iterdir()):
        return "a folder that is not empty; give a new or an empty one"
    if use is Use.FILE:
        if path.is_dir():
            return "a folder, not a file; give a file's path"
        # An existing file is read (an identity) or replaced where it is: no folder to write.
        return None if path.exists() else _folder_problem(path.parent, "file")
    if path.exists() and not path.is_dir():
        return "a file, not a folder; give a folder's path (it is made if absent)"
    return _folder_problem(path, "folder")


def _folder_problem(folder: Path, made: str) -> str | None:
    """Why no ``made`` (a file or a folder) can be made in ``folder`` or the folders to make
    above it: the nearest that exists is a file, or cannot be written."""
    nearest = folder
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if not nearest.is_dir():
        return f"{nearest} is a file, not a folder; give a path under a folder"
    if not os.access(nearest, os.W_OK | os.X_OK):
        read_only = os.statvfs(nearest).f_flag & os.ST_RDONLY
        why = "a read-only file system" if read_only else "permission denied"
        if nearest == folder and made == "folder":
            return f"cannot write in it: {why}; give a folder you can write"
        return f"cannot make a {made} in {nearest}: {why}; give a folder you can write"
    return None
