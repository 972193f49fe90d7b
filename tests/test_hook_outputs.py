"""Step hooks' outputs in one typed namespace (``ctx.hooks``), hook bad input refused naming the hook
(policy build: near-miss stage names, stage signatures, output declarations, one owner per output; run
time: wrong shape/dtype, a selection a hook moved out of its region), the documented read-only
properties, and trajectories recording per-slot outputs. Every accepted case has a near miss beside it."""

from __future__ import annotations

import pytest
import torch

from dlm_toolkit import T2T, ConfigError, DecodingPolicy, StrategyError, decode
from dlm_toolkit.hooks.base import KNOWN, Declaration, HookStages, StepHook, check_hook, collect, declaration
from dlm_toolkit.strategy import Output
from dlm_toolkit.testing import make_context, tiny_llada2
from strategies.t2t_threshold import ThresholdEdit

M = 5  # mask id of the hand-built contexts


PROBE_OUTPUTS = {
    "score": Output(("B", "W"), torch.float32),
    "rows_ok": Output(("B",), torch.bool),
    "scale": Output((), float),
    "count": Output((), int),
    "lg": Output(("B", "W", "V"), "logits"),
}


class Probe(StepHook):
    def declare(self, policy):
        return Declaration(outputs=PROBE_OUTPUTS)


class Other(StepHook):
    name = "t2t rule 'other'"

    def declare(self, policy):
        return Declaration(outputs={"other": Output(("B", "W"), torch.bool)})


def ctx_with(*hooks: StepHook):
    tokens = torch.tensor([[1, M, M, 2], [3, 4, M, M]])
    logits = torch.zeros(2, 4, 6)
    return make_context(tokens, logits, mask_token_id=M, hooks=hooks)


PROBE = "step hook 'Probe'"


def test_declared_outputs_are_set_and_read_back_wrong_shape_or_dtype_refused_naming_the_hook():
    probe = Probe()
    ctx = ctx_with(probe)
    assert ctx.hooks.score is None  # declared, not set yet this step
    score = torch.rand(2, 4)
    ctx.hooks.set(probe, "score", score)
    assert ctx.hooks.score is score and ctx.hooks.names() == ("score",)
    with pytest.raises(StrategyError, match=rf"^{PROBE}: output 'score' must be a \(2, 4\) torch.float32 tensor "
                                            r"\(B, W\), got a \(2, 3\) torch.float32 tensor$"):
        ctx.hooks.set(probe, "score", torch.rand(2, 3))  # W one short
    with pytest.raises(StrategyError, match=r"output 'score' must be .*, got a \(3, 4\) torch.float32"):
        ctx.hooks.set(probe, "score", torch.rand(3, 4))  # B one too many
    with pytest.raises(StrategyError, match=r"output 'score' must be .*, got a \(2, 4\) torch.float64"):
        ctx.hooks.set(probe, "score", torch.rand(2, 4, dtype=torch.float64))
    with pytest.raises(StrategyError, match=r"output 'score' must be .*, got list"):
        ctx.hooks.set(probe, "score", [[0.0] * 4] * 2)
    ctx.hooks.set(probe, "rows_ok", torch.ones(2, dtype=torch.bool))
    with pytest.raises(StrategyError, match=r"output 'rows_ok' must be a \(2,\) torch.bool tensor \(B\), got a \(2,\) torch.int64"):
        ctx.hooks.set(probe, "rows_ok", torch.ones(2, dtype=torch.long))
    ctx.hooks.set(probe, "lg", torch.zeros(2, 4, 6))  # 'logits': the step's logits dtype and vocabulary
    with pytest.raises(StrategyError, match=r"output 'lg' must be a \(2, 4, 6\) torch.float32 tensor \(B, W, V\), got a \(2, 4, 6\) torch.bfloat16"):
        ctx.hooks.set(probe, "lg", torch.zeros(2, 4, 6, dtype=torch.bfloat16))
    with pytest.raises(StrategyError, match=r"output 'lg' must be .*, got a \(2, 4, 7\)"):
        ctx.hooks.set(probe, "lg", torch.zeros(2, 4, 7))


def test_number_outputs_take_python_numbers_of_their_type():
    probe = Probe()
    ctx = ctx_with(probe)
    ctx.hooks.set(probe, "scale", 0.5)
    ctx.hooks.set(probe, "scale", 2)  # an int is a float's value
    ctx.hooks.set(probe, "count", 3)
    assert (ctx.hooks.scale, ctx.hooks.count) == (2, 3)
    for name, bad, got in (("scale", True, "bool True"), ("count", True, "bool True"), ("count", 1.0, "float 1.0"),
                           ("scale", torch.tensor(0.5), r"a \(\) torch.float32 tensor")):
        with pytest.raises(StrategyError, match=rf"{PROBE}: output '{name}' must be a Python \w+, got {got}"):
            ctx.hooks.set(probe, name, bad)


def test_undeclared_or_foreign_outputs_are_refused_and_unknown_reads_name_the_declared_ones():
    probe, other = Probe(), Other()
    ctx = ctx_with(probe, other)
    with pytest.raises(StrategyError, match=rf"^{PROBE}: sets ctx.hooks.scor, an output it does not declare \(its "
                                            r"declared outputs: score, rows_ok, scale, count, lg;"):
        ctx.hooks.set(probe, "scor", torch.rand(2, 4))
    with pytest.raises(StrategyError, match=rf"^{PROBE}: sets ctx.hooks.other, an output of t2t rule 'other'$"):
        ctx.hooks.set(probe, "other", torch.zeros(2, 4, dtype=torch.bool))
    ctx.hooks.set(other, "other", torch.zeros(2, 4, dtype=torch.bool))  # near miss: its owner may
    with pytest.raises(StrategyError, match=r"^ctx.hooks.scor: no step hook of this policy declares an output 'scor' "
                                            rf"\(declared outputs: score \({PROBE}\), .*other \(t2t rule 'other'\)\)$"):
        ctx.hooks.scor
    assert ctx.hooks.get("scor") is None  # the lenient read the back-compat properties use
    with pytest.raises(StrategyError, match=r"declares an output 'verified' \(declared outputs: none\)"):
        ctx_with().hooks.verified


def test_attribute_writes_are_the_running_hooks_own():
    probe = Probe()
    ctx = ctx_with(probe, Other())
    ctx.hooks.writer = PROBE  # what HookStages sets while the hook's stage runs
    ctx.hooks.score = torch.zeros(2, 4)
    with pytest.raises(StrategyError, match=rf"^{PROBE}: sets ctx.hooks.other, an output of t2t rule 'other'"):
        ctx.hooks.other = torch.zeros(2, 4, dtype=torch.bool)


def test_documented_properties_read_the_namespace_and_are_read_only():
    plain = ctx_with()
    assert (plain.verified, plain.insert, plain.delete, plain.shadow_confidence) == (None, None, None, None)
    shadow = torch.rand(2, 4)
    ctx = make_context(torch.tensor([[1, M, M, 2], [3, 4, M, M]]), torch.zeros(2, 4, 6), mask_token_id=M,
                       shadow_confidence=shadow)
    assert ctx.shadow_confidence is shadow and ctx.hooks.shadow_confidence is shadow
    for name in ("verified", "insert", "delete", "shadow_confidence"):
        with pytest.raises(AttributeError):
            setattr(ctx, name, None)
    with pytest.raises(StrategyError, match="^make_context: output 'shadow_confidence' must be a \\(1, 4\\) torch.float32"):
        make_context(torch.tensor([[1, M, M, 2]]), torch.zeros(1, 4, 6), mask_token_id=M,
                     shadow_confidence=torch.rand(1, 4, dtype=torch.float64))
    assert not hasattr(ctx, "extras")  # gone: every hook result is a declared output


# -- policy build ----------------------------------------------------------------------------------
class Typo(StepHook):
    def after_forwards(self, ctx, engine, state):
        pass


class Singular(StepHook):
    def after_rule(self, ctx, engine, state):
        pass


class Misspelt(StepHook):
    def aftre_write(self, ctx, state):
        pass


class Helper(StepHook):  # near miss of the three above: a helper with an unrelated name, a real stage
    def after_forward(self, ctx, engine, state):
        pass

    def helper(self):
        pass


class ShortStage(StepHook):
    def after_rules(self, ctx):
        pass


class LongStage(StepHook):  # near misses: an extra optional argument, or *args, can still be called
    def after_rules(self, ctx, engine, state, extra=None):
        pass

    def after_write(self, *args):
        pass


def test_methods_that_look_like_stages_are_refused_naming_hook_method_and_stages():
    for cls, method in ((Typo, "after_forwards"), (Singular, "after_rule"), (Misspelt, "aftre_write")):
        with pytest.raises(ConfigError, match=rf"^step hook '{cls.__name__}': method {cls.__name__}.{method}\(\) is not "
                                              r"a hook member and would never run \(known: declare, check_model, "
                                              r"step_segments, after_forward, after_rules, after_write\)$"):
            check_hook(cls())
    check_hook(Helper())
    assert set(KNOWN) == {"declare", "check_model", "step_segments", "after_forward", "after_rules", "after_write"}


def test_a_stage_with_the_wrong_signature_is_refused_naming_hook_and_stage():
    with pytest.raises(ConfigError, match=r"^step hook 'ShortStage': stage ShortStage.after_rules\(ctx\) cannot be "
                                          r"called as after_rules\(ctx, engine, state\) \(the loop passes 3 arguments\)$"):
        check_hook(ShortStage())
    check_hook(LongStage())


class BadShape(StepHook):
    def declare(self, policy):
        return Declaration(outputs={"x": Output(("B", "T"), torch.bool)})


class BadDtype(StepHook):
    def declare(self, policy):
        return Declaration(outputs={"x": Output(("B",), "float")})


class BadScalar(StepHook):
    def declare(self, policy):
        return Declaration(outputs={"x": Output((), torch.float32)})


class BadName(StepHook):
    def declare(self, policy):
        return Declaration(outputs={"get": Output(("B",), torch.bool)})


class NotOutput(StepHook):
    def declare(self, policy):
        return Declaration(outputs={"x": (("B",), torch.bool)})


class Twin(StepHook):  # declares Other's output
    def declare(self, policy):
        return Declaration(outputs={"other": Output(("B", "W"), torch.bool)})


def test_malformed_declarations_are_refused_naming_the_hook_and_output():
    for cls, why in ((BadShape, r"output 'x': shape must be a tuple of 'B', 'W', 'V' \(got \('B', 'T'\)\)"),
                     (BadDtype, r"output 'x': dtype must be a torch.dtype or 'logits' \(got 'float'\)"),
                     (BadScalar, r"output 'x': a shape-\(\) output's dtype must be float, int or bool"),
                     (BadName, r"output name 'get' must be a Python identifier, not starting with '_' and not one of"),
                     (NotOutput, r"output 'x': must be an Output, got tuple")):
        with pytest.raises(ConfigError, match=rf"^step hook '{cls.__name__}': {why}"):
            declaration(cls(), DecodingPolicy())
    declaration(Probe(), DecodingPolicy())


class _Asks(ThresholdEdit):
    hooks: tuple = ()

    def step_hooks(self, policy, role):
        return [h() for h in self.hooks]


def registered(name: str, *hooks: type) -> str:
    if name not in T2T.names():
        T2T.register(name)(type(name, (_Asks,), {"hooks": hooks}))
    return name


def test_collect_refuses_two_hooks_declaring_one_output_and_a_bad_hook_when_the_policy_is_built():
    with pytest.raises(ConfigError, match=r"^t2t rule 'other' and step hook 'Twin' both declare the output 'other': "
                                          "they cannot be combined in one policy$"):
        DecodingPolicy("llada2.1-q", **{"t2t.name": registered("_asks_twins", Other, Twin)})
    ok = DecodingPolicy("llada2.1-q", **{"t2t.name": registered("_asks_other_probe", Other, Probe)})  # near miss
    assert set(ok.hook_outputs) == {"other", *PROBE_OUTPUTS}
    assert ok.hook_outputs["other"].hook == "t2t rule 'other'"
    with pytest.raises(ConfigError, match=r"step hook 'Typo': method Typo.after_forwards\(\) is not a hook member"):
        DecodingPolicy("llada2.1-q", **{"t2t.name": registered("_asks_typo", Typo)})
    assert collect(DecodingPolicy("llada2.1-q")) == ([], [])


# -- run time --------------------------------------------------------------------------------------
BL = 4


class WrongDtype(StepHook):
    def declare(self, policy):
        return Declaration(outputs={"flagged": Output(("B", "W"), torch.bool)})

    def after_rules(self, ctx, engine, state):
        ctx.hooks.flagged = ctx.commit.long()


class FlagBlockStart(StepHook):
    """Marks the first slot of the active block (a per-slot bool output the trajectory records)."""

    def declare(self, policy):
        return Declaration(outputs={"flagged": Output(("B", "W"), torch.bool)})

    def after_rules(self, ctx, engine, state):
        before = torch.cat([torch.zeros_like(ctx.in_block[:, :1]), ctx.in_block[:, :-1]], 1)
        ctx.hooks.flagged = ctx.in_block & ~before & ctx.valid


class EditPrompt(StepHook):
    """Adds an edit at the first prompt slot of the window: outside the T2T region."""

    def after_rules(self, ctx, engine, state):
        ctx.edit = ctx.edit | (ctx.is_prompt & ctx.valid & (ctx.positions == 0))


class KeepEdits(StepHook):  # replaces ctx.edit without adding anything: never the one to blame
    def after_rules(self, ctx, engine, state):
        ctx.edit = ctx.edit & ctx.valid


class _EditsPrompt(ThresholdEdit):
    def __call__(self, ctx):
        return super().__call__(ctx) | (ctx.is_prompt & ctx.valid & (ctx.positions == 0))

    def step_hooks(self, policy, role):
        return [KeepEdits()]


def policy_of(t2t: str) -> DecodingPolicy:
    return DecodingPolicy("llada2.1-q", **{"t2t.name": t2t, "blocks.params.block_length": BL})


def test_a_hook_output_of_the_wrong_dtype_stops_the_decode_naming_the_hook():
    model = tiny_llada2(seed=1)
    with pytest.raises(StrategyError, match=r"^step hook 'WrongDtype': output 'flagged' must be a \(1, 4\) torch.bool "
                                            r"tensor \(B, W\), got a \(1, 4\) torch.int64 tensor$"):
        decode(model, [[1, 2, 3]], policy_of(registered("_asks_wrong_dtype", WrongDtype)), 4)


def test_a_selection_a_hook_moved_out_of_its_region_names_the_hook_not_the_rule():
    model = tiny_llada2(seed=1)
    with pytest.raises(StrategyError, match=r"^step hook 'EditPrompt' selected position 0 of batch row 0, which is "
                                            r"not editable"):
        decode(model, [[1, 2, 3]], policy_of(registered("_asks_edit_prompt", EditPrompt)), 4)
    # near miss: the rule selects it and a hook merely replaces the selection: the rule is named
    if "_edits_prompt" not in T2T.names():
        T2T.register("_edits_prompt")(_EditsPrompt)
    with pytest.raises(StrategyError, match=r"^t2t rule '_edits_prompt' selected position 0 of batch row 0"):
        decode(model, [[1, 2, 3]], policy_of("_edits_prompt"), 4)


def test_hook_stages_record_selection_replacements_by_identity():
    ctx = make_context(torch.tensor([[1, M, M, 2], [3, 4, M, M]]), torch.zeros(2, 4, 6), mask_token_id=M, prompt_len=1)
    ctx.commit = ctx.fillable
    ctx.edit = torch.zeros_like(ctx.valid)
    ctx.remask = torch.zeros_like(ctx.valid)
    stages = HookStages([EditPrompt(), KeepEdits()])
    for run in stages.after_rules:
        run(ctx, None, None)
    assert [(who, sel) for who, sel, _ in ctx.replaced] == [("step hook 'EditPrompt'", "edit"),
                                                           ("step hook 'KeepEdits'", "edit")]
    assert ctx.selected_by("edit", 0, 0) == "step hook 'EditPrompt'"
    assert ctx.selected_by("edit", 0, 1) is None  # not selected at all
    assert ctx.selected_by("commit", 0, 1) is None  # selected by the rule (no hook replaced commit)
    ctx.replaced.clear()  # a hook that adds nothing is never blamed: the rule's own selection
    ctx.edit = ctx.is_prompt.clone()
    for run in HookStages([KeepEdits()]).after_rules:
        run(ctx, None, None)
    assert len(ctx.replaced) == 1 and ctx.selected_by("edit", 0, 0) is None
    assert ctx.hooks.writer is None  # reset after the stage


def test_trajectory_records_per_slot_outputs_of_any_hook():
    model = tiny_llada2(seed=1)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    got = decode(model, prompts, policy_of(registered("_asks_flag", FlagBlockStart)), 8, record=True)
    assert got.trajectory.steps
    for s in got.trajectory.steps:
        # the active block's first slot, if it is in the window (it always is: the window ends the block)
        assert s.marks == {"flagged": [s.block_lo] if s.block_lo in s.positions else []}
        assert s.insert == [] and s.delete == [] and not s.verified
    plain = decode(model, prompts, policy_of("threshold"), 8, record=True)  # near miss: no hook, no marks
    assert all(s.marks == {} for s in plain.trajectory.steps)
