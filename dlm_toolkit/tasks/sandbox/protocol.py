"""The plain-data protocol between the two sides of a sandboxed test run (:func:`.run_tests`).

Only *plain data* crosses: ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes`` and
``list``/``tuple``/``dict``/``set``/``frozenset`` of them -- checked by exact type, so a subclass
of ``int``, ``str`` or ``list`` (with a patched ``__eq__``, say) is refused, not converted. The
receiving side rebuilds fresh builtin objects, so every comparison the tests make runs on values
the candidate never touched.

Wire format: a frame is a 4-byte big-endian length and that many bytes of ASCII JSON, at most
:data:`MAX_MESSAGE_BYTES`. JSON ``null``/``true``/``false``/numbers/strings/arrays stand for
``None``/``bool``/``int`` or ``float``/``str``/``list`` (Python's JSON keeps ints exact, up to
Python's 4300-digit limit on int <-> str conversion, and floats by their shortest repr). Objects
are one-key tags: ``{"t": [...]}`` tuple, ``{"s": [...]}`` set, ``{"fs": [...]}`` frozenset,
``{"d": [[k, v], ...]}`` dict (any plain hashable key), ``{"b": "hex"}`` bytes,
``{"f": "nan" | "inf" | "-inf"}`` the non-finite floats. Anything else -- another tag, two keys,
``NaN`` literals, nesting deeper than :data:`MAX_DEPTH`, an unhashable set element or dict key --
is a :class:`ProtocolError`.

This file imports only the standard library and defines nothing it needs from the package: the
sandbox runner executes its source text inside the sandbox, where the package is not importable.
"""

from __future__ import annotations

import builtins
import json
import math
import os
import select
import time

MAX_MESSAGE_BYTES = 16 << 20  # one call's arguments or one return value, encoded
MAX_DEPTH = 100  # containers inside containers; real test data nests a few levels
MAX_TEXT = 1000  # characters of an exception message that cross


class NotPlainData(Exception):
    """A value that may not cross the boundary (its type, its depth or its size)."""


class ProtocolError(Exception):
    """A frame that does not follow the protocol (what a tampering side would send)."""


class ChannelClosed(Exception):
    """The other side closed its end (it exited or was killed)."""


class DeadlinePassed(Exception):
    """No whole frame arrived before the reader's deadline (its own clock, outside the sender)."""


def encode(value: object, depth: int = 0) -> object:
    """``value`` as JSON-able tagged data; :class:`NotPlainData` for anything not plain."""
    if depth > MAX_DEPTH:
        raise NotPlainData(f"nested deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is str:
        return value
    if kind is float:
        return value if math.isfinite(value) else {"f": "nan" if value != value else ("inf" if value > 0 else "-inf")}
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple:
        return {"t": [encode(v, depth + 1) for v in value]}
    if kind is set:
        return {"s": [encode(v, depth + 1) for v in value]}
    if kind is frozenset:
        return {"fs": [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"b": value.hex()}
    raise NotPlainData(f"a value of type {kind.__name__!r} is not plain data "
                       "(None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset)")


_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def decode(data: object, depth: int = 0) -> object:
    """Fresh builtin objects from :func:`encode`'s output; :class:`ProtocolError` otherwise."""
    if depth > MAX_DEPTH:
        raise ProtocolError(f"nested deeper than {MAX_DEPTH} levels")
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [decode(v, depth + 1) for v in data]
    if kind is not dict or len(data) != 1:
        raise ProtocolError(f"not a tagged value: {_short(data)}")
    (tag, body), = data.items()
    try:
        if tag == "f" and body in _FLOATS:
            return _FLOATS[body]
        if tag == "b" and type(body) is str:
            return bytes.fromhex(body)
        if type(body) is not list:
            raise ProtocolError(f"tag {tag!r} needs a list, got {_short(body)}")
        if tag == "t":
            return tuple(decode(v, depth + 1) for v in body)
        if tag == "s":
            return {decode(v, depth + 1) for v in body}
        if tag == "fs":
            return frozenset(decode(v, depth + 1) for v in body)
        if tag == "d":
            out = {}
            for pair in body:
                if type(pair) is not list or len(pair) != 2:
                    raise ProtocolError(f"a dict entry must be [key, value], got {_short(pair)}")
                out[decode(pair[0], depth + 1)] = decode(pair[1], depth + 1)
            return out
    except (TypeError, ValueError) as err:  # unhashable key or element, bad hex
        raise ProtocolError(f"tag {tag!r}: {err}") from None
    raise ProtocolError(f"unknown tag {_short(data)}")


def _short(data: object) -> str:
    text = repr(data)
    return text if len(text) <= 80 else text[:77] + "..."


def _one_key_objects(pairs: list) -> dict:
    if len(pairs) != 1:
        raise ProtocolError(f"a tagged value has exactly one key, got {len(pairs)}")
    return dict(pairs)


def _no_constants(name: str) -> object:
    raise ProtocolError(f"JSON constant {name} (non-finite floats travel as {{'f': ...}})")


def send(fd: int, message: object) -> None:
    """Write one frame holding ``message`` (already tagged: dicts here are protocol objects)."""
    data = json.dumps(message, allow_nan=False, separators=(",", ":")).encode("ascii")
    if len(data) > MAX_MESSAGE_BYTES:
        raise NotPlainData(f"{len(data)} bytes encoded, more than {MAX_MESSAGE_BYTES}")
    frame = len(data).to_bytes(4, "big") + data
    view = memoryview(frame)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, size: int, deadline: float | None = None) -> bytes:
    chunks, left = [], size
    while left:
        if deadline is not None:  # poll, not select: the pipe's number may lie past select's 1024
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            wait = deadline - time.monotonic()
            if wait <= 0 or not poller.poll(wait * 1000):
                raise DeadlinePassed("no reply before the deadline")
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise ChannelClosed("the other side closed the channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(fd: int, deadline: float | None = None) -> object:
    """Read one frame: the JSON value it holds (tags still in place; see :func:`decode`).
    With ``deadline`` (a :func:`time.monotonic` time), the whole frame must have arrived by then,
    else :class:`DeadlinePassed`."""
    size = int.from_bytes(_read_exactly(fd, 4, deadline), "big")
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"a frame of {size} bytes, more than {MAX_MESSAGE_BYTES}")
    raw = _read_exactly(fd, size, deadline)
    try:
        return json.loads(raw.decode("ascii"), object_pairs_hook=_one_key_objects, parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ProtocolError(f"not a JSON frame: {err}") from None


def exception_name(exc: BaseException) -> str:
    """The nearest builtin class of ``exc`` (a user class ``class E(ValueError)`` -> ``ValueError``)."""
    for klass in type(exc).__mro__:
        if getattr(builtins, klass.__name__, None) is klass:
            return klass.__name__
    return "Exception"


def rebuild_exception(name: object, message: object) -> Exception | None:
    """The builtin ``Exception`` subclass named ``name`` with ``message``; ``None`` for anything
    else (``SystemExit``, ``KeyboardInterrupt``, unknown names): those end the run as a failure."""
    klass = getattr(builtins, name, None) if type(name) is str else None
    if not (isinstance(klass, type) and issubclass(klass, Exception)) or type(message) is not str:
        return None
    for candidate in klass.__mro__:  # UnicodeDecodeError needs five arguments: fall back to UnicodeError
        try:
            return candidate(message[:MAX_TEXT])
        except TypeError:
            continue
    return None
