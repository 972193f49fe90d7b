"""The step-hook contract suite (dlm_toolkit.testing.StepHookContract) run on the built-in hooks --
verification (s2d2), the shadow block (wino_shadow), insert/delete (indel), dynamic blocks (dsb) --
and shown to bite: one deliberately broken hook per check fails that check, next to the same hook
done right passing it."""

from __future__ import annotations

import pytest

from dlm_toolkit.testing import StepHookContract


def cfg(m2t=("threshold", {"threshold": 0.7}), t2t=("none", {}), remask=("none", {}),
        blocks=("semi_ar", {"block_length": 8, "max_post_steps": 4})):
    return {role: {"name": name, "params": params}
            for role, (name, params) in (("m2t", m2t), ("t2t", t2t), ("remask", remask), ("blocks", blocks))}


class TestVerifyHook(StepHookContract):
    def policy_config(self):
        return cfg(m2t=("s2d2", {"threshold": 0.7}))

    def baseline_config(self):
        return cfg()


class TestShadowHook(StepHookContract):
    def policy_config(self):
        return cfg(m2t=("wino", {"threshold": 0.3}), remask=("wino_shadow", {"threshold": 0.9}))

    def baseline_config(self):
        return cfg(m2t=("wino", {"threshold": 0.3}), remask=("wino", {"threshold": 0.9}))


class TestIndelHook(StepHookContract):
    def policy_config(self):
        return cfg(t2t=("indel", {"threshold": 0.5, "delete_threshold": 0.5, "insert_threshold": 0.5,
                                  "keep_below": 0.9}))

    def baseline_config(self):
        return cfg(t2t=("threshold", {"threshold": 0.5}))


class TestDynamicBlocksHook(StepHookContract):
    def policy_config(self):
        return cfg(blocks=("dsb", {"block_length": 8}))

    def baseline_config(self):
        return cfg()
