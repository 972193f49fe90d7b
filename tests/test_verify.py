"""Verification forwards (issue 26 hook a) and S2D2 (arXiv 2603.25702) against an independent
reimplementation: a plain per-row loop that builds the paper's "2L verifier" input and attention by
hand, and float64 acceptance arithmetic; plus the engine's guarantees (cache on = off, batch
invariance, compiled = eager, the forward bound, full-attention models refused)."""

from __future__ import annotations

import importlib
import math
import random

import pytest
import torch

from dlm_toolkit import ConfigError, DecodingPolicy, M2T, StrategyError, decode
from dlm_toolkit.testing import ScriptedLM, mixing_logits, tiny_llada2
from dlm_toolkit.testing.contracts_cases import build_context, random_case
from dlm_toolkit.hooks.verify import verify_uniform

decode_module = importlib.import_module("dlm_toolkit.decoding.loop")
B = 4  # block length of every decode here


@pytest.fixture(autouse=True)
def _fast_compile(monkeypatch):  # the same full graph as inductor, without generating C++ (conftest: one thread)
    monkeypatch.setattr(decode_module, "COMPILE_BACKEND", "aot_eager")


def s2d2(**params) -> DecodingPolicy:
    return DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": B, "m2t.name": "s2d2",
                                           **{f"m2t.params.{k}": v for k, v in params.items()}})


# -- the reference: S2D2 with greedy acceptance, one row, no cache, plain loops ---------------------
def reference_s2d2(model, prompt: list[int], gen: int, tau_edit: float = 0.5, max_post: int = 16) -> tuple[list[int], int]:
    """LLaDA2.1 Q decoding (DESIGN.md section 2) whose masked steps are S2D2 steps: the draft forward, then
    the 2L verifier ``[prefix + draft | B masks]`` (attention written out position by position), greedy
    acceptance over the first mask span. Returns (tokens cut after the first EOS, NFE)."""
    mask, eos = model.mask_token_id, model.eos_token_id
    p_len = len(prompt)
    nb = -(-(p_len + gen) // B)
    x = list(prompt) + [mask] * (nb * B - p_len)
    nfe = 0

    def run(ids: list[int], pos: list[int], allowed) -> torch.Tensor:
        t = len(ids)
        attn = torch.tensor([[allowed(i, j) for j in range(t)] for i in range(t)])
        with torch.inference_mode():
            return model.forward_window(torch.tensor([ids]), torch.tensor([pos]), attn[None])[0].double()

    def best(row: torch.Tensor) -> int:  # argmax outside the mask token
        row = row.clone()
        row[mask] = -math.inf
        return int(row.argmax())

    for b in range(p_len // B, nb):
        lo, hi = b * B, (b + 1) * B
        post = 0
        while True:
            old = x[lo:hi]
            m = [t == mask for t in old]
            if not any(m):
                post += 1
            if post > max_post:
                break
            logits = run(x[:hi], list(range(hi)), lambda i, j: j // B <= i // B)[lo:hi]
            nfe += 1
            probs = torch.softmax(logits, -1)
            v = [best(logits[k]) for k in range(B)]
            conf = [float(probs[k, v[k]]) for k in range(B)]
            edit = [not m[k] and lo + k >= p_len and conf[k] > tau_edit and v[k] != old[k] for k in range(B)]
            new = [v[k] if edit[k] else old[k] for k in range(B)]
            if any(m):
                draft = [v[k] if (m[k] or edit[k]) else old[k] for k in range(B)]
                first = m.index(True)
                span = []
                for k in range(first, B):
                    if not m[k]:
                        break
                    span.append(k)
                ids = x[:lo] + draft + [mask] * B
                pos = list(range(hi)) + list(range(lo, hi))

                def allowed(i: int, j: int) -> bool:
                    if i < hi:  # the drafted canvas, token-causal inside the active block
                        return j < hi and (j // B < i // B or (j // B == i // B and (i < lo or j <= i)))
                    if j >= hi:  # a masked copy sees itself only among the copies
                        return j == i
                    return j < lo or j - lo < i - hi  # the prefix, and the draft strictly before it
                verify = run(ids, pos, allowed)[hi:]
                nfe += 1
                for k in span:
                    q_best = best(verify[k])
                    new[k] = draft[k] if q_best == draft[k] else q_best
                    if q_best != draft[k]:
                        break
            x[lo:hi] = new
            if not any(m) and not any(edit):
                break
        gen_part = x[p_len:hi]
        if mask not in gen_part and eos in gen_part:
            break
    out = x[p_len:p_len + gen]
    return (out[: out.index(eos) + 1] if eos in out else out), nfe


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_s2d2_greedy_decode_equals_the_plain_loop_reference(seed):
    model = tiny_llada2(seed=seed)
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, 60) for _ in range(rng.randint(1, 9))] for _ in range(3)]
    res = decode(model, prompts, s2d2(acceptance="greedy"), 11, record=True)
    verified = 0
    for i, p in enumerate(prompts):
        tokens, nfe = reference_s2d2(model, p, 11)
        assert res.tokens[i] == tokens, f"row {i}"
        assert res.rows[i].nfe == nfe, f"row {i}"
        verified += sum(s.verified for s in res.trajectory.for_row(i))
    assert verified > 0


def reference_rejection(probs_p, probs_q, draft, span, u, gumbel_u, mask, exponent=1.0):
    """Speculative rejection sampling over one row's span in float64: accept while u < min(1, (q/p)^e);
    the first rejected position draws argmax(log w + Gumbel) from w = max(q - p, 0) (else q), the
    mask token excluded. Returns {position: token} of what is written."""
    out = {}
    for k in span:
        q_row = probs_q[k].double().clone()
        q_row[mask] = 0.0
        p_row = probs_p[k].double()
        ratio = min(1.0, (float(q_row[draft[k]]) / max(float(p_row[draft[k]]), 1e-12)) ** exponent)
        if float(u[k]) < ratio:
            out[k] = draft[k]
            continue
        w = (q_row - p_row).clamp_min(0.0)
        w[mask] = 0.0
        if float(w.sum()) <= 0:
            w = q_row
        if float(w.sum()) <= 0:
            out[k] = draft[k]
            break
        g = -torch.log(-torch.log(gumbel_u[k].double().clamp_min(1e-30)))
        scores = torch.where(w > 0, w.log() + g, torch.tensor(-math.inf, dtype=torch.float64))
        out[k] = int(scores.argmax())
        break
    return out


def _mix32(x: int) -> int:
    """Wellons' lowbias32 on a plain int (the hash dlm_toolkit.step.rng documents)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def reference_uniforms(ctx, *trailing: int, draw: int) -> torch.Tensor:
    """The verifier's float32 uniforms recomputed with plain ints, at the documented draw index
    (``VERIFY_DRAW`` = 4096, plus the verifier's own draw): its own draws, not through verify_uniform."""
    m32 = 0xFFFFFFFF
    n = trailing[0] if trailing else 1
    out = torch.zeros(*ctx.positions.shape, n)
    for b in range(ctx.positions.shape[0]):
        seed, step = int(ctx.seeds[b]), int(ctx.step[b])
        h = _mix32(seed & m32)
        h = _mix32(h ^ ((seed >> 32) & m32))
        h = _mix32(h ^ (step & m32))
        for w in range(ctx.positions.shape[1]):
            base = _mix32(_mix32(h ^ (int(ctx.positions[b, w]) & m32)) ^ (draw & m32))
            for j in range(n):
                out[b, w, j] = (_mix32(base ^ j) >> 8) * 2.0 ** -24
    return out if trailing else out[..., 0]


def test_the_verifiers_draws_are_its_own_not_the_rules():
    """verify_uniform draws at 4096 + draw, apart from a rule's draws 0, 1, ... of the same step: a
    rule that drew before the verifier changes none of the verifier's numbers."""
    ctx = build_context(random_case(3), seed=3, memory={})
    assert torch.equal(verify_uniform(ctx, draw=0), reference_uniforms(ctx, draw=4096))
    assert torch.equal(verify_uniform(ctx, 5, draw=1), reference_uniforms(ctx, 5, draw=4097))
    rule_draws = [reference_uniforms(ctx, draw=d) for d in range(3)]
    assert not any(torch.equal(verify_uniform(ctx, draw=0), r) for r in rule_draws)


@pytest.mark.parametrize("exponent", [1.0, 0.5])
def test_rejection_acceptance_equals_the_float64_reference(exponent):
    rule = M2T.get("s2d2")(ratio_exponent=exponent)
    checked = rejected = 0
    for seed in range(40):
        ctx = build_context(random_case(seed), seed=seed, memory={})
        ctx.edit = torch.zeros_like(ctx.fillable)
        draft = rule.draft(ctx)
        gen = torch.Generator().manual_seed(seed)
        verify_logits = torch.randn(ctx.logits.shape, generator=gen) * 3
        commit, tokens = rule.accept(ctx, draft, verify_logits)
        u, gumbel_u = reference_uniforms(ctx, draw=4096), reference_uniforms(ctx, ctx.logits.shape[-1], draw=4097)
        p_all, q_all = torch.softmax(ctx.logits.double(), -1), torch.softmax(verify_logits.double(), -1)
        for r in range(ctx.batch_size):
            fill = ctx.fillable[r].tolist()
            span = []
            if any(fill):
                for k in range(fill.index(True), len(fill)):
                    if not fill[k]:
                        break
                    span.append(k)
            want = reference_rejection(p_all[r], q_all[r], draft[r].tolist(), span, u[r], gumbel_u[r],
                                       ctx.mask_token_id, exponent)
            got = {k: int(tokens[r, k]) for k in commit[r].nonzero().flatten().tolist()}
            assert got == want, f"case {seed}, row {r}"
            checked += len(span) > 0
            rejected += any(want[k] != int(draft[r, k]) for k in want) or len(want) < len(span)
    assert checked > 20 and rejected > 5  # the cases reach both branches


@pytest.mark.parametrize("acceptance", ["rejection", "greedy"])
def test_cache_on_and_off_batch_and_alone_give_the_same_tokens_and_nfe(acceptance):
    model = tiny_llada2(seed=5)
    rng = random.Random(5)
    prompts = [[rng.randrange(0, 60) for _ in range(rng.randint(1, 11))] for _ in range(4)]
    policy = s2d2(acceptance=acceptance)
    on = decode(model, prompts, policy, 13, kv_cache=True, seed=9)
    off = decode(model, prompts, policy, 13, kv_cache=False, seed=9)
    assert on.tokens == off.tokens and [r.nfe for r in on.rows] == [r.nfe for r in off.rows]
    from dlm_toolkit.step.state import row_seed
    for i, p in enumerate(prompts):
        alone = decode(model, [p], policy, 13, seed=[row_seed(9, i)])
        assert alone.tokens[0] == on.tokens[i] and alone.rows[0].nfe == on.rows[i].nfe


@pytest.mark.parametrize("kv", [True, False], ids=["kv", "no-kv"])
def test_compiled_decode_equals_eager(kv):
    model = tiny_llada2(seed=2)
    rng = random.Random(2)
    prompts = [[rng.randrange(0, 60) for _ in range(rng.randint(1, 11))] for _ in range(3)]
    policy = s2d2()
    eager = decode(model, prompts, policy, 10, kv_cache=kv)
    compiled = decode(model, prompts, policy, 10, kv_cache=kv, capture="compile")
    assert eager.tokens == compiled.tokens
    assert [(r.nfe, r.commits, r.edits, r.forward_tokens) for r in eager.rows] == \
        [(r.nfe, r.commits, r.edits, r.forward_tokens) for r in compiled.rows]
    runners = {k: r for k, r in decode_module.shared(model).items() if k[0] == "step"}
    assert runners and all(not r.failed for r in runners.values())


class _VerifiesPastTheBound(M2T.get("s2d2")):  # claims no verification forwards, yet verifies every masked step
    def max_verify_forwards(self, block_length: int) -> int:
        return 0

    def accept(self, ctx, draft, verify_logits):  # one position per step: four verified steps per block of four
        commit, tokens = super().accept(ctx, draft, verify_logits)
        return commit & (commit.long().cumsum(1) == 1), tokens


def test_a_verification_forward_past_the_bound_names_the_rule():
    if "_verify_past_bound" not in M2T.names():
        M2T.register("_verify_past_bound")(_VerifiesPastTheBound)
    policy = DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": B, "blocks.params.max_post_steps": 0,
                                             "m2t.name": "_verify_past_bound", "m2t.params.acceptance": "greedy"})
    with pytest.raises(StrategyError, match=r"m2t rule '_verify_past_bound' asked for a verification forward past "
                                            r"the bound of 4 forwards per block"):
        decode(tiny_llada2(seed=0), [[1, 2, 3]], policy, 12)


def test_a_full_attention_model_is_refused_naming_the_rule():
    model = ScriptedLM(mixing_logits(24, seed=0), 24, 23, 22, attention="full")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="m2t rule 's2d2' verifies with the model's autoregressive mode"):
        decode(model, [[1, 2]], s2d2(), 6)


def test_a_verifier_with_a_dynamic_block_schedule_is_refused_naming_both():
    """The verification forward copies a fixed block: a moving, growing block would be verified
    against the wrong positions, so the pair is refused when the policy is built."""
    with pytest.raises(ConfigError, match="^m2t rule 's2d2' .* block schedule 'dsb' moves and resizes its block"):
        DecodingPolicy("llada2.1-q", **{"m2t.name": "s2d2", "blocks.name": "dsb"})
    DecodingPolicy("llada2.1-q", **{"m2t.name": "s2d2", "blocks.name": "multi_block_edit"})
    DecodingPolicy("llada2.1-q", **{"blocks.name": "dsb"})


def test_policies_without_a_verifier_record_no_verification():
    res = decode(tiny_llada2(seed=0), [[1, 2, 3]], DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": B}),
                 8, record=True)
    assert res.trajectory.steps and not any(s.verified for s in res.trajectory.steps)
    assert res.rows[0].nfe == len(res.trajectory.steps)


def test_spans_shorter_than_min_span_length_are_not_verified():
    """The paper's mask_span_length routing: a span shorter than the minimum is decoded by the
    threshold rule alone; with a minimum past the block, S2D2 is LLaDA2.1 threshold decoding."""
    model = tiny_llada2(seed=4)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14]]
    never = decode(model, prompts, s2d2(min_span_length=B + 1, threshold=0.8), 12, record=True)
    plain = decode(model, prompts, DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": B,
                                                                    "m2t.params.threshold": 0.8}), 12)
    assert never.tokens == plain.tokens and [r.nfe for r in never.rows] == [r.nfe for r in plain.rows]
    assert not any(s.verified for s in never.trajectory.steps)
    some = decode(model, prompts, s2d2(min_span_length=3), 12, record=True)
    assert any(s.verified for s in some.trajectory.steps)
    for s in some.trajectory.steps:  # a verified step had a span of 3 or more, so at least 3 masks
        assert not s.verified or s.masks_before >= 3
    assert any(not s.verified and 0 < s.masks_before < 3 for s in some.trajectory.steps)


class _VerifiesEveryRow(M2T.get("s2d2")):  # a plug-in verifier that asks for every row, finished or not
    def wants_verify(self, ctx):
        return torch.ones_like(ctx.live)


@pytest.mark.parametrize("kv", [True, False], ids=["kv", "no-kv"])
def test_a_verifier_wanting_every_row_charges_only_live_rows(kv):
    """One row finishes before the other; the verifier asks for every row at every step. Each row pays two
    forwards per step it was live in (its step and its verification), whatever the other row still
    does: fails when verify_step drops ``ctx.live &`` (finished rows charged verification NFE)."""
    if "_verify_every_row" not in M2T.names():
        M2T.register("_verify_every_row")(_VerifiesEveryRow)
    policy = DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": B, "m2t.name": "_verify_every_row",
                                             "m2t.params.acceptance": "greedy"})
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 1]]
    res = decode(tiny_llada2(seed=3), prompts, policy, 5, kv_cache=kv, record=True)
    steps = [len(res.trajectory.for_row(r)) for r in range(2)]
    assert steps[0] != steps[1]  # one row rode along finished while the other still verified
    assert [r.nfe for r in res.rows] == [2 * n for n in steps]
    assert all(s.verified for s in res.trajectory.steps)
