"""dlm-toolkit: decoding strategies for diffusion language models.

Authoring API (see README "Write a strategy"): the registries ``M2T``, ``T2T``, ``BLOCKS``,
``REMASK``; base classes ``UnmaskRule``, ``EditRule``, ``BlockSchedule``, ``RemaskRule``;
``StrategyConfig``; ``StepContext``; ``Selection``. Running: :func:`decode` with a
:class:`DecodingPolicy`.
"""

from dlm_toolkit.config import ConfigError, SamplingConfig, StrategyConfig
from dlm_toolkit.policy_config import PolicyConfig, load_policy
from dlm_toolkit.registry import BLOCKS, M2T, REMASK, T2T, PluginError
from dlm_toolkit.state import DecodeResult, DecodeState, RowResult
from dlm_toolkit.strategy import (
    BlockSchedule,
    EditRule,
    RemaskRule,
    Selection,
    StepContext,
    UnmaskRule,
)
from dlm_toolkit.policy import DecodingPolicy, NonFiniteLogitsError, StrategyError
from dlm_toolkit.decode import decode

__version__ = "0.1.0"

__all__ = [
    "BLOCKS",
    "M2T",
    "REMASK",
    "T2T",
    "BlockSchedule",
    "ConfigError",
    "DecodeResult",
    "DecodeState",
    "DecodingPolicy",
    "EditRule",
    "NonFiniteLogitsError",
    "PluginError",
    "PolicyConfig",
    "RemaskRule",
    "RowResult",
    "SamplingConfig",
    "Selection",
    "StepContext",
    "StrategyConfig",
    "StrategyError",
    "UnmaskRule",
    "decode",
    "load_policy",
]
