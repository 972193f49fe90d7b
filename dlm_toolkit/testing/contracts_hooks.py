"""Contract suite of step hooks (:class:`~dlm_toolkit.hooks.base.StepHook`), for plug-in authors.

Subclass :class:`StepHookContract` in your own pytest file and say which policy runs your hook (its
rules' ``step_hooks`` ask for it)::

    from dlm_toolkit.testing import StepHookContract

    class TestFreezeFirst(StepHookContract):
        hook_type = FreezeFirst                        # optional: the hook class policy.hooks must hold

        def policy_config(self):                       # anything DecodingPolicy(...) accepts
            return {"m2t": {"name": "threshold"}, "t2t": {"name": "freeze_first"},
                    "blocks": {"name": "semi_ar", "params": {"block_length": 8}}}

        def baseline_config(self):                     # optional: the same policy without the hook
            return {**self.policy_config(), "t2t": {"name": "threshold"}}

Every ``test_*`` method decodes the contract's :attr:`~StepHookContract.prompts` (three rows of
different lengths) with a tiny random LLaDA2 model (:func:`~dlm_toolkit.testing.tiny_llada2`,
block-causal) and checks: the hook is collected and passes the build-time checks; it keeps no state on
``self`` (its ``__dict__`` is unchanged by decodes, two decodes give the same tokens); a row decodes the
same alone and in the batch, at temperature 0 and 1 (seeded); KV cache on = off and ``check_every=1`` =
``3``; its stages read nothing back to the host (``host_reads_per_stage``: the reads a stage call may
make in an eager decode, default 0); the compiled decode (``capture="compile"``, ``aot_eager``) = the
eager one, unless the suite sets ``capturable = False`` or the hook class does (hooks run eagerly
between the captured forward and rules; what is compared is how their outputs and writes meet the
captured parts); every declared output is set, each time with its declared shape and dtype; the forward
budget holds (each row's forwards per block <= the schedule's bound + the hooks' declared budgets, and
each row's NFE is the recount from the recorded trajectory plus the hook's ``extra_forward`` rows; its
commits, edits, remasks, inserts and deletes are those of its recorded steps, so a selection a hook
changes after the write is caught); and a near miss: the policy without the hook decodes the prompts
differently (else the hook is inert on them: pass prompts, ``gen_length`` or ``model_seed`` that show it
act). The base class has no ``Test`` prefix.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections import Counter, defaultdict
from typing import Any, ClassVar, Iterator, Sequence

import pytest
import torch

from dlm_toolkit.config import ConfigError
from dlm_toolkit.hooks.base import STAGES, StepHook, check_combinations, check_hook, declaration, label, overrides
from dlm_toolkit.models.base import DiffusionLM
from dlm_toolkit.decoding.engine import StepEngine
from dlm_toolkit.step.flags import FlagTable
from dlm_toolkit.decoding.loop import decode
from dlm_toolkit.step.state import DecodeResult, row_seed
from dlm_toolkit.step.trajectory import Trajectory
from dlm_toolkit.step.outputs import HookOutputs
from dlm_toolkit.decoding.policy import DecodingPolicy, StrategyError
from dlm_toolkit.testing.contracts_capture import capture_problems
from dlm_toolkit.testing.host_syncs import HostSyncs
from dlm_toolkit.testing.models import tiny_llada2


@functools.lru_cache(maxsize=4)
def _model(seed: int) -> DiffusionLM:
    return tiny_llada2(seed=seed)  # read-only in decodes: one per seed serves every test


class StepHookContract:
    """Checks one step hook end to end (module docstring). Override :meth:`policy_config` (or
    :meth:`make_policy`); optionally :meth:`baseline_config`, :meth:`make_model` and the class
    attributes below."""

    hook_type: ClassVar[type | None] = None  # the hook class policy.hooks must hold (None: any hook)
    prompts: ClassVar[Sequence[Sequence[int]]] = ([5, 6, 7], [8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18])
    gen_length: ClassVar[int] = 24
    model_seed: ClassVar[int] = 2
    seed: ClassVar[int] = 0
    capturable: ClassVar[bool] = True  # False: skip compiled = eager (a hook may also set capturable = False)
    # host reads a stage of the hook may make per call in an eager decode (e.g. 1: whether any row needs
    # the hook's forward, to skip it); 0: none, as a hook should
    host_reads_per_stage: ClassVar[int] = 0

    @pytest.fixture(autouse=True)
    def _single_thread(self) -> Iterator[None]:
        """Tiny ops: one intra-op thread is faster and robust to a busy machine."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(threads)

    # -- what the author gives -------------------------------------------------------------
    def policy_config(self) -> Any:
        """The policy that runs the hook: a preset name, a dict or a PolicyConfig."""
        raise NotImplementedError(f"{type(self).__name__}: override policy_config() or make_policy()")

    def baseline_config(self) -> Any:
        """The same policy without the hook (None: the policy with its hooks dropped)."""
        return None

    def make_policy(self, **overrides: Any) -> DecodingPolicy:
        """The policy with dotted ``overrides`` (e.g. ``{"sampling.temperature": 1.0}``)."""
        return DecodingPolicy(self.policy_config(), **overrides)

    def make_baseline(self) -> DecodingPolicy:
        config = self.baseline_config()
        if config is not None:
            return DecodingPolicy(config)
        policy = copy.copy(self.make_policy())
        policy.hooks, policy.declarations, policy.hook_outputs, policy.flags = (), (), {}, FlagTable()
        return policy

    def make_model(self) -> DiffusionLM:
        return _model(self.model_seed)

    # -- helpers ---------------------------------------------------------------------------
    def _policy(self, **overrides: Any) -> DecodingPolicy:
        """:meth:`make_policy`, a refusal failing the contract in one line."""
        try:
            return self.make_policy(**overrides)
        except ConfigError as err:
            raise AssertionError(f"{type(self).__name__}: the policy is refused when built: {err}") from err

    def _who(self, policy: DecodingPolicy) -> str:
        return ", ".join(label(h) for h in policy.hooks) or "no hook"

    def _decode(self, policy: DecodingPolicy, prompts: Sequence[Sequence[int]] | None = None,
                what: str = "decode", **kwargs: Any) -> DecodeResult:
        """A decode whose StrategyError (a refusal by the engine's checks) fails the contract."""
        prompts = [list(p) for p in (self.prompts if prompts is None else prompts)]
        kwargs.setdefault("seed", self.seed)
        try:
            return decode(self.make_model(), prompts, policy, self.gen_length, **kwargs)
        except StrategyError as err:
            raise AssertionError(f"{self._who(policy)}: the {what} failed: {err}") from err

    # -- checks ----------------------------------------------------------------------------
    def test_hook_is_collected_and_valid(self) -> None:
        policy = self._policy()
        assert policy.hooks, (f"{type(self).__name__}: the policy has no step hook (no rule's step_hooks(policy, role) "
                              "returns one)")
        if self.hook_type is not None:
            assert any(type(h) is self.hook_type for h in policy.hooks), (
                f"policy.hooks holds {[type(h).__name__ for h in policy.hooks]}, not {self.hook_type.__name__}")
        declared = []
        for hook in policy.hooks:
            assert isinstance(hook, StepHook), f"{hook!r} is not a StepHook"
            try:
                check_hook(hook)
                declared.append(declaration(hook, policy))
                hook.check_model(self.make_model())
            except ConfigError as err:
                raise AssertionError(f"{label(hook)} fails its build-time checks: {err}") from err
            assert declaration(hook, policy) == declared[-1], (
                f"{label(hook)}: declare(policy) gives another Declaration when asked again (it must depend on the "
                "hook's configuration and the policy only)")
        check_combinations(policy.hooks, declared)

    def test_keeps_no_state(self) -> None:
        policy = self._policy()
        before = [(h, {k: _snapshot(v) for k, v in vars(h).items()}) for h in policy.hooks]
        first = self._decode(policy)
        second = self._decode(policy)
        for hook, attrs in before:
            now = vars(hook)
            changed = sorted(k for k in set(attrs) | set(now)
                             if k not in attrs or k not in now or not _same(attrs[k], now[k]))
            assert not changed, (f"{label(hook)} changed its attributes {changed} in a decode: per-decode state "
                                 "belongs on the context or the decode state (a policy is shared between decodes)")
        same = first.tokens == second.tokens
        assert same, f"{self._who(policy)}: two decodes of the same prompts differ"
        same = [r.nfe for r in first.rows] == [r.nfe for r in second.rows]
        assert same, (
            f"{self._who(policy)}: two decodes of the same prompts take different NFE")

    @pytest.mark.parametrize("temperature", [0.0, 1.0])
    def test_batch_invariant(self, temperature: float) -> None:
        policy = self._policy(**{"sampling.temperature": temperature})
        batch = self._decode(policy)
        for i, prompt in enumerate(self.prompts):
            alone = self._decode(policy, [prompt], seed=[row_seed(self.seed, i)])
            same = alone.tokens[0] == batch.tokens[i] and alone.rows[0].nfe == batch.rows[i].nfe
            assert same, (
                f"{self._who(policy)}: row {i} decodes differently alone than in a batch of {len(self.prompts)} "
                f"(temperature {temperature}): {alone.tokens[0]} (NFE {alone.rows[0].nfe}) vs {batch.tokens[i]} "
                f"(NFE {batch.rows[i].nfe})")

    def test_kv_cache_and_check_every_invariant(self) -> None:
        policy = self._policy()
        base = self._decode(policy)
        for what, kwargs in (("kv_cache=False", {"kv_cache": False}), ("check_every=3", {"check_every": 3})):
            other = self._decode(policy, what=f"decode with {what}", **kwargs)
            same = other.tokens == base.tokens and [r.nfe for r in other.rows] == [r.nfe for r in base.rows]
            assert same, (
                f"{self._who(policy)}: the decode with {what} differs from the default one: {other.tokens} "
                f"(NFE {[r.nfe for r in other.rows]}) vs {base.tokens} (NFE {[r.nfe for r in base.rows]})")

    def test_compiled_equals_eager(self) -> None:
        policy = self._policy()
        if not self.capturable or not all(getattr(h, "capturable", True) for h in policy.hooks):
            pytest.skip("capturable = False (set by the suite or the hook class): compiled = eager not checked")
        problems = capture_problems(f"{self._who(policy)}", policy)  # type: ignore[arg-type]
        assert not problems, f"{self._who(policy)} is not capture-safe: " + "; ".join(problems)

    def test_reads_nothing_on_the_host(self) -> None:
        policy = self._policy()
        with _probe_host_reads(policy.hooks) as (reads, calls):
            self._decode(policy)
        for hook in policy.hooks:
            ops, allowed = reads[label(hook)], self.host_reads_per_stage * calls[label(hook)]
            assert sum(ops.values()) <= allowed, (
                f"{label(hook)} read the device from the host {sum(ops.values())} times in a decode "
                f"({', '.join(f'{op} x{n}' for op, n in ops.most_common())}; allowed: {allowed}): a hook runs on the "
                "device (errors go through device flags); on a GPU each read stalls the step")

    def test_declared_outputs_are_set_as_declared(self) -> None:
        policy = self._policy()
        declared = {name: (label(h), out) for h in policy.hooks
                    for name, out in declaration(h, policy).outputs.items()}
        seen: set[str] = set()
        with _probe_outputs(declared, seen):
            self._decode(policy, record=True)
        unset = sorted(set(declared) - seen)
        assert not unset, (f"{self._who(policy)} declares outputs {unset} but never set them on the contract's "
                           "prompts (drop the declaration, or pass prompts where the hook sets them)")

    def test_forward_budget_holds_and_counters_recount(self) -> None:
        policy = self._policy()
        bound = policy.blocks.max_forwards_per_block()
        budget = sum(declaration(h, policy).forward_budget for h in policy.hooks)
        assert policy.forward_limit() == bound + budget, (
            f"policy.forward_limit() = {policy.forward_limit()}, not the schedule's {bound} + the hooks' {budget}")
        with _probe_forwards() as events:
            res = self._decode(policy, record=True, check_every=1)
        per_block: dict[tuple[int, int], int] = defaultdict(int)
        per_row: dict[int, int] = defaultdict(int)
        pending: dict[int, int] = defaultdict(int)  # extra forwards of a row not yet given to its step
        for kind, payload in events:
            if kind == "extra":
                for r in payload:
                    pending[r] += 1
                continue
            for step in payload:
                n = 1 + pending.pop(step.row, 0)
                per_block[(step.row, step.block)] += n
                per_row[step.row] += n
        for r, row in enumerate(res.rows):
            assert row.nfe == per_row[r] + pending.get(r, 0), (
                f"{self._who(policy)}: row {r} reports NFE {row.nfe}, the trajectory's steps plus extra "
                f"forwards recount {per_row[r] + pending.get(r, 0)}")
        for r, row in enumerate(res.rows):
            steps = res.trajectory.for_row(r)
            recount = {name: sum(len(getattr(s, name)) for s in steps)
                       for name in ("commit", "edit", "remask", "insert", "delete")}
            counted = {"commit": row.commits, "edit": row.edits, "remask": row.remasks, "insert": row.inserts,
                       "delete": row.deletes}
            assert counted == recount, (
                f"{self._who(policy)}: row {r}'s counters {counted} differ from the recount of its recorded steps "
                f"{recount} (a selection changed after the write was counted?)")
        worst = max(per_block.items(), key=lambda kv: kv[1], default=((0, 0), 0))
        assert worst[1] <= bound + budget, (
            f"{self._who(policy)}: row {worst[0][0]} took {worst[1]} forwards in block {worst[0][1]}, over the "
            f"schedule's bound {bound} + the declared budget {budget}")

    def test_near_miss_without_the_hook(self) -> None:
        policy, baseline = self._policy(), self.make_baseline()
        assert not baseline.hooks or {type(h) for h in baseline.hooks} != {type(h) for h in policy.hooks}, (
            f"{type(self).__name__}: the baseline policy holds the same hooks")
        got, plain = self._decode(policy), self._decode(baseline, what="decode without the hook")
        differs = got.tokens != plain.tokens or [r.nfe for r in got.rows] != [r.nfe for r in plain.rows]
        assert differs, (
            f"{self._who(policy)} is inert on the contract's prompts: the policy without it decodes the same "
            "tokens and NFE (set prompts, gen_length or model_seed to ones where the hook acts)")


def _snapshot(value: Any) -> Any:
    """``value`` as it is now: tensors and containers copied (a hook may change them in place), any
    other object kept by reference (compared by identity: a hook's rule or schedule)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value) if type(value) in (list, tuple) else value
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return set(value)
    return value


def _same(then: Any, now: Any) -> bool:
    """``now`` is what :func:`_snapshot` saw as ``then``."""
    if isinstance(then, torch.Tensor):
        return (isinstance(now, torch.Tensor) and then.shape == now.shape and then.dtype == now.dtype
                and bool(torch.equal(then, now.detach().cpu().to(then.device))))
    if type(then) in (list, tuple):
        return type(now) is type(then) and len(now) == len(then) and all(_same(a, b) for a, b in zip(then, now))
    if isinstance(then, dict):
        return (isinstance(now, dict) and then.keys() == now.keys()
                and all(_same(then[k], now[k]) for k in then))
    if isinstance(then, set):
        return isinstance(now, (set, frozenset)) and then == set(now)
    if isinstance(then, (int, float, str, bytes, bool, type(None))):
        return type(then) is type(now) and then == now
    return then is now


def _fits(value: Any, out: Any, hooks: HookOutputs) -> bool:
    """``value`` against a declaration, independently of HookOutputs' own check."""
    if out.shape == ():
        return type(value) is out.dtype or (out.dtype is float and type(value) is int)
    sizes = {"B": hooks._window[0], "W": hooks._window[1], "V": hooks._vocab}
    dtype = hooks._logits_dtype if out.dtype == "logits" else out.dtype
    return (isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(sizes[d] for d in out.shape)
            and (dtype is None or value.dtype == dtype))


@contextlib.contextmanager
def _probe_outputs(declared: dict[str, tuple[str, Any]], seen: set[str]) -> Iterator[None]:
    """Check every ``ctx.hooks`` write against its declaration before the namespace does."""
    original = HookOutputs.set

    def probe(self: HookOutputs, hook: Any, name: str, value: Any) -> None:
        if name in declared:
            who, out = declared[name]
            got = (f"a {tuple(value.shape)} {value.dtype} tensor" if isinstance(value, torch.Tensor)
                   else f"a {type(value).__name__}")
            assert _fits(value, out, self), (
                f"{who}: output '{name}' must be {out.describe(self._window, self._vocab, self._logits_dtype)}, "
                f"got {got}")
            seen.add(name)
        original(self, hook, name, value)

    HookOutputs.set = probe  # type: ignore[method-assign]
    try:
        yield
    finally:
        HookOutputs.set = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _probe_host_reads(hooks: Sequence[StepHook]) -> Iterator[tuple[dict[str, Counter[str]], Counter[str]]]:
    """Count each hook's host reads in its stages (what they call counted too: the engine's
    ``extra_forward`` reads nothing), and its stage calls."""
    reads: dict[str, Counter[str]] = {label(h): Counter() for h in hooks}
    calls: Counter[str] = Counter()

    def counted(hook: StepHook, method: Any) -> Any:
        def run(*args: Any) -> Any:
            with HostSyncs() as syncs:
                out = method(*args)
            reads[label(hook)].update(syncs.ops)
            calls[label(hook)] += 1
            return out

        return run

    stages = ("step_segments",) + STAGES
    wrapped = [(h, stage) for h in hooks for stage in stages
               if overrides(h, stage) and stage not in vars(h)]
    for hook, stage in wrapped:  # on the object: HookStages takes the bound method when the decode starts
        setattr(hook, stage, counted(hook, getattr(hook, stage)))
    try:
        yield reads, calls
    finally:
        for hook, stage in wrapped:
            delattr(hook, stage)


@contextlib.contextmanager
def _probe_forwards() -> Iterator[list[tuple[str, Any]]]:
    """Record, in order, each hook's extra forward (its rows) and each step the trajectory records."""
    events: list[tuple[str, Any]] = []
    extra, add = StepEngine.extra_forward, Trajectory.add

    def extra_probe(self: StepEngine, segments: Any, rows: torch.Tensor) -> Any:
        if isinstance(rows, torch.Tensor) and rows.dtype == torch.bool:
            events.append(("extra", [int(r) for r in rows.nonzero().flatten().tolist()]))
        return extra(self, segments, rows)

    def add_probe(self: Trajectory, ctx: Any, state: Any) -> None:
        start = len(self.steps)
        add(self, ctx, state)
        events.append(("steps", self.steps[start:]))

    StepEngine.extra_forward, Trajectory.add = extra_probe, add_probe  # type: ignore[method-assign]
    try:
        yield events
    finally:
        StepEngine.extra_forward, Trajectory.add = extra, add  # type: ignore[method-assign]
