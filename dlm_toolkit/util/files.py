"""Files in and out: hostile input is refused before it is read, output is never half-written.

**Reading.** :func:`read_regular` opens without blocking (a FIFO never hangs the open), refuses
anything but a regular file (FIFOs, devices such as ``/dev/zero``, sockets, folders) and files
over a size limit, all before reading a byte. :func:`check_regular` does the same checks for
files a library opens itself (safetensors shards, ``tokenizer.json``). :func:`parse_json` bounds
the nesting depth before parsing (``[[[[...`` 100,000 deep would otherwise end in a
``RecursionError``). Each raises :class:`InputFileError` naming the file.

**Writing.** :func:`atomic_write` hands its writer a temporary name in the target's own folder
(``.NAME.tmp-PID-RANDOM``), then fsyncs the file, renames it over the target (``os.replace``,
atomic on POSIX) and fsyncs the folder. A failure or a kill at any point leaves the previous
file as it was: a crash can leave only a hidden temporary, which the next write of the same
name removes once its writer is gone. A full disk -- ``ENOSPC``, ``EDQUOT``, or ``EFBIG`` from
``RLIMIT_FSIZE`` -- raises :class:`NoSpaceError`: "no space left on device while writing X; the
previous X is unchanged". The written file gets the mode of the file it replaces, or for a new
file the mode a plain write would give under the umask (never the temporary's). :func:`atomic_write_many` writes a set of files (a checkpoint's config,
shards and index) the same way and renames them only once all are complete.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

MAX_JSON_DEPTH = 64  # no config, index, policy or stored setting of ours nests past ~6
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_FULL_TEXT = re.compile(r"\(os error (28|27|122)\)|No space left on device|File too large|Disk quota exceeded")
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class InputFileError(ValueError):
    """An input file that is refused before (or instead of) being read; the message names it."""


class NoSpaceError(OSError):
    """The disk (or a file-size limit) filled up while writing; the previous file is untouched.

    ``errno`` is ``ENOSPC``; the message alone is its text (no ``[Errno 28]`` prefix): the CLI
    prints it as its one line."""

    def __str__(self) -> str:
        return str(self.strerror)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_regular(path: str | os.PathLike, max_bytes: int, what: str = "file") -> int:
    """The size of ``path`` if it is a regular file (symlinks followed) of at most ``max_bytes``.

    Raises:
        InputFileError: missing, unreadable, a FIFO/device/socket/folder, or too large.
    """
    try:
        st = os.stat(path)
    except OSError as err:
        raise InputFileError(f"{path}: cannot read {what} ({err.strerror})") from None
    return _check_stat(path, st, max_bytes, what)


def _check_stat(path: str | os.PathLike, st: os.stat_result, max_bytes: int, what: str) -> int:
    if not stat.S_ISREG(st.st_mode):
        raise InputFileError(f"{path}: {what} must be a regular file, this is {_kind(st.st_mode)}")
    if st.st_size > max_bytes:
        raise InputFileError(f"{path}: {st.st_size} bytes; {what} is limited to {max_bytes} bytes")
    return st.st_size


def read_regular(path: str | os.PathLike, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of regular file ``path``, refused (:class:`InputFileError`) if it is anything
    else or holds more than ``max_bytes`` -- checked on the open descriptor, before reading."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise InputFileError(f"{path}: cannot read {what} ({err.strerror})") from None
    try:
        _check_stat(path, os.fstat(fd), max_bytes, what)
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while size <= max_bytes:  # the file may grow after the check: never read past the limit
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise InputFileError(f"{path}: more than {max_bytes} bytes; {what} is limited to {max_bytes} bytes")
        return b"".join(chunks)
    except OSError as err:
        raise InputFileError(f"{path}: cannot read {what} ({err.strerror})") from None
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, max_bytes: int, what: str = "file") -> str:
    """:func:`read_regular` decoded as UTF-8 (an error names the byte offset)."""
    data = read_regular(path, max_bytes, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputFileError(f"{path}: {what} is not UTF-8 text (byte 0x{data[err.start]:02x} at byte "
                             f"offset {err.start})") from None


_NOT_MARK = bytes(c for c in range(256) if c not in b'[]{}"')  # all a depth count needs are brackets and quotes
_NUMPY_FROM = 1 << 16  # marks past which numpy (imported lazily) beats a Python loop


def json_depth(text: str) -> int:
    """How deeply arrays and objects nest in JSON ``text`` (brackets inside strings do not count).

    Linear and at C speed (~200 MB/s; a regex over the strings ran at 7-50): escape pairs (two
    backslashes), then escaped quotes, are dropped left to right as a JSON reader pairs them, so
    every quote left opens or closes a string. Where ``text`` is not valid JSON the count may differ
    after the first stray backslash or unclosed quote, but a JSON reader stops there, so it never
    nests deeper than this says."""
    data = text.encode("utf-8", "surrogatepass")  # bytes past 0x7f are never a bracket, quote or backslash
    if b"\\" in data:
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = data.translate(None, _NOT_MARK)
    if len(marks) < _NUMPY_FROM:
        depth = deepest = 0
        inside = False
        for mark in marks:
            if mark == 34:
                inside = not inside
            elif not inside:
                depth += 1 if mark in b"[{" else -1
                deepest = max(deepest, depth)
        return deepest
    import numpy as np

    codes = np.frombuffer(marks, np.uint8)
    quote = codes == ord('"')
    outside = (np.cumsum(quote, dtype=np.uint8) & 1) == 0  # wraps at 256, the parity bit stays exact
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)[outside & ~quote]
    return max(int(np.cumsum(steps).max()), 0) if steps.size else 0


def parse_json(text: str | bytes, where: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)`` with the nesting depth checked first.

    Raises:
        InputFileError: ``where: ...`` for invalid JSON or nesting deeper than ``max_depth``.
    """
    import json

    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InputFileError(f"{where}: not UTF-8 text (byte 0x{text[err.start]:02x} at byte offset "
                                 f"{err.start})") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise InputFileError(f"{where}: JSON nested {depth} levels deep; at most {max_depth} are accepted")
    try:
        return json.loads(text)
    except ValueError as err:  # JSONDecodeError; also ints past Python's 4300-digit limit
        raise InputFileError(f"{where}: invalid JSON ({err})") from None


def is_disk_full(err: BaseException) -> bool:
    """A write failed because the disk, a quota or ``RLIMIT_FSIZE`` is full (OSError or a library's
    error that carries the OS error: safetensors and tokenizers report ``(os error 28)``)."""
    if isinstance(err, OSError) and err.errno in _FULL:
        return True
    return bool(_FULL_TEXT.search(str(err)))


def no_space(path: Path, existed: bool) -> NoSpaceError:
    after = f"the previous {path.name} is unchanged" if existed else f"{path.name} was not written"
    return NoSpaceError(errno.ENOSPC, f"no space left on device while writing {path}; {after}")


def umask() -> int:
    """This process's umask, read without changing it (``os.umask`` can only swap it, which races
    with any thread creating a file meanwhile); the swap only where ``/proc`` does not say."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def target_mode(path: Path) -> int:
    """The permission bits a write of ``path`` leaves: those of the file it replaces, else what a
    plain ``open(path, "w")`` gives under the umask (``0o666 & ~umask``). Writers such as
    safetensors create their temporary 0600, which would make a shared checkpoint unreadable."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~umask()


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def _remove_stale(path: Path) -> None:
    """Temporaries of ``path`` whose writing process is gone (a kill mid-write)."""
    for tmp in path.parent.glob(f".{glob_escape(path.name)}.tmp-*-*"):
        pid = tmp.name.rsplit("-", 2)[-2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            tmp.unlink(missing_ok=True)


def glob_escape(name: str) -> str:
    return re.sub(r"([\[\]*?])", r"[\1]", name)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot sync a folder; the rename is still atomic
        pass
    finally:
        os.close(fd)


def atomic_write_many(folder: str | os.PathLike, writers: dict[str, Callable[[Path], object]]) -> None:
    """Write each ``name`` with ``writers[name](temporary_path)``, then rename them all into place.

    Nothing is renamed until every file is complete and synced, so a failure (disk full, an
    exception, a kill) leaves every previous file as it was and no temporary behind.

    Raises:
        NoSpaceError: the disk filled up (the message names the file being written).
    """
    folder = Path(folder)
    temps: dict[str, Path] = {}
    current = ""
    try:
        for name, write in writers.items():
            current = name
            _remove_stale(folder / name)
            temps[name] = _temp_name(folder / name)
            write(temps[name])
            os.chmod(temps[name], target_mode(folder / name))
            fsync_file(temps[name])
    except BaseException as err:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
        if is_disk_full(err):
            target = folder / current
            raise no_space(target, target.exists()) from None
        raise
    for name, tmp in temps.items():
        os.replace(tmp, folder / name)
    fsync_folder(folder)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> None:
    """Write ``path`` through ``write(temporary_path)`` and rename it into place (see the module doc)."""
    path = Path(path)
    atomic_write_many(path.parent, {path.name: write})


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """``with replacing(path) as tmp: <write tmp>`` -- :func:`atomic_write` for code that writes
    through an open file (close it inside the block)."""
    path = Path(path)
    _remove_stale(path)
    tmp = _temp_name(path)
    try:
        yield tmp
        os.chmod(tmp, target_mode(path))
        fsync_file(tmp)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if is_disk_full(err):
            raise no_space(path, path.exists()) from None
        raise
    os.replace(tmp, path)
    fsync_folder(path.parent)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically write UTF-8 ``text`` to ``path``."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Atomically write ``data`` to ``path``."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data))
