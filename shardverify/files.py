"""The one reader of every file a user hands shardverify (specs, plan and accepted files, saved
JSON runs, calibration files): regular files only, never blocking, never reading past a limit;
and the one writer of a file shardverify hands back (reports, pages, generated files): whole or
not at all.

It sits on the lowest floor beside `errors` so that every room, the mesh's calibration file
included, reads through it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile

from shardverify.errors import SpecError

__all__ = ["read_regular_file", "write_text_atomic"]


def read_regular_file(path: str | os.PathLike[str], max_bytes: int, *, display: str | None = None,
                      setting: str = "") -> bytes:
    """The bytes of a regular file of at most `max_bytes`: the one reader of every spec, plan,
    accepted-list and saved-JSON file. A FIFO, a device or a folder is refused without blocking
    (opened non-blocking, checked by fstat before any read) and a larger file is refused after
    reading one byte past the limit, so neither `/dev/zero` nor a FIFO nor a huge file can hang
    or exhaust memory. `setting` names how to raise the limit, for the message."""
    name = display if display is not None else os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise SpecError(f"cannot read the file: {exc.strerror or exc}", file=name) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket or special file")
            raise SpecError(f"is {kind}, not a regular file", file=name)
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise SpecError(f"cannot read the file: {exc.strerror or exc}", file=name) from None
    finally:
        os.close(fd)
    if size > max_bytes:
        raise SpecError(f"the file is larger than {max_bytes} bytes" + (f" (raise it with {setting}=N)" if setting else ""),
                        file=name)
    return b"".join(chunks)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: into a fresh file of an exclusive random
    name in the same folder (never a name planted beforehand, no link followed), then renamed
    over ``path``. A write that fails part way (a full disk, a file-size limit) raises OSError
    and leaves ``path`` as it was, with no temporary file behind."""
    target = os.fspath(path)
    folder = os.path.dirname(target) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
