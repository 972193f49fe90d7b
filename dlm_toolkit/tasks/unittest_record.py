"""What the BigCodeBench harness (``unittest_harness.py``) builds on, sent into the sandbox ahead of it
(never imported: :func:`~dlm_toolkit.tasks.unittest_box.harness_source` joins the two sources): the
identity record of the test machinery, the report's encoder and the per-instance binding of recorded
methods. Everything here is defined before any candidate byte runs, and binds the builtins it uses
as default arguments then, so a candidate that replaces a builtin later changes none of it."""

from _json import encode_basestring_ascii as _quote  # C: nothing the candidate can patch


class _Record:
    """Identity record of dictionaries (builtins, modules, classes) and of single attributes:
    ``changed()`` names the first difference. Kept by identity, never by ``==`` (a replacement object
    could claim to equal anything), with the builtins it needs bound when this class is defined,
    before the candidate runs."""

    def __init__(self, builtin_names, machinery_names, _dict=dict, _len=len, _type=type, _set=set, _zip=zip,
                 _callable=callable, _isinstance=isinstance, _wrappers=(staticmethod, classmethod, property)):
        self.entries = []  # (label, owner, type of owner, keys, values, rule)
        self.builtin_names, self.machinery_names = builtin_names, machinery_names
        self._dict, self._len, self._type, self._set, self._zip = _dict, _len, _type, _set, _zip
        self._callable, self._isinstance, self._wrappers = _callable, _isinstance, _wrappers

    def add(self, label, owner, rule, attr=None):
        """Record ``owner``'s dictionary (``rule``: builtins, module, class, test class) or, with
        ``attr``, that one attribute of a module or class (rule ``attribute``)."""
        d = owner if rule == "builtins" else owner.__dict__
        items = [(attr, d.get(attr))] if rule == "attribute" else list(d.items())
        self.entries.append((label, owner, self._type(owner), [k for k, _ in items], [v for _, v in items], rule))

    def _guarded(self, key, value):
        """Which attributes of a test class stay as loaded: its functions, dunders and names of the
        machinery (plain class attributes the tests set in setUpClass may change)."""
        return (key.startswith("__") or key in self.machinery_names or self._callable(value)
                or self._isinstance(value, self._wrappers))

    def changed(self):
        for label, owner, kind, keys, values, rule in self.entries:
            if self._type(owner) is not kind:
                return f"the type of {label} was changed"
            now = self._dict(owner if rule == "builtins" else owner.__dict__)
            for key, value in self._zip(keys, values):
                if rule == "attribute":
                    if now.get(key) is not value:
                        return f"{label}.{key} was replaced"
                    continue
                if key not in now or now[key] is not value:
                    if rule == "test class" and not self._guarded(key, value):
                        continue
                    if key == "__warningregistry__":  # the warnings module's own cache
                        continue
                    return f"{label}.{key} was {'removed' if key not in now else 'replaced'}"
            if rule == "attribute" or self._len(now) == self._len(keys):
                continue
            known = self._set(keys)
            for key in now:
                if key in known or key == "__warningregistry__":
                    continue
                if rule == "class" or (rule == "module" and (key.startswith("__") or key in self.builtin_names)) \
                        or (rule == "test class" and (key.startswith("__") or key in self.machinery_names)):
                    return f"{label}.{key} was added"
        return ""


def _encode(value, _type=type, _str=str, _int=int, _dict=dict, _list=list, _tuple=tuple, _isinstance=isinstance,
            _quote=_quote, _join=", ".join, _items=dict.items):
    """JSON of the report's plain values, built only from C functions bound here, before the candidate
    runs: ``json.dumps`` goes through ``JSONEncoder.encode``, which the candidate can replace (and
    which sees the nonce)."""
    kind = _type(value)
    if value is True or value is False or value is None:
        return "true" if value is True else "false" if value is False else "null"
    if kind is _int:
        return _int.__repr__(value)
    if kind is _str:
        return _quote(value)
    if kind is _dict:
        return "{" + _join([_quote(_str.__str__(k)) + ": " + _encode(v) for k, v in _items(value)]) + "}"
    if kind is _list or kind is _tuple:
        return "[" + _join([_encode(v) for v in value]) + "]"
    return _quote(_str.__str__(value)) if _isinstance(value, _str) else "null"


def _describe(exc):
    """``Type: message`` of an exception the candidate may have made unprintable."""
    try:
        return f"{type(exc).__name__}: {str(exc)[:500]}"
    except BaseException:
        return "an exception that cannot be printed"


def _pin(obj, originals, MethodType, FunctionType, own=None):
    """Bind to ``obj`` (in its own dictionary, which instance lookup reads before the class's) every
    method it inherits from a recorded ``unittest`` class, taken from the record: a method the
    candidate later puts on the live class is never the one called."""
    seen = set()
    target = obj.__dict__
    for cls in type(obj).__mro__:
        saved = originals.get(cls)
        if saved is None:
            seen.update(cls.__dict__)  # the tests' own classes (recorded), or ``own`` (ours)
            if cls is own:
                for name, value in cls.__dict__.items():
                    if isinstance(value, FunctionType):
                        target[name] = MethodType(value, obj)
            continue
        for name, value in saved.items():
            if name in seen:
                continue
            seen.add(name)
            if isinstance(value, FunctionType) and not (name.startswith("__") and name.endswith("__")):
                target[name] = MethodType(value, obj)
