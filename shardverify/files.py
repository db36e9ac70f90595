"""The one reader of every file a user hands shardverify (specs, plan and accepted files, saved
JSON runs, calibration files, stores): regular files only, never blocking, never reading past a
limit; and the one writer of whole files (:func:`write_file_atomic`): a fresh exclusive name in the
target's folder, renamed over it, so no planted link is followed and nothing is left half-written.

It sits on the lowest floor beside `errors` so that every room, the mesh's calibration file
included, reads through it.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
import tempfile

from shardverify.errors import SpecError

__all__ = ["read_regular_file", "write_file_atomic"]


def read_regular_file(path: str | os.PathLike[str], max_bytes: int, *, display: str | None = None,
                      setting: str = "", follow_symlinks: bool = True) -> bytes:
    """The bytes of a regular file of at most `max_bytes`: the one reader of every spec, plan,
    accepted-list and saved-JSON file. A FIFO, a device or a folder is refused without blocking
    (opened non-blocking, checked by fstat before any read) and a larger file is refused after
    reading one byte past the limit, so neither `/dev/zero` nor a FIFO nor a huge file can hang
    or exhaust memory. `setting` names how to raise the limit, for the message; without
    `follow_symlinks` a symbolic link (the file's own name) is refused unopened."""
    name = display if display is not None else os.fspath(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags if follow_symlinks else flags | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks:
            raise SpecError("is a symbolic link, not a regular file", file=name) from None
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


def write_file_atomic(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Write ``data`` to ``path`` whole or not at all: into a fresh exclusive name in the same
    folder (``mkstemp``: O_CREAT | O_EXCL, so a link planted at a guessable name is never
    followed), then renamed over ``path`` (a link at ``path`` itself is replaced, not followed).
    A write that fails (a full disk, RLIMIT_FSIZE, Ctrl-C) removes its partial file and leaves
    what ``path`` held. The file gets the umask's usual mode, not mkstemp's 0600."""
    folder, base = os.path.split(os.fspath(path))
    os.makedirs(folder or ".", exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=folder or ".", prefix=f".{base}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(partial, 0o666 & ~_umask())
        os.replace(partial, path)
    except BaseException:
        try:
            os.unlink(partial)
        except OSError:
            pass
        raise


@functools.cache
def _umask() -> int:
    """The process's umask, read once (reading it means setting it: never again while threads run)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask
