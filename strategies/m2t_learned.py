"""M2T ``learned``: a small scoring network decides which masks to commit.

Paper: learned unmasking policies for diffusion LMs (arXiv 2512.09106): instead of a hand-made
confidence rule, a light network reads per-position features of the current forward and scores
how safe committing each mask now is; the policy commits the masks it scores above a threshold.
Here the network is a one-hidden-layer MLP (ReLU) over :data:`FEATURES`, each computed from the
step context: the candidate's confidence, its top-1 minus top-2 margin, the entropy of its
distribution (nats), its relative position in the block's generated part, the block step over the
block's generated length, and the block's masked fraction now. A mask is committed iff
sigmoid(score) > ``threshold``, at least the best-scored one per step.

Choices where the paper leaves the detail to the setting: the features and the network size are
ours (small enough to fit in seconds on the testbed); the training signal of the recipe
(``experiments/train/learned_policy.py``) is supervised: whether the token sampled now is the one a
careful teacher decode (Q) ends with at that position, rather than the paper's reinforcement
learning.

The network is read from a **safetensors** file (never a pickle) named by ``path``, with a JSON
config next to it (same name, ``.json``): ``{"format": "dlm-learned-policy", "version": 1,
"features": [...], "hidden": H}`` and tensors ``w1`` (H, F), ``b1`` (H,), ``w2`` (1, H), ``b2``
(1,). ``path: shipped`` (the default) is the example fitted on ``pick`` with the shipped
testbed-v2-editable checkpoint. A missing file, a pickle, a file past 8 MiB, a config that does
not match the tensors or the features are refused when the rule is built, with one line naming
the strategy.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, field_validator

from dlm_toolkit import M2T, StepContext, StrategyConfig, UnmaskRule
from dlm_toolkit.strategy.selection import at_least_one, entropy, top2_margin
from strategies.block_geometry import block_offsets

FEATURES = ("confidence", "margin", "entropy", "relative_position", "block_progress", "masked_fraction")
FORMAT, VERSION = "dlm-learned-policy", 1
SHIPPED = Path(__file__).with_name("learned_pick.safetensors")
MAX_BYTES = 8 << 20  # a scoring network of a few hundred weights; anything far larger is not one


def features(ctx: StepContext) -> torch.Tensor:
    """(B, W, F) float32 per-position features, in the order of :data:`FEATURES`."""
    offset, span, _ = block_offsets(ctx)
    span_f = span.clamp(min=1).float()[:, None]
    width = torch.ones_like(ctx.confidence)
    return torch.stack([
        ctx.confidence,
        top2_margin(ctx.probs),
        entropy(ctx.probs),
        offset.float() / span_f,
        ctx.block_step.float()[:, None] / span_f * width,
        ctx.fillable.sum(1).float()[:, None] / span_f * width,
    ], dim=-1)


def resolve(path: str) -> Path:
    return SHIPPED if path == "shipped" else Path(path)


def check_file(path: Path) -> None:
    """Refuse what is not a small safetensors file (a pickle or ``torch.save`` zip among others)."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise ValueError(f"{path}: {size} bytes, more than the {MAX_BYTES} a scoring network may have")
    with path.open("rb") as f:
        head = f.read(9)
    if head[:1] == b"\x80" or head[:2] == b"PK":
        raise ValueError(f"{path}: a pickle / torch.save file; only safetensors files are read (never unpickled)")
    if len(head) < 9 or head[8:9] != b"{" or int.from_bytes(head[:8], "little") > size:
        raise ValueError(f"{path}: not a safetensors file")


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int, size: int) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = Path(path)
    check_file(file)
    config_file = file.with_suffix(".json")
    if not config_file.is_file():
        raise ValueError(f"{config_file}: no such file (the network's JSON config)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_file}: not a JSON config ({err})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT or config.get("version") != VERSION:
        raise ValueError(f"{config_file}: expected format {FORMAT!r} version {VERSION}")
    if list(config.get("features", [])) != list(FEATURES):
        raise ValueError(f"{config_file}: features {config.get('features')} differ from this rule's {list(FEATURES)}")
    hidden = config.get("hidden")
    if not isinstance(hidden, int) or not 1 <= hidden <= 4096:
        raise ValueError(f"{config_file}: hidden must be an integer in [1, 4096] (got {hidden!r})")
    try:
        tensors = load_file(str(file), device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{file}: unreadable safetensors file ({err})") from None
    want = {"w1": (hidden, len(FEATURES)), "b1": (hidden,), "w2": (1, hidden), "b2": (1,)}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != want:
        raise ValueError(f"{file}: tensors {got}, expected {want} for {len(FEATURES)} features and hidden {hidden}")
    if not all(v.is_floating_point() and bool(torch.isfinite(v).all()) for v in tensors.values()):
        raise ValueError(f"{file}: weights must be finite floating-point numbers")
    return {k: v.float() for k, v in tensors.items()}


def load_network(path: str, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The network's tensors on ``device``, cached per file version and device (a decode step then
    copies nothing from the host); ``ValueError`` saying what is wrong."""
    file = resolve(path)
    check_file(file)
    stat = file.stat()
    return _on_device(str(file.resolve()), stat.st_mtime_ns, stat.st_size, str(device))


@functools.lru_cache(maxsize=16)
def _on_device(path: str, mtime_ns: int, size: int, device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in _load(path, mtime_ns, size).items()}


def score(net: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """(...,) logits of the MLP for (..., F) features."""
    hidden = torch.relu(x @ net["w1"].T + net["b1"])
    return (hidden @ net["w2"].T + net["b2"]).squeeze(-1)


# Constant data of the rules (never per-decode state): the network each config path was last read
# as, by device. Module level, since a rule holds its config and nothing else.
_CPU = torch.device("cpu")
_NETWORKS: dict[tuple[str, torch.device], dict[str, torch.Tensor]] = {}


@M2T.register("learned")
class LearnedUnmask(UnmaskRule):
    class Config(StrategyConfig):
        path: str = Field("shipped", min_length=1, description="safetensors file of the scoring network ('shipped': the pick example)")
        threshold: float = Field(0.5, gt=0.0, lt=1.0, description="commit iff sigmoid(score) > threshold")

        @field_validator("path")
        @classmethod
        def _readable(cls, path: str) -> str:
            try:
                load_network(path)
            except ValueError as err:
                raise ValueError(f"m2t 'learned': {err}") from None
            return path

        def model_post_init(self, context: Any) -> None:
            # Read when the rule is built, not in a step: a step that opened and stat'ed the file
            # could not be captured (compiled or graphed). A rule built later re-reads the file.
            network = load_network(self.path)
            if _NETWORKS.get((self.path, _CPU)) is not network:
                for key in [k for k in _NETWORKS if k[0] == self.path]:
                    del _NETWORKS[key]
                _NETWORKS[(self.path, _CPU)] = network

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        net = _NETWORKS.get((self.config.path, ctx.device))
        if net is None:  # first step on this device
            net = {k: v.to(ctx.device) for k, v in _NETWORKS[(self.config.path, _CPU)].items()}
            _NETWORKS[(self.config.path, ctx.device)] = net
        logit = score(net, features(ctx))
        cut = math.log(self.config.threshold / (1 - self.config.threshold))  # sigmoid(s) > t  <=>  s > logit(t)
        return at_least_one(ctx.fillable & (logit > cut), logit, ctx.fillable)
