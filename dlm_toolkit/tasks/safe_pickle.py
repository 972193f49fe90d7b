"""Read benchmark blobs stored as ``base64(zlib(pickle(data)))`` without ever unpickling an object.

LiveCodeBench stores its private tests that way (the pickle holds one JSON string). A pickle is a
program: ``GLOBAL``/``STACK_GLOBAL``/``INST``/``OBJ``/``EXT*`` name a callable and ``REDUCE`` calls
it, so loading an untrusted one with :func:`pickle.loads` runs whatever it names (``os.system``).
:func:`load_plain` admits only the opcodes plain data needs (no global, call, persistent id, set,
memo read or ``DUP``), at most :data:`MAX_OPCODES` of them building at most :data:`MAX_CONTAINERS`
containers and :data:`MAX_DICT_ITEMS` dict items (integer keys can be made to collide), loads with an
unpickler that resolves no global, then checks that what came out is plain
data (``str``/``bytes``/``int``/``float``/``bool``/``None`` and lists/tuples/dicts of them, at most
:data:`MAX_DEPTH` levels). Without memo reads the result is a tree no larger than the opcodes, so
every step is linear in the bytes read. :func:`decode_blob` also bounds the decompressed size (a zip
bomb is one line, not an OOM).

Shared helper: any task reading such blobs (LiveCodeBench; BigCodeBench if it needs one) uses it.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import zlib

__all__ = ["MAX_BLOB_BYTES", "MAX_CONTAINERS", "MAX_DEPTH", "MAX_DICT_ITEMS", "MAX_OPCODES", "UnsafeBlob",
           "decode_blob", "inflate_bounded", "load_plain"]

MAX_BLOB_BYTES = 256 << 20
"""Default bound on one decompressed blob (LiveCodeBench's largest private test sets are tens of MB)."""

MAX_DEPTH = 64
"""Most containers nested in one another (the outermost list is level 1): test data nests a few levels."""

MAX_OPCODES = 100_000
"""Most opcodes one pickle may hold. LiveCodeBench's hold five (a JSON string and its frame); the bound
keeps the scan (pure Python, ~1 us an opcode) well under a second whatever the blob's size."""

MAX_CONTAINERS = 10_000
"""Most lists, tuples and dicts one pickle may build."""

MAX_DICT_ITEMS = 1_000
"""Most dict items one pickle may set (LiveCodeBench's set none). Integer keys hash to themselves
modulo 2^61 - 1, so ``k * (2^61 - 1)`` all collide and each insertion probes every earlier one:
50,000 of them (640 kB) took 10 s to load; 1,000 take milliseconds."""


class UnsafeBlob(ValueError):
    """A blob that is not valid base64, zlib or restricted pickle, is too large, or names a global."""


class _NoGlobals(pickle.Unpickler):
    """An unpickler that resolves no global and no persistent id: only the opcodes that build
    str/bytes/numbers/lists/tuples/dicts can succeed."""

    def find_class(self, module: str, name: str) -> object:
        raise UnsafeBlob(f"the pickle names the global {module}.{name}; only plain data is accepted")

    def persistent_load(self, pid: object) -> object:
        raise UnsafeBlob("the pickle uses a persistent id; only plain data is accepted")


def _check_plain(value: object) -> None:
    """Plain data nested at most :data:`MAX_DEPTH` levels. Iterative, and linear in the objects: the
    scan admitted no opcode that shares one (no memo read, no ``DUP``), so what loaded is a tree."""
    stack = [(value, 0)]
    while stack:
        item, level = stack.pop()
        kind = type(item)
        if item is None or kind in (str, bytes, int, float, bool):
            continue
        if kind not in (list, tuple, dict):
            raise UnsafeBlob(f"the pickle holds a {kind.__name__}; only str, bytes, numbers, lists, tuples and dicts "
                             "are accepted")
        if level + 1 > MAX_DEPTH:
            raise UnsafeBlob(f"the pickle nests containers more than {MAX_DEPTH} levels deep")
        children = [x for pair in item.items() for x in pair] if kind is dict else item  # type: ignore[union-attr]
        stack.extend((child, level + 1) for child in children)


_CONTAINERS = frozenset({"EMPTY_LIST", "LIST", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_DICT",
                         "DICT"})
_ALLOWED = _CONTAINERS | {
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "NONE", "NEWTRUE", "NEWFALSE",
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
    "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "APPEND", "APPENDS", "SETITEM", "SETITEMS",
    "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}
"""The opcodes plain data needs (what ``pickle.dumps`` writes for str/bytes/numbers/lists/tuples/dicts
at every protocol); any other is refused before loading. Memo *writes* are harmless and every
protocol emits them; memo *reads* (``GET``, ``BINGET``, ``LONG_BINGET``) and ``DUP`` are refused:
they share one object in many places, so 579 bytes make a DAG of 2^40 leaves that any later walk
expands. LiveCodeBench's blobs (one pickled JSON string) never read the memo."""

_SHARING = frozenset({"GET", "BINGET", "LONG_BINGET", "DUP"})


def _scan(data: bytes) -> None:
    """Walk the opcodes without building anything (:func:`pickletools.genops` reads each declared
    length from the stream, so a huge declared size is a truncation, never an allocation): only
    :data:`_ALLOWED` ones, at most :data:`MAX_OPCODES` of them, :data:`MAX_CONTAINERS`
    containers and :data:`MAX_DICT_ITEMS` dict items, memo indices below the opcode count (the C
    unpickler grows its memo to twice the largest index it is given)."""
    import pickletools

    count = containers = items = 0
    levels = [0]  # objects on the stack above each open MARK (the first: above the bottom)
    try:
        for opcode, arg, _ in pickletools.genops(data):
            count += 1
            name = opcode.name
            plain_before = [x for x in opcode.stack_before if x not in (pickletools.markobject, pickletools.stackslice)]
            if name == "MARK":
                levels.append(0)
            elif len(plain_before) != len(opcode.stack_before):  # pops back to the last MARK
                above = levels.pop() if len(levels) > 1 else 0
                items += above // 2 if name in ("SETITEMS", "DICT") else 0
            items += name == "SETITEM"
            levels[-1] += len(opcode.stack_after) - len(plain_before) if name != "MARK" else 0
            if items > MAX_DICT_ITEMS:
                raise UnsafeBlob(f"the pickle sets more than {MAX_DICT_ITEMS} dict items (the bound on one blob)")
            if count > MAX_OPCODES:
                raise UnsafeBlob(f"the pickle has more than {MAX_OPCODES} opcodes (the bound on one blob)")
            if name in _SHARING:
                raise UnsafeBlob(f"the pickle uses {name}: a memo read or duplicate shares one object in many "
                                 "places; only plain data written once is accepted")
            if name not in _ALLOWED:
                what = " " + str(arg).replace(" ", ".") if name in ("GLOBAL", "INST") else ""
                raise UnsafeBlob(f"the pickle uses {name}{what}; only plain data is accepted (str, bytes, numbers, "
                                 "lists, tuples, dicts: no set, global, call or persistent id)")
            if name in _CONTAINERS:
                containers += 1
                if containers > MAX_CONTAINERS:
                    raise UnsafeBlob(f"the pickle builds more than {MAX_CONTAINERS} containers (the bound on one "
                                     "blob)")
            if name in ("PUT", "BINPUT", "LONG_BINPUT") and not (isinstance(arg, int) and 0 <= arg < count):
                raise UnsafeBlob(f"the pickle uses {name} {arg}: a memo index past its opcode count")
    except UnsafeBlob:
        raise
    except Exception as exc:  # genops raises ValueError on truncated or unknown opcodes
        raise UnsafeBlob(f"not a valid pickle ({type(exc).__name__}: {str(exc)[:100]})") from None


def load_plain(data: bytes) -> object:
    """Unpickle ``data`` admitting no global: plain data only, in time and memory linear in ``data``.

    Two layers: the opcodes are scanned first (:func:`_scan`: only those plain data needs, counted
    and bounded), then loaded by an unpickler whose ``find_class`` always refuses, and the result
    checked to be plain data nested at most :data:`MAX_DEPTH` levels.

    Raises:
        UnsafeBlob: a global, a call, a persistent id, a memo read, a bound exceeded, a non-plain
            result, trailing bytes or a broken pickle.
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
