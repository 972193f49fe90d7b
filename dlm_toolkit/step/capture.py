"""Run a fixed-shape step eagerly, compiled, or replayed from a CUDA graph.

The decode engine calls the model forward (and the built-in rules' step) many times with the
same few input shapes. :class:`StepRunner` captures such a function once per distinct input key
(shapes, dtypes and devices of its tensor arguments) and replays it:

- ``"eager"``: call it (the reference).
- ``"compile"``: ``torch.compile(fn, fullgraph=True, dynamic=False)``. A graph break or a
  data-dependent op (a host read) fails the capture. On a CPU this is the testable stand-in for
  CUDA graphs: what compiles with ``fullgraph=True`` reads nothing back to the host.
- ``"cuda_graphs"``: ``torch.cuda.CUDAGraph`` per key, with static input buffers the arguments
  are copied into before each replay and one memory pool shared by all keys. We capture by hand
  rather than through ``torch.compile(mode="reduce-overhead")``: the graph then replays the very
  kernels the eager call ran (same bits as eager, which the conformance checks need; inductor
  fuses and reorders float sums), and capturing costs milliseconds, not a compile.

A capture that fails (graph break, unsupported op, a host read during CUDA capture) gives one
warning naming the step and runs it eagerly from then on, with the same results. Running out of
GPU memory while capturing is an error naming the shapes to make smaller.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import warnings
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Literal, get_args

import pydantic
import torch
from torch.utils import _pytree as pytree

CaptureMode = Literal["eager", "compile", "cuda_graphs"]

RECOMPILE_LIMIT = 64
"""Compilations dynamo keeps per code object (its default, 8, is below the (bucket, width) keys a
runner may see); ``"compile"`` raises ``torch._dynamo.config.recompile_limit`` to at least this."""

Key = tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...]


class Uncapturable(ValueError):
    """A value a function to capture closes over has no canonical form (:func:`closure_key`): the
    function is run eagerly instead of replaying a capture that might have been made for another value."""

    def __init__(self, kind: type):
        super().__init__(kind)
        self.kind = kind
        self.where: list[str] = []  # the path to the value, innermost first (filled while unwinding)

    def __str__(self) -> str:
        path = "".join(reversed(self.where))
        return (f"{path} is a {self.kind.__module__}.{self.kind.__qualname__}, which has no canonical form "
                "(a capture could not tell two of them apart)")


class Channel(dict):  # type: ignore[type-arg]
    """A dict a captured function writes its results into while it is traced (not an input of the
    capture): :func:`closure_key` leaves it out."""


PLAIN = frozenset((type(None), bool, int, str, bytes))
AS_NAMED = (torch.dtype, torch.device)


def closure_key(fn: Callable[..., Any]) -> Hashable:
    """The key of everything ``fn`` closes over: its code object, and its free variables' and default
    arguments' values, canonicalised (:func:`canonical`): two functions with equal keys compute the
    same thing from the same tensor arguments, so one capture serves both. Module globals are not part
    of it (constants of the code's module). Raises :class:`Uncapturable` naming the first value with no
    canonical form by its path (``fn.rule.__dict__['table']``)."""
    try:
        return canonical(fn, set())
    except Uncapturable as err:
        err.where.append(getattr(fn, "__name__", "fn"))
        raise


def canonical(value: Any, active: set[int]) -> Hashable:
    """A hashable stand-in for ``value`` that equals another's iff the two are interchangeable as
    constants of a capture: ints/strs/bytes/None/bools as they are (with their type, so ``1``,
    ``1.0`` and ``True`` differ), floats by ``repr`` (NaN equals NaN), tuples/lists/sets/dicts by their
    items, dtypes and devices by name, classes and code objects as themselves, a pytree spec by
    ``str``, a pydantic model by its class and JSON, a strategy (an object with a pydantic ``config``)
    by its class, config JSON and every other attribute, a frozen dataclass by its fields, a function
    by its code and closure (recursively). Anything else (a tensor, an arbitrary object) raises
    :class:`Uncapturable`. Per-step cost matters (a captured rule's key is derived every step), so the
    path to a failing value is only built on failure."""
    kind = type(value)
    if kind in PLAIN:
        return (kind, value)
    if kind is float:
        return (float, repr(value))
    if isinstance(value, AS_NAMED):
        return (kind, str(value))
    if isinstance(value, (type, types.CodeType)):
        return value
    if isinstance(value, Channel):
        return Channel
    if isinstance(value, pytree.TreeSpec):
        return (pytree.TreeSpec, str(value))
    if isinstance(value, enum.Enum):
        return (kind, value.name)
    if id(value) in active:  # a cycle (a function closing over itself): its key is being built
        return ("cycle",)
    active.add(id(value))
    try:
        return _compound(value, kind, active)
    finally:
        active.discard(id(value))


def _items(values: Any, active: set[int], name: Callable[[Any], str]) -> tuple[Hashable, ...]:
    """The canonical forms of ``values`` (pairs ``(label, value)``); a failure's path gets ``name(label)``."""
    out = []
    label = None
    try:
        for label, v in values:
            out.append(canonical(v, active))
    except Uncapturable as err:
        err.where.append(name(label))
        raise
    return tuple(out)


def _compound(value: Any, kind: type, active: set[int]) -> Hashable:
    if isinstance(value, (tuple, list)):
        return (kind, _items(enumerate(value), active, lambda i: f"[{i}]"))
    if isinstance(value, (set, frozenset)):
        return (kind, tuple(sorted(_items(((None, v) for v in value), active, lambda _: "{}"), key=repr)))
    if isinstance(value, Mapping):
        keys = _items(((k, k) for k in value), active, lambda k: f" key {k!r}")
        values = _items(value.items(), active, lambda k: f"[{k!r}]")
        return (kind, tuple(sorted(zip(keys, values), key=repr)))
    if isinstance(value, pydantic.BaseModel):
        return (kind, value.model_dump_json())
    if isinstance(value, types.FunctionType):
        code = value.__code__
        free = _items(zip(code.co_freevars, [c.cell_contents for c in value.__closure__ or ()]), active,
                      lambda n: f".{n}")
        defaults = _items((("defaults", value.__defaults__), ("defaults", value.__kwdefaults__)), active,
                          lambda _: " defaults")
        return (types.FunctionType, code, free, defaults)
    if isinstance(value, types.MethodType):
        return (types.MethodType, *_items((("", value.__func__), ("", value.__self__)), active, lambda _: ""))
    config = getattr(value, "config", None)
    if isinstance(config, pydantic.BaseModel) and hasattr(value, "__dict__"):  # a strategy: config + whatever else it holds
        rest = {k: v for k, v in vars(value).items() if k != "config"}
        return (kind, config.model_dump_json(), _items((("", rest),), active, lambda _: ".__dict__"))
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and kind.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        return (kind, _items(((f.name, getattr(value, f.name)) for f in dataclasses.fields(value)), active,
                             lambda n: f".{n}"))
    raise Uncapturable(kind)


class HostReadError(RuntimeError):
    """A step's traced graph reads tensor values back to the host (it would sync every call)."""


def host_reads(gm: torch.fx.GraphModule) -> list[str]:
    """The ops of a dynamo graph that read device values back to the host (first seen first).

    Dynamo no longer breaks the graph at every host read (it traces ``.item()`` and ``nonzero``
    into the graph as data-dependent values), so ``fullgraph=True`` alone does not prove a step
    sync-free: with static shapes (``dynamic=False``), any unbacked symbol (a size or scalar known
    only at run time) in a node's value is a host read (``.item()``, ``int(t)``, ``nonzero``, boolean
    indexing, ``unique``, ``masked_select``, ``bincount``, ...). Python branches on such values
    (``bool(t)``, ``.tolist()`` used in a loop) already fail inside dynamo.
    """
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    found = []
    for node in gm.graph.nodes:
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        value = node.meta.get("example_value")
        if value is not None and free_unbacked_symbols(value):
            found.append(target)
    return list(dict.fromkeys(found))


class _Graph:
    """One captured CUDA graph: the buffers it reads its inputs from and writes its outputs to."""

    def __init__(self, graph: Any, inputs: list[torch.Tensor], outputs: Any):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


class StepRunner:
    """``fn(*args)`` captured once per input key and replayed (see the module docstring).

    Args:
        fn: takes tensors only and returns a tensor or a tuple of tensors. It may mutate tensors
            it closes over in place (the KV cache); its Python code must not have other side
            effects, since capturing runs it again without executing its kernels.
        name: names the step in warnings and errors.
        mode: ``"eager"``, ``"compile"`` or ``"cuda_graphs"``.
        backend: the ``torch.compile`` backend of ``"compile"`` mode (tests use ``"aot_eager"``,
            which traces the same graph as ``"inductor"`` without generating code).

    In ``"cuda_graphs"`` mode the outputs of a replay are static buffers that the next call
    (any key) overwrites: consume or copy them before calling again. The first call of a key
    runs eagerly (it is the warm-up), then the graph is captured; later calls replay it.

    Attributes:
        compilations: captures made so far (compiled graphs or CUDA graphs).
    """

    def __init__(self, fn: Callable[..., Any], name: str, mode: CaptureMode, *, backend: str = "inductor"):
        if mode not in get_args(CaptureMode):
            raise ValueError(f"mode: must be one of {', '.join(get_args(CaptureMode))}, got {mode!r}")
        if mode == "cuda_graphs" and not torch.cuda.is_available():
            raise ValueError("CUDA graphs need CUDA; the model is on cpu (no CUDA device here)")
        self.fn, self.name, self.mode = fn, name, mode
        self.compilations = 0
        self.failed = False  # a capture failed: eager from then on
        self._graphs: dict[Key, _Graph] = {}
        self._seen: set[Key] = set()
        self._pool: Any = None
        self._compiled: Callable[..., Any] | None = None
        if mode == "compile":
            self._compiled = self._compile(backend)

    def _compile(self, backend: str) -> Callable[..., Any]:
        inner = torch._dynamo.lookup_backend(backend)

        def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            reads = host_reads(gm)
            if reads:  # raised inside the backend: dynamo reports it before running anything
                raise HostReadError(f"reads tensor values back to the host: {', '.join(reads[:3])}")
            self.compilations += 1
            return inner(gm, example_inputs)

        fn = self.fn

        def step(*args: torch.Tensor) -> Any:
            return fn(*args)

        # Dynamo keeps its compiled graphs on the code object: a code object of our own per runner
        # keeps runners (one per decode) from sharing, and exhausting, one recompile limit.
        own = types.FunctionType(step.__code__.replace(), step.__globals__, f"step_{self.name}", None,
                                 step.__closure__)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        return torch.compile(own, fullgraph=True, dynamic=False, backend=counting)

    def __call__(self, *args: torch.Tensor) -> Any:
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"step {self.name!r}: argument {i} must be a tensor, got {type(a).__name__}")
        if self.mode == "eager" or self.failed:
            return self.fn(*args)
        if self.mode == "compile":
            return self._call_compiled(args)
        return self._call_graph(args)

    def _fall_back(self, err: BaseException) -> None:
        self.failed = True
        err = getattr(err, "inner_exception", None) or err  # a backend's own error, not dynamo's wrapper
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        warnings.warn(f"step {self.name!r} cannot be captured ({self.mode}): {reason[:300]}; "
                      "running it eagerly from now on (same results, slower)", RuntimeWarning, stacklevel=3)

    def _call_compiled(self, args: tuple[torch.Tensor, ...]) -> Any:
        assert self._compiled is not None
        try:
            return self._compiled(*args)
        except Exception as err:  # dynamo's own errors and the symbolic-shape ones it lets through
            # Tracing fails before any kernel ran, so the eager call is the only one. An error of
            # fn itself raises again from it, as it would have eagerly, and leaves no warning.
            out = self.fn(*args)
            self._fall_back(err)
            return out

    def _call_graph(self, args: tuple[torch.Tensor, ...]) -> Any:
        for a in args:
            if a.device.type != "cuda":
                raise ValueError(f"CUDA graphs need CUDA; the model is on {a.device}")
        key: Key = tuple((tuple(a.shape), a.dtype, a.device) for a in args)
        graph = self._graphs.get(key)
        if graph is not None:
            for static, a in zip(graph.inputs, args, strict=True):
                static.copy_(a)
            graph.graph.replay()
            return graph.outputs
        if key in self._seen:  # captured before and failed for another reason: eager
            return self.fn(*args)
        self._seen.add(key)
        out = self._warm_up(args)
        try:
            self._graphs[key] = self._capture(args)
            self.compilations += 1
        except torch.cuda.OutOfMemoryError as err:
            shapes = ", ".join(str(tuple(a.shape)) for a in args)
            raise torch.cuda.OutOfMemoryError(
                f"step {self.name!r}: out of GPU memory capturing a CUDA graph for inputs of shapes {shapes}; "
                "lower the largest batch bucket or the window width (block length), or pass --no-cuda-graphs"
            ) from err
        except RuntimeError as err:  # an op that cannot be captured (e.g. a host read)
            torch.cuda.synchronize()
            self._fall_back(err)
        return out

    def _warm_up(self, args: tuple[torch.Tensor, ...]) -> Any:
        """The first call of a key, eagerly on a side stream (lazy library state, such as cuBLAS
        workspaces, is set up outside the capture). It is the real call: its outputs are returned
        and its in-place writes happen exactly once, as capturing records without running."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self.fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _capture(self, args: tuple[torch.Tensor, ...]) -> _Graph:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        inputs = [a.clone() for a in args]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self.fn(*inputs)
        return _Graph(graph, inputs, outputs)
