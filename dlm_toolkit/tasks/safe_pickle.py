"""Read benchmark blobs stored as ``base64(zlib(pickle(data)))`` without ever unpickling an object.

LiveCodeBench stores its private tests that way (the pickle holds one JSON string). A pickle is a
program: ``GLOBAL``/``STACK_GLOBAL``/``INST``/``OBJ``/``EXT*`` name a callable and ``REDUCE`` calls
it, so loading an untrusted one with :func:`pickle.loads` runs whatever it names (``os.system``).
:func:`load_plain` refuses every global (``find_class`` always raises, and every opcode that makes
an object goes through it) and persistent ids, then checks that what came out is plain data:
``str``/``bytes``/``int``/``float``/``bool``/``None`` and lists/tuples/dicts of them.
:func:`decode_blob` also bounds the decompressed size (a zip bomb is one line, not an OOM).

Shared helper: any task reading such blobs (LiveCodeBench; BigCodeBench if it needs one) uses it.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import zlib

__all__ = ["MAX_BLOB_BYTES", "UnsafeBlob", "decode_blob", "inflate_bounded", "load_plain"]

MAX_BLOB_BYTES = 256 << 20
"""Default bound on one decompressed blob (LiveCodeBench's largest private test sets are tens of MB)."""

MAX_DEPTH = 64  # containers inside containers: test data nests a few levels


class UnsafeBlob(ValueError):
    """A blob that is not valid base64, zlib or restricted pickle, is too large, or names a global."""


class _NoGlobals(pickle.Unpickler):
    """An unpickler that resolves no global and no persistent id: only the opcodes that build
    str/bytes/numbers/lists/tuples/dicts can succeed."""

    def find_class(self, module: str, name: str) -> object:
        raise UnsafeBlob(f"the pickle names the global {module}.{name}; only plain data is accepted")

    def persistent_load(self, pid: object) -> object:
        raise UnsafeBlob("the pickle uses a persistent id; only plain data is accepted")


def _check_plain(value: object, depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise UnsafeBlob(f"the pickle nests deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if value is None or kind in (str, bytes, int, float, bool):
        return
    if kind in (list, tuple):
        for item in value:  # type: ignore[union-attr]
            _check_plain(item, depth + 1)
        return
    if kind is dict:
        for key, item in value.items():  # type: ignore[union-attr]
            _check_plain(key, depth + 1)
            _check_plain(item, depth + 1)
        return
    raise UnsafeBlob(f"the pickle holds a {kind.__name__}; only str, bytes, numbers, lists and dicts are accepted")


_REFUSED_OPCODES = frozenset({
    "GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "BUILD", "EXT1", "EXT2", "EXT4",
    "PERSID", "BINPERSID", "NEXT_BUFFER", "READONLY_BUFFER"})
"""Opcodes that name, call or feed a callable, or reach outside the stream: refused before loading."""


def _scan(data: bytes) -> None:
    """Walk the opcodes without building anything (:func:`pickletools.genops` reads each declared
    length from the stream, so a huge declared size is a truncation, never an allocation)."""
    import pickletools

    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name in _REFUSED_OPCODES:
                what = " " + str(arg).replace(" ", ".") if opcode.name in ("GLOBAL", "INST") else ""
                raise UnsafeBlob(f"the pickle uses {opcode.name}{what}; only plain data is accepted "
                                 "(no globals, calls or persistent ids)")
    except UnsafeBlob:
        raise
    except Exception as exc:  # genops raises ValueError on truncated or unknown opcodes
        raise UnsafeBlob(f"not a valid pickle ({type(exc).__name__}: {str(exc)[:100]})") from None


def load_plain(data: bytes) -> object:
    """Unpickle ``data`` admitting no global: plain data only.

    Two layers: the opcodes are scanned first (any that names, calls or feeds a callable is
    refused), then loaded by an unpickler whose ``find_class`` always refuses.

    Raises:
        UnsafeBlob: a global, a call, a persistent id, a non-plain result, trailing bytes or a
            broken pickle.
    """
    _scan(data)
    stream = io.BytesIO(data)
    try:
        value = _NoGlobals(stream).load()
    except UnsafeBlob:
        raise
    except RecursionError:
        raise UnsafeBlob("the pickle nests too deeply") from None
    except Exception as exc:  # pickle raises many types on malformed input (EOFError, KeyError, ...)
        raise UnsafeBlob(f"not a valid pickle ({type(exc).__name__}: {str(exc)[:100]})") from None
    if stream.tell() != len(data):
        raise UnsafeBlob(f"{len(data) - stream.tell()} bytes after the pickle's STOP")
    _check_plain(value)
    return value


def inflate_bounded(data: bytes, max_bytes: int) -> bytes:
    """``zlib.decompress(data)`` that never holds more than ``max_bytes + 1`` output bytes.

    Raises:
        UnsafeBlob: not a complete zlib stream, bytes after it, or more than ``max_bytes`` out.
    """
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, max_bytes + 1)
    except zlib.error as exc:
        raise UnsafeBlob(f"not valid zlib data ({exc})") from None
    if len(out) > max_bytes or inflater.unconsumed_tail:
        raise UnsafeBlob(f"decompresses to more than {max_bytes} bytes (the bound on one blob)")
    if not inflater.eof:
        raise UnsafeBlob("a truncated zlib stream")
    if inflater.unused_data:
        raise UnsafeBlob(f"{len(inflater.unused_data)} bytes after the zlib stream")
    return out


def decode_blob(text: str, max_bytes: int = MAX_BLOB_BYTES) -> object:
    """The plain data in ``base64(zlib(pickle(data)))``, never unpickling an object.

    Raises:
        UnsafeBlob: invalid base64, zlib or restricted pickle; over ``max_bytes`` decompressed.
    """
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise UnsafeBlob(f"not valid base64 ({exc})") from None
    return load_plain(inflate_bounded(raw, max_bytes))
