"""What every contract suite checks, whatever the role: configs (round trips, rejection of unknown
keys and out-of-range values), no state kept on the rule, and end-to-end decodes with a scripted
model (finished, deterministic, batch-invariant, allocating on the model's device)."""

from __future__ import annotations

import contextlib
import json
import random
from typing import Any, Callable, ClassVar, Mapping, Sequence, TypeVar

import annotated_types as at
import pytest
import torch

from dlm_toolkit.config import ConfigError, RoleSpec, StrategyConfig
from dlm_toolkit.decoding.loop import decode
from dlm_toolkit.decoding.policy import DecodingPolicy
from dlm_toolkit.strategy.policy_config import PolicyConfig
from dlm_toolkit.strategy.registry import REGISTRIES
from dlm_toolkit.step.state import row_seed
from dlm_toolkit.strategy.base import Strategy
from dlm_toolkit.testing.contracts_capture import _CaptureContract
from dlm_toolkit.testing.scripted import ScriptedLM, mixing_logits

T = TypeVar("T")


class _StrategyContract(_CaptureContract):
    """Config checks shared by every role (and the capture contract)."""

    role: ClassVar[str]
    rule_factory: ClassVar[Callable[..., Strategy] | None] = None
    configs: ClassVar[Sequence[Mapping[str, Any]]] = ({},)

    @pytest.fixture(autouse=True)
    def _single_thread(self):
        """The suites run thousands of tiny ops: one intra-op thread is much faster (and robust
        to a busy machine, where waiting on a second thread costs milliseconds per op)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(threads)

    def make_rule(self, config: Mapping[str, Any]) -> Strategy:
        """Build the rule for one of :attr:`configs` (default: ``rule_factory(dict(config))``)."""
        factory = type(self).rule_factory  # via the class: a plain function stays unbound
        if factory is None:
            raise NotImplementedError(f"{type(self).__name__}: set rule_factory or override make_rule()")
        return factory(dict(config))

    def rules(self) -> list[Strategy]:
        return [self.make_rule(c) for c in self.configs]

    def test_rule_has_role_and_strategy_config(self):
        for rule in self.rules():
            assert rule.role == self.role, f"{rule!r} has role {rule.role!r}, this suite checks {self.role!r}"
            assert issubclass(type(rule).Config, StrategyConfig), "Config must subclass StrategyConfig (frozen, extra=forbid)"
            assert type(rule).Config.model_config.get("frozen") and type(rule).Config.model_config.get("extra") == "forbid"

    def test_config_round_trip(self):
        for rule in self.rules():
            again = type(rule)(rule.config.model_dump())
            assert again.config == rule.config, f"{rule!r}: rebuilding from config.model_dump() changed the config"
            spec = RoleSpec.model_validate_json(rule.spec().model_dump_json())
            assert json.loads(json.dumps(spec.params)) == spec.params
            cls = REGISTRIES[self.role].get(spec.name)
            assert cls is type(rule), (
                f"{rule!r}: spec name {spec.name!r} resolves to {cls.__module__}:{cls.__qualname__}, not to "
                f"{type(rule).__module__}:{type(rule).__qualname__} (register the class itself, or leave it unregistered)"
            )
            assert cls(spec.params).config == rule.config, f"{rule!r}: JSON round trip of spec() changed the config"

    def test_rejects_unknown_key(self):
        for rule in self.rules():
            with pytest.raises(ConfigError):
                type(rule)({**rule.config.model_dump(), "no_such_field_xyz": 1})

    def test_rejects_bad_config(self):
        """Unknown keys are refused (``extra="forbid"``) and so is every out-of-range value."""
        for rule in self.rules():
            base = rule.config.model_dump()
            with pytest.raises(ConfigError, match="not_a_field"):
                type(rule)({**base, "not_a_field": 1})
            for name, field in type(rule).Config.model_fields.items():
                for bad in _out_of_range(field.metadata):
                    with pytest.raises(ConfigError, match=name):
                        type(rule)({**base, name: bad})

    def test_keeps_no_state(self):
        for rule in self.rules():
            policy = self.policy_for(rule)
            self._decode(rule, seed=0, prompts=[[1, 2, 3], [4, 5]], gen_length=7, policy=policy)
            objects = [rule, getattr(policy, self.role)]
            self.exercise(rule)
            for obj in objects:
                extra = sorted(set(vars(obj)) - {"config"})
                assert not extra, (
                    f"{obj!r} keeps attributes {extra}: per-decode state belongs in Selection.memory / "
                    "DecodeState, so one policy can serve concurrent decodes"
                )

    def exercise(self, rule: Strategy) -> None:
        """Run ``rule`` outside a decode too, where the role allows (selection rules: one random case)."""

    # -- end-to-end -------------------------------------------------------------------------
    def policy_for(self, rule: Strategy) -> DecodingPolicy:
        """A policy with ``rule`` in its role and simple defaults elsewhere (override to change them)."""
        raise NotImplementedError

    def is_random(self, rule: Strategy) -> bool:
        return bool(getattr(self, "uses_randomness", False))

    def _decode(self, rule: Strategy, seed: int, prompts: list[list[int]], gen_length: int,
                attention: str = "block_causal", policy: DecodingPolicy | None = None, streams: list[int] | None = None,
                default_device: str | None = None):
        """Decode with a scripted model seeded by ``seed``; rows draw from ``row_seed(seed, r)``
        unless ``streams`` gives each row's stream seed. ``default_device``: torch's default device
        during the decode (the model and the policy are made before, on the CPU)."""
        vocab = 24
        model = ScriptedLM(mixing_logits(vocab, seed=seed, scale=2.5, mix=2.0), vocab, vocab - 1, vocab - 2, attention=attention)  # type: ignore[arg-type]
        policy = policy or self.policy_for(rule)
        with torch.device(default_device) if default_device else contextlib.nullcontext():
            return decode(model, prompts, policy, gen_length, seed=streams if streams is not None else seed)

    def test_decode_end_to_end(self):
        for n, rule in enumerate(self.rules()):
            for seed in (n, n + 7):
                rng = random.Random(seed)
                prompts = [[rng.randrange(0, 22) for _ in range(rng.randint(1, 9))] for _ in range(3)]
                gen = rng.randint(4, 14)
                res = self._decode(rule, seed, prompts, gen)
                for i, p in enumerate(prompts):
                    assert res.canvas[i, : len(p)].tolist() == p, f"{rule!r} changed the prompt"
                    assert 23 not in res.tokens[i], f"{rule!r}: decode finished with masks left: {res.tokens[i]}"
                    assert len(res.tokens[i]) >= 1
                again = self._decode(rule, seed, prompts, gen)
                assert again.tokens == res.tokens, f"{rule!r}: two decodes with the same seed differ"
                for i, p in enumerate(prompts):
                    alone = self._decode(rule, seed, [p], gen, streams=[row_seed(seed, i)])
                    assert alone.tokens[0] == res.tokens[i], f"{rule!r}: batch row {i} differs from decoding it alone"
                    assert alone.rows[0].nfe == res.rows[i].nfe, f"{rule!r}: batch row {i} NFE differs from alone"

    def test_decode_allocates_on_the_model_device(self):
        """A whole decode with the default device pointed at ``meta`` and the model on the CPU: a
        tensor the rule (or the engine) makes without ``device=`` lands on ``meta`` and fails."""
        for n, rule in enumerate(self.rules()):
            args = (rule, n, [[1, 2, 3], [4, 5, 6, 7, 8]], 9)
            res = on_meta_default(lambda: self._decode(*args, default_device="meta"), lambda: self._decode(*args),
                                  f"{rule!r} (or the engine) during a decode")
            assert res.canvas.device.type == "cpu"


def on_meta_default(run_meta: Callable[[], T], run_plain: Callable[[], object], what: str) -> T:
    """``run_meta()`` (the same work as ``run_plain()`` with torch's default device pointed at
    ``meta``); if it fails, the failure is reported as a tensor made without a device only when
    ``run_plain()`` succeeds. Otherwise the error is the rule's or the engine's own (a broken
    contract, a bug) and ``run_plain()`` raises it as it is."""
    try:
        return run_meta()
    except (RuntimeError, NotImplementedError) as err:
        failure = err
    run_plain()
    raise AssertionError(f"{what} made a tensor without a device: {failure}") from failure


def _out_of_range(metadata: list[Any]) -> list[Any]:
    bad: list[Any] = []
    for m in metadata:
        if isinstance(m, at.Gt):
            bad.append(m.gt)
        elif isinstance(m, at.Ge):
            bad.append(m.ge - 1)
        elif isinstance(m, at.Lt):
            bad.append(m.lt)
        elif isinstance(m, at.Le):
            bad.append(m.le + 1)
    return bad


def _policy(**roles: RoleSpec) -> DecodingPolicy:
    data: dict[str, Any] = {
        "m2t": {"name": "threshold", "params": {"threshold": 0.5}},
        "blocks": {"name": "semi_ar", "params": {"block_length": 4, "max_post_steps": 2}},
    }
    for role, spec in roles.items():
        data[role] = spec.model_dump()
    return DecodingPolicy(PolicyConfig.model_validate(data))
