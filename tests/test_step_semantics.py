"""The semantics of one decode step, pinned through public behaviour against independent references.

Each test here catches a change to the step that alters real output on a tiny model while every
other test still passes (issue 25, part 0): row statistics counting tokens after the EOS, the
confidence drawn from the tempered/filtered softmax, ``block_masked`` forgetting remasks, top-p
dropping the token that crosses p, the per-block forward limit and the net-progress guard never
firing, and per-row random streams that ignore the row. The references are plain loops and
float64 arithmetic written here, never the engine's own output, so an engine rewrite (shape-static
step, counter-based random streams) is checked by them without change.
"""

from __future__ import annotations

import math

import pytest
import torch

from dlm_toolkit import BLOCKS, REMASK, DecodingPolicy, RemaskRule, StrategyError, decode
from dlm_toolkit.config import SamplingConfig
from dlm_toolkit.strategy.selection import remaskable
from dlm_toolkit.step.state import row_seed
from dlm_toolkit.testing import ScriptedLM, make_context, table_logits, tiny_llada2

V, MASK, EOS = 12, 11, 10


def _policy(m2t: dict, blocks: dict, remask: dict | None = None, sampling: dict | None = None,
            t2t: dict | None = None) -> DecodingPolicy:
    data = {"m2t": m2t, "t2t": t2t or {"name": "none"}, "blocks": {"name": "semi_ar", **blocks}}
    if remask is not None:
        data["remask"] = remask
    if sampling is not None:
        data["sampling"] = sampling
    return DecodingPolicy(data)


# -- a. row statistics stop at the first EOS ------------------------------------------------------


@pytest.mark.parametrize("eos_early_stop", [False, True])
def test_row_statistics_count_tokens_up_to_the_first_eos(eos_early_stop):
    """TPF, ``generated_tokens``, batch TPF and tokens/s count each row's tokens up to and including
    its first EOS, whatever the canvas holds after it (tokens decoded after the EOS, or masks)."""
    gen = 12
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    # absolute position of each row's EOS: mid-generation in rows 0 and 2; in row 1 just past its
    # generation (position 14 = 2 + 12, still on the canvas, whose last block runs to 16): no EOS
    eos_at = [3 + 2, 2 + 12, 4 + 6]
    per_row = []
    for at in eos_at:
        table = torch.full((16, V), -4.0)
        table[torch.arange(16), torch.arange(16) % 7] = 4.0  # a peaked, non-EOS token everywhere...
        table[at, EOS] = 8.0  # ...but the EOS here
        per_row.append(table)
    blocks = {"params": {"block_length": 4, "max_post_steps": 1, "eos_early_stop": eos_early_stop}}
    pol = _policy({"name": "threshold", "params": {"threshold": 0.5}}, blocks)
    results = []
    for r, p in enumerate(prompts):  # one row per decode: each row has its own table
        model = ScriptedLM(table_logits(per_row[r]), V, MASK, EOS)
        results.append(decode(model, [p], pol, gen))
    for r, (p, res) in enumerate(zip(prompts, results)):
        generated = res.canvas[0, len(p): len(p) + gen].tolist()
        expect = generated[: generated.index(EOS) + 1] if EOS in generated else generated
        assert EOS not in expect[:-1]
        row = res.rows[0]
        assert row.tokens == expect
        if r == 1:
            assert len(expect) == gen and res.canvas[0, eos_at[r]] == EOS  # an EOS past the output is no EOS
        else:
            assert len(expect) == eos_at[r] - len(p) + 1 < gen  # the canvas runs on past the EOS
        assert row.tpf == pytest.approx(len(expect) / row.nfe)
        summary = res.summary()
        assert summary["generated_tokens"] == len(expect)
        assert summary["tpf"] == pytest.approx(len(expect) / row.nfe)
        assert res.tokens_per_second * res.wall_time == pytest.approx(len(expect))
        assert row.edits_per_token == pytest.approx(row.edits / len(expect))


# -- b, d. sampling: the confidence is untempered, top-p keeps the crossing token ------------------


def _nucleus(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> tuple[set[int], torch.Tensor]:
    """The tokens a tempered top-k/top-p draw may give, and their probabilities (float64, a plain
    reference): keep the ``top_k`` most probable, renormalise, sort, and keep the smallest prefix
    whose mass reaches ``top_p`` (the token that crosses ``top_p`` included)."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    if 0 < top_k < len(order):
        order = order[:top_k]
    mass = float(sum(probs[t] for t in order))
    keep, total = [], 0.0
    for t in order:
        keep.append(t)
        total += float(probs[t]) / mass
        if total >= top_p:
            break
    kept = torch.zeros_like(probs)
    kept[keep] = probs[keep]
    return set(keep), kept / kept.sum()


def _designed_logits(q: list[float], temperature: float, perm: torch.Tensor) -> torch.Tensor:
    """Logits whose tempered softmax is exactly ``q`` (token ids permuted by ``perm``)."""
    p = torch.tensor(q, dtype=torch.float64)
    logits = temperature * torch.log(p / p.sum())
    return logits[perm.argsort()].float()


# tempered probabilities per row (the last entry is the mask token's, tiny): with top_p=0.7 the
# nucleus is the first three tokens, the third crossing p
Q_ROWS = [
    [0.35, 0.25, 0.2, 0.1, 0.05, 0.03, 0.01, 0.005, 0.003, 0.0019, 0.001, 0.0001],
    [0.3, 0.3, 0.25, 0.1, 0.02, 0.01, 0.01, 0.005, 0.003, 0.0019, 0.001, 0.0001],
    [0.5, 0.1, 0.2, 0.15, 0.02, 0.01, 0.01, 0.005, 0.003, 0.0019, 0.001, 0.0001],
]


@pytest.mark.parametrize("temperature, top_k, top_p, float64", [(0.7, 0, 0.7, False), (0.7, 4, 0.7, False),
                                                                  (0.7, 4, 0.7, True), (1.0, 5, 0.6, False),
                                                                  (1.3, 0, 1.0, False)])
def test_tempered_top_k_top_p_draws_follow_a_float64_reference(temperature, top_k, top_p, float64):
    """Thousands of draws per row from fixed logits: the drawn tokens are exactly the reference
    nucleus (never a token outside it, every token inside it, the one crossing p included), at its
    renormalised frequencies, and each draw's confidence is the *untempered* softmax of the logits
    over the whole vocabulary at the drawn token."""
    w = 3000
    gen = torch.Generator().manual_seed(7)
    rows = []
    for q in Q_ROWS:
        perm = torch.cat([torch.randperm(V - 1, generator=gen), torch.tensor([MASK])])  # the mask stays last
        rows.append(_designed_logits(q, temperature, perm))
    logits = torch.stack(rows)[:, None, :].expand(-1, w, -1).contiguous()  # (3, W, V)
    tokens = torch.full((len(rows), w), MASK)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, gumbel_float64=float64)
    ctx = make_context(tokens, logits, mask_token_id=MASK, sampling=sampling, seed=3)
    for r in range(len(rows)):
        keep, want = _nucleus(logits[r, 0], temperature, top_k, top_p)
        drawn = ctx.sampled[r]
        assert set(drawn.tolist()) == keep - {MASK}, (r, sorted(set(drawn.tolist())), sorted(keep))
        freq = torch.bincount(drawn, minlength=V).double() / w
        assert torch.allclose(freq, want, atol=0.04), (r, freq, want)
        untempered = torch.softmax(logits[r, 0].double(), -1)
        assert torch.allclose(ctx.confidence[r].double(), untempered[drawn], rtol=1e-5, atol=1e-7)


def test_confidence_is_the_untempered_probability_on_random_logits():
    """Six rows of random logits at T = 0.7 with top-k and top-p: every position's confidence is the
    untempered float64 softmax at its drawn token (a tempered or filtered softmax changes every row)."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 9, V, generator=gen) * 2.5
    tokens = torch.full((6, 9), MASK)
    for sampling in (SamplingConfig(temperature=0.7, top_k=5, top_p=0.8), SamplingConfig(temperature=0.7),
                     SamplingConfig(temperature=0.0)):
        ctx = make_context(tokens, logits, mask_token_id=MASK, sampling=sampling, seed=1)
        want = torch.softmax(logits.double(), -1).gather(-1, ctx.sampled[..., None])[..., 0]
        assert torch.allclose(ctx.confidence.double(), want, rtol=1e-5, atol=1e-7), sampling
        assert not (ctx.sampled == MASK).any()


def test_decode_confidences_and_tokens_follow_the_sampling_reference():
    """Through a whole decode at T = 0.7 with top-k/top-p on fixed per-position logits: each
    recorded confidence is the untempered float64 softmax at the drawn token, and every drawn token
    lies in the reference nucleus of its position (all of it reached over the decode)."""
    temperature, top_k, top_p = 0.7, 4, 0.7
    n = 96
    gen = torch.Generator().manual_seed(5)
    q = Q_ROWS[0]
    table = torch.stack([_designed_logits(q, temperature, torch.cat([torch.randperm(V - 1, generator=gen),
                                                                     torch.tensor([MASK])])) for _ in range(n + 8)])
    table[:, EOS] = -30.0  # no EOS: every position is drawn
    model = ScriptedLM(table_logits(table), V, MASK, EOS)
    pol = _policy({"name": "threshold", "params": {"threshold": 0.3}},
                  {"params": {"block_length": 8, "max_post_steps": 0, "eos_early_stop": False}},
                  sampling={"temperature": temperature, "top_k": top_k, "top_p": top_p})
    res = decode(model, [[1]], pol, n, record=True)
    reached = set()
    for step in res.trajectory.steps:
        for pos, tok, conf in zip(step.positions, step.sampled, step.confidence):
            keep, _ = _nucleus(table[pos], temperature, top_k, top_p)
            assert tok in keep, (pos, tok, keep)
            rank = sorted(keep, key=lambda t: -float(table[pos, t])).index(tok)
            reached.add(rank)
            assert conf == pytest.approx(float(torch.softmax(table[pos].double(), -1)[tok]), rel=1e-5, abs=1e-7)
    assert reached == {0, 1, 2}  # the crossing token (rank 2) is drawn too


# -- c. a remask rule that fires, on a real model, against a plain reference loop ------------------


def _reference_topk_lowconf(model, prompt: list[int], gen_length: int, block_length: int, steps: int,
                            remask_threshold: float, max_post_steps: int) -> dict:
    """One row decoded by a plain loop: ``semi_ar`` blocks aligned at 0 (no EOS stop), greedy
    draws, M2T ``topk`` (LLaDA's linear quota) and remask ``low_confidence``; the whole prefix is
    recomputed every forward with block-causal attention."""
    bl = block_length
    n_blocks = math.ceil((len(prompt) + gen_length) / bl)
    canvas = prompt + [model.mask_token_id] * (n_blocks * bl - len(prompt))
    written = [False] * len(canvas)  # written by the decode (prompt positions never are)
    nfe = remasks = 0
    for b in range(len(prompt) // bl, n_blocks):
        lo, hi = b * bl, (b + 1) * bl
        block = range(lo, hi)
        masks_start = sum(canvas[i] == model.mask_token_id for i in block)
        block_step = post = 0
        while True:
            masked = [i for i in block if canvas[i] == model.mask_token_id]
            if not masked:
                post += 1
                if post > max_post_steps:
                    break
            ids = torch.tensor([canvas[:hi]])
            pos = torch.arange(hi)[None]
            group = pos // bl
            allowed = group[:, None, :] <= group[:, :, None]
            with torch.no_grad():
                probs = torch.softmax(model.forward_window(ids, pos, allowed)[0].float(), -1)  # (hi, V)
            p_masked = probs.clone()
            p_masked[:, model.mask_token_id] = -1.0
            conf, tok = p_masked.max(-1)  # greedy, never the mask token
            nfe += 1
            if masked:
                done = min(block_step + 1, steps)
                target = done * (masks_start // steps) + min(done, masks_start % steps)
                k = min(max(target - (masks_start - len(masked)), 1), len(masked))
                commit = sorted(masked, key=lambda i: (-float(conf[i]), i))[:k]
                weak = [i for i in block if written[i] and canvas[i] != model.mask_token_id
                        and float(probs[i, canvas[i]]) < remask_threshold]
                remask = sorted(weak, key=lambda i: (float(probs[i, canvas[i]]), i))[: k - 1]
                for i in commit:
                    canvas[i], written[i] = int(tok[i]), True
                for i in remask:
                    canvas[i], written[i] = model.mask_token_id, False
                remasks += len(remask)
            block_step += 1
            if not masked:  # a mask-free forward with no edit ends the block
                break
    out = canvas[len(prompt): len(prompt) + gen_length]
    return {"tokens": out[: out.index(model.eos_token_id) + 1] if model.eos_token_id in out else out,
            "nfe": nfe, "remasks": remasks}


@pytest.mark.parametrize("seed, post", [(3, 0), (5, 0), (3, 2)])
def test_firing_remask_rule_on_a_real_model_matches_a_reference_loop(seed, post):
    """A tiny LLaDA2 with ``low_confidence`` remasking that fires many times per block: tokens, NFE
    and remask counts equal a plain reference loop, with and without the KV cache, in a batch and
    alone. The engine's count of masks left in the block must include the remasked positions, or
    blocks end early (masks left) or run into the per-block forward limit. Without post steps,
    a block whose mask count is thought to be zero while masks remain ends at once."""
    torch.manual_seed(0)
    model = tiny_llada2(seed=seed)
    bl, steps, th = 8, 4, 0.9
    pol = _policy({"name": "topk", "params": {"steps_per_block": steps}},
                  {"params": {"block_length": bl, "max_post_steps": post, "eos_early_stop": False}},
                  remask={"name": "low_confidence", "params": {"threshold": th}})
    prompts, gen = [[1, 2, 3, 4, 5], [7, 8, 9]], 19
    want = [_reference_topk_lowconf(model, p, gen, bl, steps, th, post) for p in prompts]
    assert all(w["remasks"] >= 5 for w in want)  # the rule really fires
    for kv in (False, True):
        res = decode(model, prompts, pol, gen, kv_cache=kv)
        for r, w in enumerate(want):
            assert res.tokens[r] == w["tokens"], (kv, r)
            assert (res.rows[r].nfe, res.rows[r].remasks) == (w["nfe"], w["remasks"]), (kv, r)
            assert model.mask_token_id not in res.tokens[r]


# -- e, f. the step checks fire: a block that never ends, a rule with no net progress --------------


class _NeverEnds(BLOCKS.get("semi_ar")):
    """A schedule that never ends a block: every live row forwards again, forever."""

    def prepare(self, state):
        return ~state.done

    def finish_step(self, state, ctx):
        pass


class _RemaskEverything(RemaskRule):
    """Remasks every remaskable position: as many as were committed, so no net progress."""

    def __call__(self, ctx):
        return remaskable(ctx)


def _register(registry, name: str, cls: type) -> None:
    """Register a test rule when its test runs, not at import: lists of registered rules that other
    test files build while pytest collects must not see it."""
    if name not in registry.names():
        registry.register(name)(cls)


def _bounded_model(limit: int) -> ScriptedLM:
    """A scripted model that refuses to run more than ``limit`` forwards (a guard that never fires
    then fails the test instead of hanging it)."""
    table = torch.randn(64, V, generator=torch.Generator().manual_seed(2)) * 3
    model = ScriptedLM(lambda ids, pos, attn: table[pos], V, MASK, EOS)
    inner = model.fn

    def fn(ids, pos, attn):
        if model.calls > limit:
            raise RuntimeError(f"ran {model.calls} forwards: the engine did not stop the decode")
        return inner(ids, pos, attn)

    model.fn = fn
    return model


@pytest.mark.parametrize("post", [0, 3])
def test_a_block_that_never_ends_hits_the_per_block_forward_limit(post):
    _register(BLOCKS, "_semantics_never_ends", _NeverEnds)
    pol = _policy({"name": "threshold", "params": {"threshold": 0.01}},
                  {"name": "_semantics_never_ends", "params": {"block_length": 4, "max_post_steps": post}})
    limit = pol.blocks.max_forwards_per_block()
    assert limit == 4 + post
    model = _bounded_model(10 * limit)
    with pytest.raises(StrategyError, match=rf"'_semantics_never_ends' exceeded {limit} forwards in one block"):
        decode(model, [[1, 2, 3]], pol, 8, kv_cache=False)
    # check_every=1 (the default) reads the bound's flag before every forward: forward limit + 1 trips it
    # and the read before the next one raises (tests/test_pins.py pins the same with check_every explicit)
    assert model.calls == limit + 1


def test_a_remask_rule_without_net_progress_is_refused():
    """Committing one position per step and remasking the one committed before leaves the block's
    mask count unchanged: the net-progress check names the rule (not the forward limit, which
    such a decode would hit later)."""
    _register(REMASK, "_semantics_remask_everything", _RemaskEverything)
    pol = _policy({"name": "threshold", "params": {"threshold": 1.0}},  # the top-1 fallback only
                  {"params": {"block_length": 4, "max_post_steps": 0}},
                  remask={"name": "_semantics_remask_everything"})
    model = _bounded_model(200)
    with pytest.raises(StrategyError, match=r"'_semantics_remask_everything' remasked 1 positions in batch row 0 "
                                            r"but only 1 were committed \(net progress must be >= 1\)"):
        decode(model, [[1, 2, 3]], pol, 8)


# -- g. every row has its own random stream --------------------------------------------------------


def test_one_prompt_repeated_in_a_batch_draws_differently_per_row():
    """One prompt four times at T = 1: the rows draw from different streams, so they differ (a
    seed that ignores the row gives four copies), and each row gives what it gives decoded alone
    with its own stream (``row_seed(seed, row)``)."""
    model = tiny_llada2(seed=3)
    pol = _policy({"name": "threshold", "params": {"threshold": 0.6}},
                  {"params": {"block_length": 8, "max_post_steps": 1, "eos_early_stop": False}},
                  sampling={"temperature": 1.0})
    prompt, gen, seed = [1, 2, 3, 4, 5], 24, 4
    batch = decode(model, [prompt] * 4, pol, gen, seed=seed)
    assert len({tuple(t) for t in batch.tokens}) == 4, batch.tokens
    for r in (0, 3):
        alone = decode(model, [prompt], pol, gen, seed=[row_seed(seed, r)])
        assert alone.tokens[0] == batch.tokens[r] and alone.rows[0].nfe == batch.rows[r].nfe
    first = decode(model, [prompt], pol, gen, seed=seed)  # an int seed: row 0's stream
    assert first.tokens[0] == batch.tokens[0]
