"""Statistics that say when two policies really differ.

- :func:`wilson`: the Wilson score interval of a proportion (good at small n and near 0 or 1,
  where the normal interval collapses).
- :func:`mcnemar_exact`: the exact (binomial) McNemar test on paired binary outcomes: only the
  discordant pairs carry information about a difference in accuracy.
- :func:`paired_bootstrap`: a seeded percentile bootstrap of a paired difference, resampling
  instances (so both policies are always scored on the same draw): for accuracy and for TPF, a
  ratio of sums that no closed form covers.
- :func:`compare_outcomes`: both, for two evaluations of the same instances.

Optuna optimises point estimates; these numbers are for reading the result.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["PairedComparison", "compare_outcomes", "envelope", "mcnemar_exact", "paired_bootstrap", "wilson"]

Z95 = 1.959963984540054  # two-sided 95 % normal quantile


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval ``(low, high)`` for ``successes`` out of ``n`` (95 % by default).

    ``successes`` may be fractional (a mean score times ``n``); ``n = 0`` gives ``(0, 1)``.
    """
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # the interval holds p; rounding alone could put an end a hair past it at p = 0 or 1 (then an
    # error bar of p - low or high - p is negative, which matplotlib refuses)
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


def envelope(points: Sequence[Any]) -> list[tuple[float, float]]:
    """(TPF, accuracy) of the non-dominated points (mappings with ``tpf`` and ``accuracy``), TPF
    ascending, accuracy then descending: the speed-quality curve a set of runs reaches."""
    pts = sorted({(p["tpf"], p["accuracy"]) for p in points}, key=lambda q: (-q[0], -q[1]))
    out: list[tuple[float, float]] = []
    for tpf, acc in pts:  # fastest first: keep a point only if it is more accurate than every faster one
        if not out or acc > out[-1][1]:
            out.append((tpf, acc))
    return out[::-1]


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts: instances right under A only
    (``only_a``) and under B only (``only_b``). Under "no difference" each discordant pair is a
    fair coin, so the p-value is a two-sided binomial tail (capped at 1)."""
    if only_a < 0 or only_b < 0:
        raise ValueError(f"counts must be >= 0, got {only_a}, {only_b}")
    n, k = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_bootstrap(
    a: Sequence[Sequence[float]],
    b: Sequence[Sequence[float]],
    statistic: Callable[[list[Sequence[float]]], float],
    *,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float, float]:
    """``(difference, low, high)`` of ``statistic(b) - statistic(a)`` with a percentile bootstrap
    interval. ``a[i]`` and ``b[i]`` are the per-instance records (tuples) of instance ``i`` under
    the two policies; every resample draws the same instances for both."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need two non-empty paired samples of one length, got {len(a)} and {len(b)}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = random.Random(seed)
    n = len(a)
    diffs = []
    for _ in range(n_boot):
        idx = [rng.randrange(n) for _ in range(n)]
        diffs.append(statistic([b[i] for i in idx]) - statistic([a[i] for i in idx]))
    diffs.sort()
    lo = diffs[int(math.floor((1 - level) / 2 * (n_boot - 1)))]
    hi = diffs[int(math.ceil((1 + level) / 2 * (n_boot - 1)))]
    return statistic(list(b)) - statistic(list(a)), lo, hi


def _accuracy(rows: list[Sequence[float]]) -> float:
    return sum(r[0] for r in rows) / len(rows)


def _tpf(rows: list[Sequence[float]]) -> float:
    return sum(r[1] for r in rows) / max(sum(r[2] for r in rows), 1)


@dataclass(frozen=True)
class PairedComparison:
    """B minus A on the same instances (see :func:`compare_outcomes`)."""

    n: int
    accuracy_a: float
    accuracy_b: float
    accuracy_diff: float
    accuracy_diff_interval: tuple[float, float]
    only_a: int  # instances right under A only
    only_b: int  # instances right under B only
    mcnemar_p: float
    tpf_a: float
    tpf_b: float
    tpf_diff: float
    tpf_diff_interval: tuple[float, float]

    @property
    def accuracy_differs(self) -> bool:
        """The McNemar test rejects "same accuracy" at 5 %."""
        return self.mcnemar_p < 0.05

    @property
    def tpf_differs(self) -> bool:
        """The bootstrap interval of the TPF difference excludes 0."""
        lo, hi = self.tpf_diff_interval
        return lo > 0 or hi < 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"accuracy_differs": self.accuracy_differs, "tpf_differs": self.tpf_differs}


def compare_outcomes(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]], *, n_boot: int = 2000,
                     seed: int = 0) -> PairedComparison:
    """Compare two evaluations' per-instance records (``score``, ``tokens``, ``nfe``), instance by
    instance: exact McNemar for accuracy (scores rounded to right/wrong), paired bootstrap intervals
    for the accuracy and TPF differences (TPF = tokens summed over NFE summed)."""
    if len(a) != len(b):
        raise ValueError(f"the two evaluations cover {len(a)} and {len(b)} instances: not paired")
    ra = [(float(r["score"]), float(r["tokens"]), float(r["nfe"])) for r in a]
    rb = [(float(r["score"]), float(r["tokens"]), float(r["nfe"])) for r in b]
    only_a = sum(x[0] >= 0.5 > y[0] for x, y in zip(ra, rb))
    only_b = sum(y[0] >= 0.5 > x[0] for x, y in zip(ra, rb))
    acc, acc_lo, acc_hi = paired_bootstrap(ra, rb, _accuracy, n_boot=n_boot, seed=seed)
    tpf, tpf_lo, tpf_hi = paired_bootstrap(ra, rb, _tpf, n_boot=n_boot, seed=seed + 1)
    return PairedComparison(
        n=len(ra), accuracy_a=_accuracy(ra), accuracy_b=_accuracy(rb), accuracy_diff=acc,
        accuracy_diff_interval=(acc_lo, acc_hi), only_a=only_a, only_b=only_b,
        mcnemar_p=mcnemar_exact(only_a, only_b), tpf_a=_tpf(ra), tpf_b=_tpf(rb), tpf_diff=tpf,
        tpf_diff_interval=(tpf_lo, tpf_hi),
    )
