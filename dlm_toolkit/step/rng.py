"""Counter-based random numbers: a uniform draw is a hash of (row seed, step, position, draw, index).

Why not ``torch.Generator`` streams: a stream per row needs a Python loop over rows and a number
of draws that depends on the row's window, neither of which a captured (CUDA-graph / compiled)
step can have. A keyed hash needs neither: the number at (row seed, row step, absolute position,
draw index within the step, trailing index) is the same whatever batch the row is in and however
wide the window is, so batch invariance holds by construction, and the whole draw is a handful of
elementwise integer ops on the device.

The hash is 32-bit arithmetic carried in ``int64`` tensors (every product stays below 2**63, so
no backend relies on signed overflow): Wellons' ``lowbias32`` finaliser chained over the key
words. A float32 uniform takes 24 bits of one hash, a float64 uniform 53 bits of two.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_M16 = 0xFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32 multipliers
_LANE2 = 0x9E3779B9  # golden-ratio constant: a second, unrelated hash lane for float64


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32`` without int64 overflow (``c`` split in halves)."""
    lo = x * (c & _M16)
    hi = ((x * (c >> 16)) & _M16) << 16
    return (lo + hi) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 finaliser on ``int64`` tensors holding values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def key(seed: torch.Tensor, step: torch.Tensor, position: torch.Tensor, draw: int) -> torch.Tensor:
    """``(B, W)`` int64 hash of each row's seed ``(B,)`` (any int64), its step ``(B,)``, the absolute
    ``position`` ``(B, W)`` and the draw index within the step."""
    s = seed[:, None]
    h = mix32(s & _M32)
    h = mix32(h ^ ((s >> 32) & _M32))
    h = mix32(h ^ (step[:, None] & _M32))
    h = mix32(h ^ (position & _M32))
    return mix32(h ^ (draw & _M32))


def uniform(base: torch.Tensor, trailing: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``base.shape + trailing`` uniforms in ``[0, 1)`` from the ``(B, W)`` keys ``base``: element
    ``j`` (row-major over ``trailing``) of position (b, w) hashes ``base[b, w]`` with ``j``."""
    n = 1
    for t in trailing:
        n *= t
    index = torch.arange(n, device=base.device).view(*trailing) if trailing else torch.zeros((), dtype=torch.long,
                                                                                              device=base.device)
    h = mix32(base.view(*base.shape, *[1] * len(trailing)) ^ index)
    if dtype == torch.float64:
        h2 = mix32(h ^ _LANE2)
        return ((h >> 5) * (1 << 26) + (h2 >> 6)).to(torch.float64) * (2.0 ** -53)
    u = (h >> 8).to(torch.float32) * (2.0 ** -24)  # exact in float32, < 1
    if dtype == torch.float32:
        return u
    # a narrower float could round up to 1.0: keep the draw inside [0, 1)
    return u.clamp(max=1.0 - torch.finfo(dtype).eps).to(dtype)
