"""The rules' step through a :class:`~dlm_toolkit.step.capture.StepRunner`: each rule captured once per
input layout (batch bucket, window width, memory layout) and replayed.

A rule sees a :class:`~dlm_toolkit.strategy.base.StepContext`; a runner takes tensors only. So each rule
call is flattened: the context's tensor fields, the selections made earlier in the step and the
leaves of ``ctx.memory`` go in, and the rule runs on a context rebuilt from them inside the
captured function (its Python ints, such as the draw index, are constants of the capture, so they
are part of its key). A rule that cannot be captured (a host read such as ``.item()`` or
``nonzero``, a graph break, memory that is not tensors) runs eagerly after one warning naming it,
with the same results: capture never changes tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from dlm_toolkit.strategy.base import Selection, StepContext, Strategy

CTX_TENSORS = ("rows", "positions", "tokens", "valid", "masked", "is_prompt", "in_block", "editable", "sampled",
               "confidence", "logits", "written_step", "written_conf", "step", "block", "block_step",
               "block_masked_start", "post", "live", "seeds", "probs")
# set only in some steps or policies: selections a later rule of the step may read, the shadow block's
# confidences (dlm_toolkit.hooks.shadow); passed when set, and which are set is part of the capture's key
EARLIER = ("commit", "edit", "shadow_confidence")


class RuleRunners:
    """Runs the rules of a policy's step captured (``mode`` as :class:`StepRunner`'s).

    ``store`` keeps the runners across decodes (the engine passes the model's shared store), keyed
    by the rule's name and config, its role, and the layout of what it is given.
    """

    def __init__(self, policy: Any, mode: str, backend: str, store: dict[tuple, Any]):
        self.policy, self.mode, self.backend, self.store = policy, mode, backend, store

    def step(self, ctx: StepContext, memory: dict[str, Any]) -> None:
        """:meth:`DecodingPolicy.step`, each rule through its runner."""
        policy = self.policy
        ctx.commit = policy.check_selection(policy.m2t, ctx, self.run(policy.m2t, ctx, memory))
        ctx.edit = policy.check_selection(policy.t2t, ctx, self.run(policy.t2t, ctx, memory))
        ctx.remask = policy.check_selection(policy.remask, ctx, self.run(policy.remask, ctx, memory))

    def run(self, rule: Strategy, ctx: StepContext, memory: dict[str, Any]) -> Any:
        """The rule's selection for ``ctx`` (its memory stored in ``memory`` as the eager step does)."""
        leaves, spec = pytree.tree_flatten(dict(ctx.memory))
        if not all(isinstance(v, torch.Tensor) for v in leaves):  # not flattenable to tensors: eager
            out = rule(ctx)
            if isinstance(out, Selection):
                memory[rule.role] = out.memory
                return out.select
            return out
        names = tuple(name for name in EARLIER if getattr(ctx, name) is not None)
        earlier = tuple(getattr(ctx, name) for name in names)
        key = ("rule", self.mode, rule.role, rule.name, rule.config.model_dump_json(), str(spec), names,
               ctx.draws, ctx.mask_token_id, ctx.eos_token_id, ctx.batch_rows)
        entry = self.store.get(key)
        if entry is None:
            entry = self.store[key] = self._runner(rule, spec, names, ctx)
        runner, result = entry
        tensors = [ctx.probs if name == "probs" else getattr(ctx, name) for name in CTX_TENSORS]
        out = runner(*tensors, *earlier, *leaves)
        ctx.draws = result["draws"]
        if result["memory"] is not None:  # the rule returned a Selection
            memory[rule.role] = pytree.tree_unflatten(list(out[1:]), result["memory"])
        return out[0]

    def _runner(self, rule: Strategy, spec: Any, names: tuple[str, ...], ctx: StepContext) -> tuple[Any, dict[str, Any]]:
        from dlm_toolkit.step.capture import StepRunner

        n = len(CTX_TENSORS)
        draws, mask_id, eos_id, batch_rows = ctx.draws, ctx.mask_token_id, ctx.eos_token_id, ctx.batch_rows
        n_earlier = len(names)
        result: dict[str, Any] = {"draws": draws, "memory": None}  # filled while tracing/warming up

        def fn(*args: torch.Tensor) -> tuple[Any, ...]:
            fields = dict(zip(CTX_TENSORS, args[:n]))
            probs = fields.pop("probs")
            inner = StepContext(**fields, memory=pytree.tree_unflatten(list(args[n + n_earlier:]), spec),
                                mask_token_id=mask_id, eos_token_id=eos_id, batch_rows=batch_rows, draws=draws,
                                **dict(zip(names, args[n:n + n_earlier])))
            inner.__dict__["probs"] = probs  # the sampler's softmax, not a recomputed one
            out = rule(inner)
            result["draws"] = inner.draws
            if isinstance(out, Selection):
                mem_leaves, result["memory"] = pytree.tree_flatten(out.memory)
                return (out.select, *mem_leaves)
            return (out,)

        label = f"{rule.role} rule '{rule.name}'"
        return StepRunner(fn, label, self.mode, backend=self.backend), result
