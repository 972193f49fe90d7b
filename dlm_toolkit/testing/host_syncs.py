"""Count the host reads of a block of code: every place where the host would wait for a GPU.

On a GPU each such read stalls the host until the device has caught up, so a decode step that
reads the device many times cannot keep it busy. Counting them on the CPU (where nothing stalls)
lets tests pin how many reads a step makes, without a GPU.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Operators whose result the host needs to see (a Python scalar, or an output shape that depends on
# the data). Under ``torch.inference_mode`` (the decode's mode) the composite operators reach the
# dispatcher whole (``item``, ``is_nonzero``, ``nonzero_numpy``, ``where(cond)``, ``argwhere``); with
# autograd on they arrive decomposed (``_local_scalar_dense``, ``nonzero``): both spellings are here,
# and a call is seen in only one of them, so nothing is counted twice.
HOST_READ_OPS = frozenset({
    aten._local_scalar_dense.default,  # .item(), int(t), float(t), bool(t), t used as an index
    aten.item.default,
    aten.is_nonzero.default,  # bool(t), if t: ...
    aten.nonzero.default,
    aten.nonzero_numpy.default,  # t.nonzero(as_tuple=True)
    aten.argwhere.default,
    aten.where.default,  # torch.where(cond) with one argument
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default,
    aten.bincount.default,
    aten.equal.default,
    aten.allclose.default,
})
# the output length is the sum of the repeats unless ``output_size`` is given
REPEAT_OPS = frozenset({aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor})
# boolean-mask indexing needs the number of selected positions
INDEX_OPS = frozenset({aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
                       aten._index_put_impl_.default})
# a copy that may move a tensor to the host
COPY_OPS = frozenset({aten._to_copy.default, aten.to.dtype_layout, aten.to.device, aten.copy_.default})


def host_read(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the operator call ``func(*args, **kwargs)`` makes the host wait for the device."""
    if func in HOST_READ_OPS:
        return True
    if func in REPEAT_OPS:
        return kwargs.get("output_size") is None
    if func in INDEX_OPS:
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None)
    if func in COPY_OPS:
        return _to_host(func, args, kwargs)
    return False


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """A copy from a device tensor into host memory (never true on a CPU-only run, where every
    tensor already is on the host: there the Python-level reads are what is counted)."""
    src = args[1] if func is aten.copy_.default else args[0]
    if func is aten.copy_.default:
        dst = args[0].device
    else:
        dst = kwargs.get("device")
        if dst is None and func is aten.to.device:
            dst = args[1]
    if not isinstance(src, torch.Tensor) or dst is None:
        return False
    return src.device.type != "cpu" and torch.device(dst).type == "cpu"


class HostSyncs(TorchDispatchMode):
    """Counts, while active, the operations that make the host wait for the device: ``.item()``,
    ``int(t)``/``float(t)``/``bool(t)`` (and ``if t:``), ``nonzero`` in every form
    (``as_tuple=True``, ``torch.where(cond)``, ``argwhere``), boolean-mask indexing, ``masked_select``,
    ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``, ``torch.equal``/
    ``allclose``, copies from a device to the host, and ``.tolist()``/``.numpy()`` (which the
    dispatcher does not see on the CPU, so they are wrapped while the counter is active).

    ``count`` is the total; ``ops`` counts them by operator name, for failure messages::

        with HostSyncs() as syncs:
            step()
        assert syncs.count <= 1, syncs.ops
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.ops: Counter[str] = Counter()

    def _add(self, name: str) -> None:
        self.count += 1
        self.ops[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if host_read(func, args, kwargs):
            self._add(str(func))
        return func(*args, **kwargs)

    def __enter__(self) -> HostSyncs:
        self._saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, self._wrap(name, method))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def _wrap(self, name: str, method: Any) -> Any:
        def read(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._add(f"Tensor.{name}")
            return method(t, *args, **kwargs)

        return read
