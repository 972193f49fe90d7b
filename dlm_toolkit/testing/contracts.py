"""Contract test suites for strategy authors, in the style of ``optuna.testing``.

Subclass the suite of your rule's role in your own pytest file; pytest then runs every
``test_*`` method below against your rule::

    from dlm_toolkit.testing import UnmaskRuleContract
    from my_package.rules import MyRule

    class TestMyRule(UnmaskRuleContract):
        rule_factory = MyRule                       # a class, or any callable(config) -> rule
        configs = [{}, {"threshold": 0.5}]          # optional: configs to check (default: [{}])
        uses_randomness = False                     # True if the rule draws random numbers (ctx.rand)

The suites check the role's contract on many random contexts (random masks, prompts, blocks,
edit windows; flat, peaked, uniform and one-hot logits) built with
:func:`~dlm_toolkit.testing.make_context`, over three consecutive steps that share memory:
the selection's type and shape, that it stays inside the allowed positions (the contexts hold
masks outside the active block and left padding, which no role may select), progress, batch
invariance (row i of a batch selects what row i alone selects, random rules included: each row
draws from its own stream), determinism under a seed, that the rule allocates nothing off the
device of its inputs (it runs with the default device pointed at ``meta``, so a tensor made
without ``device=`` fails), that it keeps no state on itself, config round trips (dict and JSON
via ``rule.spec()``), rejection of unknown keys and out-of-range values, and an end-to-end decode
with a scripted model that must finish with no mask left. The base classes have no ``Test`` prefix, so pytest collects only your subclasses.
Override :meth:`~_StrategyContract.make_rule` instead of ``rule_factory`` when building the
rule needs more than a config, and :meth:`~_RuleContract.is_random` when only some configs
draw random numbers.
"""

from __future__ import annotations

import contextlib
import json
import random
from typing import Any, Callable, ClassVar, Mapping, Sequence

import annotated_types as at
import pytest
import torch

from dlm_toolkit.config import ConfigError, RoleSpec, StrategyConfig
from dlm_toolkit.policy_config import PolicyConfig
from dlm_toolkit.decode import decode
from dlm_toolkit.policy import DecodingPolicy
from dlm_toolkit.registry import REGISTRIES
from dlm_toolkit.state import row_seed
from dlm_toolkit.selection import remaskable, top1
from dlm_toolkit.strategy import BlockSchedule, Selection, StepContext, Strategy
from dlm_toolkit.testing.context import make_context
from dlm_toolkit.testing.scripted import ScriptedLM, mixing_logits

__all__ = ["UnmaskRuleContract", "EditRuleContract", "RemaskRuleContract", "BlockScheduleContract", "random_case", "build_context"]

STEPS = 3  # consecutive steps per random case (memory carries across them)


# -- random contexts --------------------------------------------------------------------------
def random_case(seed: int) -> dict[str, Any]:
    """A random batch of windows as plain tensors (build contexts from it with :func:`build_context`).

    Window ``[0, W)`` with the active block ``[lo, W)``; per row left padding (positions outside
    the window) before the block, a prompt length, masks in the non-prompt part of the block (none,
    some or all) and sometimes before it (a rule must not commit those), written tokens elsewhere;
    logits of one kind: flat, peaked, mixed scales, exactly uniform or one-hot, with the mask
    token's logit sometimes the largest (a degenerate model). Sometimes the edit window spans the
    whole window (multi-block editing).
    """
    g = random.Random(seed)
    tg = torch.Generator().manual_seed(seed)
    b, w, v = g.choice([1, 2, 3, 3, 4]), g.randint(2, 12), g.randint(6, 16)
    mask_id, eos_id = v - 1, v - 2
    lo = g.randint(0, w - 1) if g.random() < 0.3 else g.randint(0, w // 2)
    pos = torch.arange(w)
    in_block = (pos >= lo).expand(b, w).clone()
    pad = torch.tensor([g.randint(0, lo) if g.random() < 0.3 else 0 for _ in range(b)])
    valid = pos[None, :] >= pad[:, None]
    prompt_len = torch.tensor([w if g.random() < 0.1 else g.choice([0, 1, lo, g.randint(0, lo + 1)]) for _ in range(b)])
    is_prompt = pos[None, :] < prompt_len[:, None]
    rate = torch.tensor([g.choice([0.0, 0.3, 0.6, 0.8, 1.0, 1.0]) for _ in range(b)])[:, None]
    masked = in_block & ~is_prompt & (torch.rand(b, w, generator=tg) < rate)
    if g.random() < 0.4:  # masks outside the active block: never fillable
        masked |= valid & ~in_block & ~is_prompt & (torch.rand(b, w, generator=tg) < 0.5)
    tokens = torch.randint(0, v - 1, (b, w), generator=tg).masked_fill(masked, mask_id)
    kind = g.choice(["flat", "peaked", "mixed", "mixed", "mixed", "uniform", "onehot"])
    if kind == "uniform":
        logits = torch.zeros(b, w, v)
    elif kind == "onehot":
        logits = torch.zeros(b, w, v).scatter(-1, torch.randint(0, v - 1, (b, w, 1), generator=tg), 30.0)
    else:
        scale = {"flat": 0.3, "peaked": 6.0}.get(kind) or torch.rand(b, w, 1, generator=tg) * 8
        logits = torch.randn(b, w, v, generator=tg) * scale
    mask_wins = torch.rand(b, w, generator=tg) < (0.3 if g.random() < 0.3 else 0.0)
    logits[..., mask_id] = torch.where(mask_wins, logits.max(-1).values + 1.0, logits[..., mask_id] - 2.0)
    written = valid & ~masked & ~is_prompt
    n_gen_block = (in_block & ~is_prompt).sum(1)
    n_masked = (masked & in_block).sum(1)
    block_step = torch.tensor([g.randint(0, w + 2) for _ in range(b)])
    step = block_step + torch.tensor([g.randint(0, 20) for _ in range(b)])
    return dict(
        tokens=tokens,
        logits=logits,
        mask_token_id=mask_id,
        eos_token_id=eos_id,
        valid=valid,
        prompt_len=prompt_len,
        in_block=in_block,
        editable_region=torch.ones(b, w, dtype=torch.bool) if g.random() < 0.3 else in_block.clone(),
        block_step=block_step,
        block_masked_start=n_masked + ((n_gen_block - n_masked).float() * g.random()).long(),
        step=step,
        written_step=torch.where(written, (torch.rand(b, w, generator=tg) * step[:, None]).long(), -1),
        written_conf=torch.where(written, torch.rand(b, w, generator=tg), 0.0),
    )


PER_ROW = ("tokens", "logits", "valid", "prompt_len", "in_block", "editable_region", "block_step",
           "block_masked_start", "step", "written_step", "written_conf")


def build_context(case: Mapping[str, Any], rows: Sequence[int] | None = None, *, seed: int = 0,
                  memory: dict[str, Any] | None = None) -> StepContext:
    """A :class:`StepContext` for ``case`` (or only its ``rows``, keeping their batch-row ids and
    their random streams: row i draws from ``row_seed(seed, i)`` alone or in the batch)."""
    n = case["tokens"].shape[0]
    idx = torch.arange(n) if rows is None else torch.as_tensor(list(rows))
    part = {k: case[k][idx] for k in PER_ROW}
    return make_context(mask_token_id=case["mask_token_id"], eos_token_id=case["eos_token_id"],
                        seed=[row_seed(seed, int(i)) for i in idx], rows=idx.clone(), batch_rows=n,
                        memory=memory if memory is not None else {}, **part)


def advance(case: dict[str, Any], ctx: StepContext, seed: int) -> dict[str, Any]:
    """The case one step later: commits/edits written, remasks applied, logits nudged at some positions."""
    tg = torch.Generator().manual_seed(seed)
    new = dict(case)
    tokens = torch.where(ctx.commit | ctx.edit, ctx.sampled, case["tokens"])
    new["tokens"] = tokens.masked_fill(ctx.remask, case["mask_token_id"])
    wrote = ctx.commit | ctx.edit
    new["written_step"] = torch.where(wrote, case["step"][:, None], case["written_step"]).masked_fill(ctx.remask, -1)
    new["written_conf"] = torch.where(wrote, ctx.confidence, case["written_conf"]).masked_fill(ctx.remask, 0.0)
    nudge = (torch.rand(case["tokens"].shape, generator=tg) < 0.5)[..., None]
    noise = torch.randn(case["logits"].shape, generator=tg) * 0.05
    new["logits"] = torch.where(nudge, case["logits"] + noise, case["logits"])
    new["block_step"] = case["block_step"] + 1
    new["step"] = case["step"] + 1
    return new


def _commit_for(ctx: StepContext, threshold: float) -> torch.Tensor:
    """A threshold M2T selection with the top-1 fallback (stands in for the policy's m2t)."""
    commit = ctx.fillable & (ctx.confidence > threshold)
    need = ctx.fillable.any(1) & ~commit.any(1)
    return commit | (top1(ctx.confidence, ctx.fillable) & need[:, None])


def _as_tensor(rule: Strategy, out: Any) -> tuple[torch.Tensor, Any]:
    select, memory = (out.select, out.memory) if isinstance(out, Selection) else (out, None)
    assert isinstance(select, torch.Tensor), f"{rule!r} returned {type(select).__name__}, expected a bool tensor or Selection"
    return select, memory


# -- shared: config contracts ------------------------------------------------------------------
class _StrategyContract:
    """Config checks shared by every role."""

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
            if isinstance(self, _RuleContract):
                self.run_case(rule, random_case(1), 1)
            for obj in objects:
                extra = sorted(set(vars(obj)) - {"config"})
                assert not extra, (
                    f"{obj!r} keeps attributes {extra}: per-decode state belongs in Selection.memory / "
                    "DecodeState, so one policy can serve concurrent decodes"
                )

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
            try:
                res = self._decode(rule, n, [[1, 2, 3], [4, 5, 6, 7, 8]], 9, default_device="meta")
            except (RuntimeError, NotImplementedError) as err:
                raise AssertionError(f"{rule!r} (or the engine) made a tensor without a device during a decode: {err}") from err
            assert res.canvas.device.type == "cpu"


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


# -- selection rules: m2t, t2t, remask -------------------------------------------------------
class _RuleContract(_StrategyContract):
    """Checks shared by the three selection roles, on random contexts over consecutive steps."""

    uses_randomness: ClassVar[bool] = False
    n_cases: ClassVar[int] = 30

    def prepare(self, ctx: StepContext) -> None:
        """Fill what the policy decides before this role runs (``ctx.commit``, ``ctx.edit``)."""

    def allowed(self, ctx: StepContext) -> torch.Tensor:
        raise NotImplementedError

    def store(self, ctx: StepContext, select: torch.Tensor) -> None:
        setattr(ctx, {"m2t": "commit", "t2t": "edit", "remask": "remask"}[self.role], select)

    def check(self, rule: Strategy, ctx: StepContext, select: torch.Tensor, where: str) -> None:
        """Role invariants for one output (type, shape, allowed positions, progress)."""
        assert select.dtype == torch.bool, f"{rule!r} {where}: selection dtype {select.dtype}, expected torch.bool"
        assert select.shape == ctx.tokens.shape, f"{rule!r} {where}: selection shape {tuple(select.shape)}, expected {tuple(ctx.tokens.shape)}"
        outside = select & ~self.allowed(ctx)
        assert not outside.any(), f"{rule!r} {where}: selected positions {outside.nonzero().tolist()} outside the allowed ones"

    def run_case(self, rule: Strategy, case: dict[str, Any], seed: int, generator_seed: int | None = None
                 ) -> tuple[list[dict[str, Any]], list[torch.Tensor]]:
        """Run ``STEPS`` consecutive steps of one random case, memory carried, each output checked.

        Returns the case of every step (the canvas moves on with the rule's own selections) and
        the selections. The rows' random streams are seeded from ``generator_seed`` (default ``seed``).
        """
        cases, outs, memory = [case], [], {}
        gen = seed if generator_seed is None else generator_seed
        for s in range(STEPS):
            ctx = build_context(cases[-1], seed=gen + s, memory=memory)
            before = (ctx.tokens.clone(), ctx.confidence.clone(), ctx.logits.clone())
            self.prepare(ctx)
            select, mem = _as_tensor(rule, rule(ctx))
            after = (ctx.tokens, ctx.confidence, ctx.logits)
            assert all(torch.equal(a, b) for a, b in zip(before, after)), f"{rule!r} modified the context's tensors"
            self.check(rule, ctx, select, f"(case seed {seed}, step {s})")
            memory = {**memory, rule.role: mem} if mem is not None else memory
            outs.append(select)
            self.store(ctx, select)
            for name in ("commit", "edit", "remask"):
                if getattr(ctx, name) is None:
                    setattr(ctx, name, torch.zeros_like(select))
            if s + 1 < STEPS:
                cases.append(advance(cases[-1], ctx, seed + 100 + s))
        return cases, outs

    def test_selection_contract_on_random_contexts(self):
        for rule in self.rules():
            for seed in range(self.n_cases):
                self.run_case(rule, random_case(seed), seed)

    def test_deterministic_under_seed(self):
        for rule in self.rules():
            for seed in range(0, self.n_cases, 3):
                _, a = self.run_case(rule, random_case(seed), seed)
                _, b = self.run_case(rule, random_case(seed), seed)
                assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{rule!r}: same contexts and seed, different selections"

    def test_ignores_seed_unless_random(self):
        for rule in self.rules():
            if self.is_random(rule):
                continue
            for seed in range(0, self.n_cases, 3):
                _, a = self.run_case(rule, random_case(seed), seed)
                _, b = self.run_case(rule, random_case(seed), seed, generator_seed=seed + 1000)
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (
                    f"{rule!r} depends on the random streams: set uses_randomness = True (or override is_random) in the suite"
                )

    def test_allocates_on_the_inputs_device(self):
        """The rule runs with the default device pointed at ``meta`` while its inputs are on the CPU:
        a tensor made without ``device=`` (``torch.zeros(n)``, ``torch.arange(w)``) lands on ``meta``
        and fails to mix with the inputs, as it would fail on a GPU."""
        for rule in self.rules():
            for seed in range(0, self.n_cases, 4):
                memory: dict[str, Any] = {}
                ctx = build_context(random_case(seed), seed=seed, memory=memory)
                self.prepare(ctx)
                try:
                    with torch.device("meta"):
                        select, _ = _as_tensor(rule, rule(ctx))
                except (RuntimeError, NotImplementedError) as err:
                    raise AssertionError(f"{rule!r} made a tensor without a device (case seed {seed}): {err}") from err
                assert select.device == ctx.device, f"{rule!r} returned a selection on {select.device}, inputs are on {ctx.device}"

    def test_batch_invariance(self):
        for rule in self.rules():
            for seed in range(self.n_cases):
                cases, batch_outs = self.run_case(rule, random_case(seed), seed)
                for i in range(cases[0]["tokens"].shape[0]):
                    memory: dict[str, Any] = {}
                    for s, case in enumerate(cases):  # row i alone along the batch's trajectory
                        ctx = build_context(case, [i], seed=seed + s, memory=memory)
                        self.prepare(ctx)
                        alone, mem = _as_tensor(rule, rule(ctx))
                        memory = {**memory, rule.role: mem} if mem is not None else memory
                        assert torch.equal(batch_outs[s][i], alone[0]), (
                            f"{rule!r} (case seed {seed}, step {s}): batch row {i} selects "
                            f"{batch_outs[s][i].nonzero().flatten().tolist()}, alone {alone[0].nonzero().flatten().tolist()}"
                        )


class UnmaskRuleContract(_RuleContract):
    """Contract suite for M2T rules (:class:`~dlm_toolkit.strategy.UnmaskRule`).

    Checks, besides the shared ones: the commit lies inside ``ctx.fillable`` and holds at least
    one position in every row whose active block has a mask. End-to-end policy: this rule, T2T
    ``threshold`` 0.8, ``semi_ar`` blocks of 4 with 2 post steps.
    """

    role = "m2t"

    def allowed(self, ctx: StepContext) -> torch.Tensor:
        return ctx.fillable

    def check(self, rule: Strategy, ctx: StepContext, select: torch.Tensor, where: str) -> None:
        super().check(rule, ctx, select, where)
        stalled = ctx.fillable.any(1) & ~select.any(1)
        assert not stalled.any(), f"{rule!r} {where}: no commit in rows {stalled.nonzero().flatten().tolist()} whose block has masks"

    def policy_for(self, rule: Strategy) -> DecodingPolicy:
        return _policy(m2t=rule.spec(), t2t=RoleSpec(name="threshold", params={"threshold": 0.8}))


class EditRuleContract(_RuleContract):
    """Contract suite for T2T rules (:class:`~dlm_toolkit.strategy.EditRule`).

    Checks, besides the shared ones: the edit lies inside ``ctx.editable`` (``ctx.commit`` is
    filled first, as the policy does). End-to-end policy: M2T ``threshold`` 0.5, this rule,
    ``semi_ar`` blocks of 4 with 2 post steps.
    """

    role = "t2t"

    def prepare(self, ctx: StepContext) -> None:
        ctx.commit = _commit_for(ctx, 0.5)

    def allowed(self, ctx: StepContext) -> torch.Tensor:
        return ctx.editable

    def policy_for(self, rule: Strategy) -> DecodingPolicy:
        return _policy(m2t=RoleSpec(name="threshold", params={"threshold": 0.5}), t2t=rule.spec())


class RemaskRuleContract(_RuleContract):
    """Contract suite for remask rules (:class:`~dlm_toolkit.strategy.RemaskRule`).

    Checks, besides the shared ones: the remask lies inside ``remaskable(ctx)`` (written,
    non-prompt, in the active block, not edited now) in rows whose block still has masks, and leaves net progress ``commits - remasks >= 1`` per such row
    (``ctx.commit`` and ``ctx.edit`` are filled first, as the policy does). End-to-end policy:
    M2T ``threshold`` 0.3, T2T ``threshold`` 0.8, this rule, ``semi_ar`` blocks of 4.
    """

    role = "remask"

    def prepare(self, ctx: StepContext) -> None:
        ctx.commit = _commit_for(ctx, 0.3)
        ctx.edit = ctx.editable & (ctx.sampled != ctx.tokens) & (ctx.confidence > 0.8)

    def allowed(self, ctx: StepContext) -> torch.Tensor:
        return remaskable(ctx)

    def check(self, rule: Strategy, ctx: StepContext, select: torch.Tensor, where: str) -> None:
        super().check(rule, ctx, select, where)
        net = ctx.commit.sum(1) - select.sum(1)
        bad = ctx.fillable.any(1) & (net < 1)
        assert not bad.any(), f"{rule!r} {where}: rows {bad.nonzero().flatten().tolist()} remask as many as they commit"

    def policy_for(self, rule: Strategy) -> DecodingPolicy:
        return _policy(m2t=RoleSpec(name="threshold", params={"threshold": 0.3}),
                       t2t=RoleSpec(name="threshold", params={"threshold": 0.8}), remask=rule.spec())


# -- block schedules -------------------------------------------------------------------------
class BlockScheduleContract(_StrategyContract):
    """Contract suite for block schedules (:class:`~dlm_toolkit.strategy.BlockSchedule`).

    Checks, besides the config ones: ``layout`` covers the generated span (the first block holds
    the first generated position, the last one reaches ``prompt + gen_length``); end-to-end
    decodes (block-causal and full attention, with T2T edits and low-confidence remasking in the
    policy) finish with no mask, keep the prompt, stay within ``max_forwards_per_block`` (the
    engine raises otherwise) and give each batch row what decoding it alone gives; on a real
    LLaDA2 model the KV-cache path gives what recomputing the prefix gives.
    The subclass's configs should use small blocks (the default block length is a good start).
    """

    role = "blocks"

    def policy_for(self, rule: Strategy) -> DecodingPolicy:
        return _policy(m2t=RoleSpec(name="threshold", params={"threshold": 0.5}),
                       t2t=RoleSpec(name="threshold", params={"threshold": 0.6}),
                       remask=RoleSpec(name="low_confidence", params={"threshold": 0.3}), blocks=rule.spec())

    def test_layout_covers_generation(self):
        for rule in self.rules():
            assert isinstance(rule, BlockSchedule)
            bl = rule.block_length
            for seed in range(10):
                g = random.Random(seed)
                prompt_len = torch.tensor([g.randint(1, 3 * bl) for _ in range(g.randint(1, 4))])
                gen = g.randint(1, 3 * bl)
                origin, first, num = rule.layout(prompt_len, gen)
                assert origin.shape == first.shape == num.shape == prompt_len.shape
                start = origin + first * bl
                assert (start <= prompt_len).all() and (start + bl > prompt_len).all(), (
                    f"{rule!r}: the first decoded block must hold the first generated position"
                )
                assert (origin + num * bl >= prompt_len + gen).all(), f"{rule!r}: blocks end before prompt + gen_length"
                assert (first < num).all()

    def test_max_forwards_per_block_is_positive(self):
        for rule in self.rules():
            assert int(rule.max_forwards_per_block()) >= 1

    def test_kv_cache_matches_recompute(self):
        """On a real LLaDA2 model (block-causal, with a KV cache) the decode with the cache equals
        the decode that recomputes the prefix every forward: a cache boundary that lets a position
        enter the cache before it is final, or attention groups that let a cached position see
        a later one, change tokens or forward counts here."""
        from dlm_toolkit.testing.models import tiny_llada2

        model = tiny_llada2(5)
        for n, rule in enumerate(self.rules()):
            rng = random.Random(n)
            prompts = [[rng.randrange(0, 60) for _ in range(rng.randint(1, 9))] for _ in range(2)]
            policy, gen = self.policy_for(rule), 3 * rule.block_length  # several blocks: the cache fills
            on = decode(model, prompts, policy, gen, kv_cache=True, seed=n)
            off = decode(model, prompts, policy, gen, kv_cache=False, seed=n)
            assert on.tokens == off.tokens, f"{rule!r}: tokens with the KV cache differ from recomputing"
            assert [r.nfe for r in on.rows] == [r.nfe for r in off.rows], f"{rule!r}: NFE with the KV cache differs"

    def test_decode_full_attention(self):
        for n, rule in enumerate(self.rules()):
            prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
            res = self._decode(rule, n, prompts, 9, attention="full")
            for i, p in enumerate(prompts):
                assert 23 not in res.tokens[i] and res.canvas[i, : len(p)].tolist() == p
                alone = self._decode(rule, n, [p], 9, attention="full", streams=[row_seed(n, i)])
                assert alone.tokens[0] == res.tokens[i], f"{rule!r}: batch row {i} differs from decoding it alone"


def _policy(**roles: RoleSpec) -> DecodingPolicy:
    data: dict[str, Any] = {
        "m2t": {"name": "threshold", "params": {"threshold": 0.5}},
        "blocks": {"name": "semi_ar", "params": {"block_length": 4, "max_post_steps": 2}},
    }
    for role, spec in roles.items():
        data[role] = spec.model_dump()
    return DecodingPolicy(PolicyConfig.model_validate(data))
