"""The rules' step through a :class:`~dlm_toolkit.step.capture.StepRunner`: each rule captured once per
input layout (batch bucket, window width, memory layout) and replayed.

A rule sees a :class:`~dlm_toolkit.strategy.base.StepContext`; a runner takes tensors only. So each rule
call is flattened: the context's tensor fields, the selections made earlier in the step and the
leaves of ``ctx.memory`` go in, and the rule runs on a context rebuilt from them inside the
captured function (its Python ints, such as the draw index, are constants of the capture). The
runner's key is derived from that function's closure (:func:`dlm_toolkit.step.capture.closure_key`), not
listed by hand. A rule that cannot be captured (a host read such as ``.item()`` or
``nonzero``, a graph break, memory that is not tensors, a closed-over value with no canonical form)
runs eagerly after one warning naming it,
with the same results: capture never changes tokens.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils import _pytree as pytree

from dlm_toolkit.step.capture import Channel, StepRunner, Uncapturable, closure_key
from dlm_toolkit.strategy.base import Selection, StepContext, Strategy
from dlm_toolkit.step.outputs import HookOutputs

CTX_TENSORS = ("rows", "positions", "tokens", "valid", "masked", "is_prompt", "in_block", "editable", "sampled",
               "confidence", "logits", "written_step", "written_conf", "step", "block", "block_step",
               "block_masked_start", "post", "live", "seeds", "probs")
# the selections a later rule of the step may read: passed when set (the hook outputs set so far are
# passed too, tensors as arguments, numbers as constants); which are set is part of the capture's key
EARLIER = ("commit", "edit")


class RuleRunners:
    """Runs the rules of a policy's step captured (``mode`` as :class:`StepRunner`'s).

    ``store`` keeps the runners across decodes (the engine passes the model's shared store). A
    runner's key is derived from the function it captures (:func:`~dlm_toolkit.step.capture.closure_key`):
    the rule (class, config and anything else it holds), the memory's layout, the selections and hook
    outputs set so far, the draw index and the context's other constants. So nothing a rule depends on
    can be left out of the key by hand; a rule whose closure cannot be canonicalised runs eagerly
    after one warning.
    """

    def __init__(self, policy: Any, mode: str, backend: str, store: dict[tuple, Any]):
        self.policy, self.mode, self.backend, self.store = policy, mode, backend, store
        self.eager: set[int] = set()  # rules warned about (uncapturable closures) in this decode

    def step(self, ctx: StepContext, memory: dict[str, Any]) -> None:
        """:meth:`DecodingPolicy.step`, each rule through its runner."""
        policy = self.policy
        ctx.commit = policy.check_selection(policy.m2t, ctx, self.run(policy.m2t, ctx, memory))
        ctx.edit = policy.check_selection(policy.t2t, ctx, self.run(policy.t2t, ctx, memory))
        ctx.remask = policy.check_selection(policy.remask, ctx, self.run(policy.remask, ctx, memory))

    def run(self, rule: Strategy, ctx: StepContext, memory: dict[str, Any]) -> Any:
        """The rule's selection for ``ctx`` (its memory stored in ``memory`` as the eager step does)."""
        leaves, spec = pytree.tree_flatten(dict(ctx.memory))
        fn = None
        if all(isinstance(v, torch.Tensor) for v in leaves):  # else not flattenable to tensors: eager
            names = tuple(name for name in EARLIER if getattr(ctx, name) is not None)
            hooks = ctx.hooks
            outputs = tuple(n for n in hooks.names() if isinstance(hooks.get(n), torch.Tensor))
            constants = {n: hooks.get(n) for n in hooks.names() if n not in outputs}
            fn, result = captured(rule, spec, names, outputs, constants, ctx)
            try:
                key = ("rule", self.mode, rule.role, rule.name, closure_key(fn))  # role, name: labels to read it by
            except Uncapturable as err:
                if id(rule) not in self.eager:
                    self.eager.add(id(rule))
                    warnings.warn(f"{rule.role} rule '{rule.name}' cannot be captured ({self.mode}): {err}; "
                                  "running it eagerly (same results, slower)", RuntimeWarning, stacklevel=2)
                fn = None
        if fn is None:
            out = rule(ctx)
            if isinstance(out, Selection):
                memory[rule.role] = out.memory
                return out.select
            return out
        entry = self.store.get(key)
        if entry is None:
            entry = self.store[key] = (StepRunner(fn, f"{rule.role} rule '{rule.name}'", self.mode,
                                                  backend=self.backend), result)
        runner, result = entry
        tensors = [ctx.probs if name == "probs" else getattr(ctx, name) for name in CTX_TENSORS]
        out = runner(*tensors, *(getattr(ctx, n) for n in names), *(hooks.get(n) for n in outputs), *leaves)
        ctx.draws = result["draws"]
        if result["memory"] is not None:  # the rule returned a Selection
            memory[rule.role] = pytree.tree_unflatten(list(out[1:]), result["memory"])
        return out[0]


def captured(rule: Strategy, spec: Any, names: tuple[str, ...], outputs: tuple[str, ...], constants: dict[str, Any],
             ctx: StepContext) -> tuple[Any, Channel]:
    """The function a rule's runner captures: tensors in (:data:`CTX_TENSORS`, the selections
    ``names``, the hook outputs ``outputs``, the memory's leaves laid out as ``spec``), the rule's
    selection (and memory leaves) out; and the channel it reports its draw count and memory layout in.
    Everything else it needs it closes over: that closure is the runner's key."""
    n, n_names, n_outputs = len(CTX_TENSORS), len(names), len(outputs)
    draws, mask_id, eos_id, batch_rows = ctx.draws, ctx.mask_token_id, ctx.eos_token_id, ctx.batch_rows
    declared = dict(ctx.hooks.declared)
    result = Channel(draws=draws, memory=None)  # filled while tracing/warming up

    def fn(*args: torch.Tensor) -> tuple[Any, ...]:
        fields = dict(zip(CTX_TENSORS, args[:n]))
        probs = fields.pop("probs")
        logits = fields["logits"]
        hooks = HookOutputs(declared, tuple(fields["tokens"].shape), logits.shape[-1], logits.dtype)
        hooks._load({**constants, **dict(zip(outputs, args[n + n_names:n + n_names + n_outputs]))})
        inner = StepContext(**fields, memory=pytree.tree_unflatten(list(args[n + n_names + n_outputs:]), spec),
                            mask_token_id=mask_id, eos_token_id=eos_id, batch_rows=batch_rows, draws=draws,
                            hooks=hooks, **dict(zip(names, args[n:n + n_names])))
        inner.__dict__["probs"] = probs  # the sampler's softmax, not a recomputed one
        out = rule(inner)
        result["draws"] = inner.draws
        if isinstance(out, Selection):
            mem_leaves, result["memory"] = pytree.tree_flatten(out.memory)
            return (out.select, *mem_leaves)
        return (out,)

    return fn, result
