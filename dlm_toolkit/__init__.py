"""dlm-toolkit: decoding strategies for diffusion language models.

Authoring API (see README "Write a strategy"): the registries ``M2T``, ``T2T``, ``BLOCKS``,
``REMASK``; base classes ``UnmaskRule``, ``EditRule``, ``BlockSchedule``, ``RemaskRule``;
``StrategyConfig``; ``StepContext``; ``Selection``. Running: :func:`decode` with a
:class:`DecodingPolicy`. Step hooks (README "Step hooks"): the protocol :class:`StepHook` and
the built-in hook mixins :class:`Verifier`, :class:`Shadow`, :class:`Indel` and the schedule
:class:`DynamicBlockSchedule`; what a hook declares (:class:`Declaration`) and uses: :class:`Output` (its outputs on
``ctx.hooks``), :class:`DeviceFlag` and :func:`set_flag` (its errors), :class:`Segment` and
:class:`Keys` (what it adds to a forward).

Package layout (README "Layout"): ``step/`` the decode step's types and mechanics, ``strategy/``
the authoring API and registry, ``hooks/`` the step-hook protocol and built-in hooks,
``decoding/`` the policy and the loop on top of them, ``training/``,
``evaluation/``, ``models/``, ``tasks/``, ``sweep/``, ``util/``. The old flat module paths
(``dlm_toolkit.verify``, ``dlm_toolkit.policy``, ...) still import: each is an alias of the same
module object at its new home (``dlm_toolkit/_aliases.py`` lists them).
"""

from types import ModuleType

from dlm_toolkit import _aliases

from dlm_toolkit.config import ConfigError, SamplingConfig, StrategyConfig
from dlm_toolkit.strategy.policy_config import PolicyConfig, load_policy
from dlm_toolkit.strategy.registry import BLOCKS, M2T, REMASK, T2T, PluginError
from dlm_toolkit.step.state import DecodeResult, DecodeState, RowResult
from dlm_toolkit.strategy.base import (
    BlockSchedule,
    EditRule,
    RemaskRule,
    Selection,
    StepContext,
    UnmaskRule,
)
from dlm_toolkit.decoding.policy import DecodingPolicy, NonFiniteLogitsError, StrategyError
from dlm_toolkit.decoding.loop import decode
from dlm_toolkit.hooks.base import Declaration, StepHook
from dlm_toolkit.step.flags import DeviceFlag, set_flag
from dlm_toolkit.step.segments import Keys, Segment
from dlm_toolkit.step.outputs import Output
from dlm_toolkit.hooks.verify import Verifier
from dlm_toolkit.hooks.shadow import Shadow
from dlm_toolkit.hooks.indel import Indel
from dlm_toolkit.hooks.dynamic_blocks import DynamicBlockSchedule
from dlm_toolkit.step.trajectory import Trajectory as _Trajectory
from dlm_toolkit.step.trajectory import register_html_renderer as _register_html_renderer

_aliases.install()
_aliases.register_loaded()


def _trajectory_html(trajectory: _Trajectory) -> str:
    # the viewer loads on the first display only, so `import dlm_toolkit` stays cheap
    from dlm_toolkit.viewer import view

    return view(trajectory)._repr_html_()


_register_html_renderer(_trajectory_html)


def __getattr__(name: str) -> ModuleType:
    """An old flat module path as an attribute (``dlm_toolkit.verify``): its module object."""
    return _aliases.attribute(name)

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
    "DeviceFlag",
    "DynamicBlockSchedule",
    "EditRule",
    "Indel",
    "Keys",
    "NonFiniteLogitsError",
    "Output",
    "PluginError",
    "PolicyConfig",
    "RemaskRule",
    "RowResult",
    "SamplingConfig",
    "Segment",
    "Selection",
    "Shadow",
    "StepHook",
    "Declaration",
    "StepContext",
    "StrategyConfig",
    "StrategyError",
    "UnmaskRule",
    "Verifier",
    "decode",
    "load_policy",
    "set_flag",
]
