"""The host-read counter the engine's sync tests rely on (``dlm_toolkit.testing.HostSyncs``): every
form of host read counts exactly once, in the decode's ``inference_mode`` as with autograd on, and
device-side work counts nothing."""

import contextlib

import pytest
import torch

from dlm_toolkit.testing import HostSyncs

MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "autograd": contextlib.nullcontext}


def _t():
    return torch.tensor([0, 3, 0, 2])


READS = {
    "nonzero": lambda t: t.nonzero(),
    "nonzero(as_tuple=True)": lambda t: t.nonzero(as_tuple=True),
    "torch.nonzero(as_tuple=True)": lambda t: torch.nonzero(t, as_tuple=True),
    "torch.where(cond)": lambda t: torch.where(t > 0),
    "argwhere": lambda t: torch.argwhere(t),
    ".item()": lambda t: t.sum().item(),
    "int(t)": lambda t: int(t.sum()),
    "float(t)": lambda t: float(t.sum()),
    "bool(t)": lambda t: bool(t.any()),
    "if t": lambda t: 1 if (t > 2).any() else 0,
    "t as an index": lambda t: [0, 1, 2, 3][t[3]],
    ".tolist()": lambda t: t.tolist(),
    ".numpy()": lambda t: t.numpy(),
    "bool-mask index": lambda t: t[t > 0],
    "bool-mask index_put": lambda t: t.clone().index_put_((t > 0,), torch.tensor(1)),
    "masked_select": lambda t: t.masked_select(t > 0),
    "unique": lambda t: t.unique(),
    "unique_consecutive": lambda t: t.unique_consecutive(),
    "bincount": lambda t: torch.bincount(t),
    "repeat_interleave(tensor)": lambda t: torch.repeat_interleave(t),
    "repeat_interleave(self, tensor)": lambda t: t.repeat_interleave(t),
    "torch.equal": lambda t: torch.equal(t, t),
    "torch.allclose": lambda t: torch.allclose(t.float(), t.float()),
}

DEVICE_ONLY = {
    "arithmetic and reductions": lambda t: (t * 2 + 1).sum(-1).max(),
    "torch.where(cond, a, b)": lambda t: torch.where(t > 0, t, -t),
    "long-tensor index": lambda t: t[torch.tensor([1, 3])],
    "index_put with long indices": lambda t: t.clone().index_put_((torch.tensor([0]),), torch.tensor(5)),
    "nonzero_static": lambda t: torch.nonzero_static(t, size=4),
    "repeat_interleave with output_size": lambda t: torch.repeat_interleave(t, output_size=5),
    "repeat_interleave(int)": lambda t: t.repeat_interleave(2),
    "masked_fill": lambda t: t.masked_fill(t > 0, 0),
    "sort/topk/argmax": lambda t: (t.sort().values, t.topk(2).indices, t.argmax()),
    ".cpu() on the host": lambda t: t.cpu(),
}


CASES = {**{k: (f, 1) for k, f in READS.items()}, **{k: (f, 0) for k, f in DEVICE_ONLY.items()}}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_each_host_read_counts_once_and_device_work_not_at_all(case, mode):
    fn, reads = CASES[case]
    with MODES[mode](), HostSyncs() as syncs:
        fn(_t())
    assert syncs.count == reads, (case, mode, dict(syncs.ops))


def test_a_function_calling_nonzero_as_tuple_is_counted_in_inference_mode():
    """The KV-cache write of the model found its positions with ``nonzero(as_tuple=True)``; in
    ``inference_mode`` that reaches the dispatcher as ``nonzero_numpy``, which went uncounted."""

    def cache_positions(write: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bi, ti = write.nonzero(as_tuple=True)
        return bi, ti

    write = torch.tensor([[True, False], [True, True]])
    with torch.inference_mode(), HostSyncs() as syncs:
        cache_positions(write)
        cache_positions(write)
    assert syncs.count == 2 and syncs.ops == {"aten.nonzero_numpy.default": 2}


def test_a_copy_from_a_device_to_the_host_counts():
    """``.cpu()``/``.to("cpu")`` of a non-CPU tensor (here ``meta``, which then fails to copy: the
    count is taken before the copy runs)."""
    for copy in (lambda x: x.cpu(), lambda x: x.to("cpu"), lambda x: torch.empty(2).copy_(x)):
        with HostSyncs() as syncs, pytest.raises((NotImplementedError, RuntimeError)):
            copy(torch.empty(2, device="meta"))
        assert syncs.count == 1, dict(syncs.ops)


def test_nested_counters_both_count_and_the_wrappers_are_restored():
    tolist, numpy = torch.Tensor.tolist, torch.Tensor.numpy
    t = _t()
    with HostSyncs() as outer:
        with HostSyncs() as inner:
            t.tolist()
            t.sum().item()
        t.numpy()
    assert (inner.count, outer.count) == (2, 3)
    assert torch.Tensor.tolist is tolist and torch.Tensor.numpy is numpy
