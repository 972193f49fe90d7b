"""The counter-based random draws (``dlm_toolkit/step/rng.py``) against plain-Python references."""

from __future__ import annotations

import random

import torch

from dlm_toolkit.step import rng
from dlm_toolkit.testing import make_context


def lowbias32(x: int) -> int:  # Wellons' reference, in Python integers
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_is_lowbias32_in_32_bit_arithmetic():
    r = random.Random(0)
    xs = [0, 1, 0xFFFFFFFF, 0x80000000] + [r.getrandbits(32) for _ in range(2000)]
    got = rng.mix32(torch.tensor(xs, dtype=torch.long)).tolist()
    assert got == [lowbias32(x) for x in xs]


def test_key_chains_every_word_of_the_key():
    seed = torch.tensor([(1 << 62) + 12345, -7], dtype=torch.long)
    step = torch.tensor([3, 0])
    pos = torch.tensor([[5, 6], [0, 1]])
    got = rng.key(seed, step, pos, 2).tolist()
    for b in range(2):
        s = seed[b].item() & (2**64 - 1)
        for w in range(2):
            h = lowbias32(s & 0xFFFFFFFF)
            h = lowbias32(h ^ (s >> 32))
            h = lowbias32(h ^ step[b].item())
            h = lowbias32(h ^ pos[b, w].item())
            assert got[b][w] == lowbias32(h ^ 2)


def test_uniforms_are_uniform_and_in_range():
    base = rng.key(torch.arange(4), torch.zeros(4, dtype=torch.long), torch.arange(64).expand(4, 64), 0)
    for dtype in (torch.float32, torch.float64):
        u = rng.uniform(base, (512,), dtype)  # 131072 numbers
        assert u.dtype == dtype and u.min() >= 0 and u.max() < 1
        assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
        counts = torch.histc(u.double(), bins=16, min=0, max=1)
        expected = u.numel() / 16
        chi2 = (((counts - expected) ** 2) / expected).sum().item()
        assert chi2 < 50  # 15 degrees of freedom: p ~ 1e-5
        # neighbours are unrelated (trailing index and position)
        flat = u.reshape(-1).double()
        assert abs(torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1].item()) < 0.01
    u64 = rng.uniform(base, (512,), torch.float64)
    assert ((u64 * 2**24) % 1 != 0).float().mean() > 0.99  # float64 draws carry more than 24 bits
    assert rng.uniform(base, (), torch.bfloat16).max() < 1


def test_a_rows_draws_do_not_depend_on_its_batch_or_window():
    """The same (seed, step, position) draws the same number in a batch of one and of three, with a
    wide or a narrow window; another seed, step, position or draw index draws another."""
    V = 8
    logits = torch.zeros(3, 6, V)
    tokens = torch.full((3, 6), V - 1)
    wide = make_context(tokens, logits, mask_token_id=V - 1, seed=[11, 22, 33], step=4)
    narrow = make_context(tokens[1:2, 2:], logits[1:2, 2:], mask_token_id=V - 1, seed=[22], step=4)
    narrow.positions = narrow.positions + 2  # the same absolute positions as the wide window's
    a, b = wide.rand(V), narrow.rand(V)
    assert torch.equal(a[1, 2:], b[0])
    assert not torch.equal(a[0], a[1])  # another seed
    assert not torch.equal(wide.rand(V)[1], a[1])  # the next draw of the step
    later = make_context(tokens, logits, mask_token_id=V - 1, seed=[11, 22, 33], step=5)
    assert not torch.equal(later.rand(V)[1], a[1])  # another step
    padded = make_context(tokens, logits, mask_token_id=V - 1, seed=0, valid=torch.arange(6).expand(3, 6) >= 2)
    assert (padded.rand(V)[:, :2] == 1.0).all()
