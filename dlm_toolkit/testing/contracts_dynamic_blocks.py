"""Contract suite of dynamic block schedules
(:class:`~dlm_toolkit.hooks.dynamic_blocks.DynamicBlockSchedule`): everything a block schedule is
checked for, plus the rules a schedule that moves its own block must keep."""

from __future__ import annotations

import random
from typing import Any, Callable

import torch

from dlm_toolkit.decoding.loop import decode
from dlm_toolkit.decoding.policy import DecodingPolicy, StrategyError
from dlm_toolkit.step.state import DecodeState
from dlm_toolkit.strategy.base import BlockSchedule, Strategy
from dlm_toolkit.testing.contracts_blocks import BlockScheduleContract
from dlm_toolkit.testing.scripted import ScriptedLM, mixing_logits


class DynamicBlockScheduleContract(BlockScheduleContract):
    """Contract suite for dynamic block schedules. Besides :class:`BlockScheduleContract` (layout,
    end-to-end decodes, batch invariance, KV cache on == off on a real LLaDA2 model), it watches
    every step of decodes with a scripted model and checks:

    - **bounds**: every live row's active block ``[lo, hi)`` lies in ``[prompt_len, length)``, is
      non-empty, at most ``window_width()`` wide, and ``lo`` never moves back;
    - **block-causal**: the attention groups never decrease along the canvas, the active block is
      one group of its own (every earlier position has a lower one), the cache boundary lies in
      ``[previous boundary, lo]``, and a cached position sees only cached positions, the same ones
      at every later step (its cached keys never go stale);
    - **decoded once, to completion**: every write falls inside the step's active block, no
      position before ``lo`` is ever written again, and each output position was committed
      exactly once more than it was remasked and holds a token at the end.
    """

    def _watched(self, rule: Strategy, seed: int, prompts: list[list[int]], gen_length: int,
                 policy: DecodingPolicy | None = None) -> tuple[Any, list[dict[str, Any]]]:
        """Decode with a scripted model, recording each step's bounds, groups and boundary (taken
        when the engine asks for the window, after ``prepare``)."""
        policy = policy or self.policy_for(rule)
        blocks = policy.blocks
        assert isinstance(blocks, BlockSchedule)
        seen: list[dict[str, Any]] = []
        window: Callable[..., Any] = blocks.window

        def watch(state: DecodeState, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            lo, hi = window(state, rows)
            pos = torch.arange(state.canvas.shape[1]).expand(len(rows), -1)
            seen.append({
                "live": (~state.done[rows]).tolist(), "lo": lo.tolist(), "hi": hi.tolist(),
                "groups": blocks.attention_groups(state, rows, pos).tolist(),
                "boundary": blocks.cache_boundary(state, rows, lo, hi).tolist(),
                "prompt_len": state.prompt_len[rows].tolist(), "length": state.length[rows].tolist(),
            })
            return lo, hi

        vocab = 24
        model = ScriptedLM(mixing_logits(vocab, seed=seed, scale=2.5, mix=2.0), vocab, vocab - 1, vocab - 2)
        blocks.window = watch  # type: ignore[method-assign]  # an instance attribute, removed below
        try:
            res = decode(model, prompts, policy, gen_length, seed=seed, record=True)
        except StrategyError as err:  # the engine's own bounds check: a contract failure here
            raise AssertionError(f"{rule!r}: {err}") from err
        finally:
            del blocks.window
        return res, seen

    def _cases(self) -> list[tuple[Strategy, int, list[list[int]], int]]:
        cases = []
        for n, rule in enumerate(self.rules()):
            bl = rule.block_length  # type: ignore[attr-defined]
            for seed in (n, n + 11):
                rng = random.Random(seed)
                prompts = [[rng.randrange(0, 22) for _ in range(rng.randint(1, 2 * bl + 1))] for _ in range(3)]
                cases.append((rule, seed, prompts, rng.randint(bl, 4 * bl)))
        return cases

    def test_dynamic_bounds_inside_canvas_after_prompt(self):
        for rule, seed, prompts, gen in self._cases():
            _, seen = self._watched(rule, seed, prompts, gen)
            width = rule.window_width()  # type: ignore[attr-defined]
            last_lo = [-1] * len(prompts)
            for step in seen:
                for r, live in enumerate(step["live"][: len(prompts)]):
                    if not live:
                        continue
                    lo, hi, p, n = step["lo"][r], step["hi"][r], step["prompt_len"][r], step["length"][r]
                    assert p <= lo < hi <= n, f"{rule!r}: row {r} active block [{lo}, {hi}) outside [{p}, {n})"
                    assert hi - lo <= width, f"{rule!r}: row {r} block [{lo}, {hi}) wider than window_width {width}"
                    assert lo >= last_lo[r], f"{rule!r}: row {r} block start moved back ({last_lo[r]} -> {lo})"
                    last_lo[r] = lo

    def test_dynamic_attention_is_block_causal(self):
        for rule, seed, prompts, gen in self._cases():
            _, seen = self._watched(rule, seed, prompts, gen)
            last_boundary = [0] * len(prompts)
            cached_view: list[dict[int, set[int]]] = [{} for _ in prompts]  # what each cached position saw
            for step in seen:
                for r, live in enumerate(step["live"][: len(prompts)]):
                    if not live:
                        continue
                    lo, hi, b = step["lo"][r], step["hi"][r], step["boundary"][r]
                    g = step["groups"][r][:hi]
                    assert all(x <= y for x, y in zip(g, g[1:])), f"{rule!r}: row {r} groups decrease: {g}"
                    assert len(set(g[lo:hi])) == 1, f"{rule!r}: row {r} active block [{lo}, {hi}) spans groups {g[lo:hi]}"
                    assert lo == 0 or g[lo - 1] < g[lo], f"{rule!r}: row {r} position {lo - 1} shares the active group"
                    assert last_boundary[r] <= b <= lo, (
                        f"{rule!r}: row {r} cache boundary {b} outside [{last_boundary[r]}, {lo}]")
                    last_boundary[r] = b
                    for q in range(b):  # a cached position sees only cached ones, and always the same ones
                        view = {k for k in range(hi) if g[k] <= g[q]}
                        assert max(view) < b, f"{rule!r}: row {r} cached position {q} sees position {max(view)} >= {b}"
                        before = cached_view[r].setdefault(q, view)
                        assert before == view, (
                            f"{rule!r}: row {r} cached position {q} now sees {sorted(view ^ before)} differently "
                            "from when it was cached (its cached keys are stale)")

    def test_dynamic_positions_decoded_once_to_completion(self):
        for rule, seed, prompts, gen in self._cases():
            res, _ = self._watched(rule, seed, prompts, gen)
            mask = 23
            commits: dict[tuple[int, int], int] = {}
            final_from = [0] * len(prompts)  # positions before this were behind the block: never written again
            for s in res.trajectory.steps:
                window = s.positions
                lo, hi = min(window), max(window) + 1
                assert window == list(range(lo, hi)), f"{rule!r}: row {s.row} window is not contiguous: {window}"
                for pos in s.commit + s.edit + s.remask:
                    assert lo <= pos < hi, f"{rule!r}: row {s.row} wrote position {pos} outside its block [{lo}, {hi})"
                    assert pos >= final_from[s.row], f"{rule!r}: row {s.row} rewrote final position {pos}"
                for pos in s.commit:
                    commits[s.row, pos] = commits.get((s.row, pos), 0) + 1
                for pos in s.remask:
                    commits[s.row, pos] = commits.get((s.row, pos), 0) - 1
                final_from[s.row] = max(final_from[s.row], lo)
            for r, p in enumerate(prompts):
                out = res.tokens[r]
                assert mask not in out, f"{rule!r}: row {r} finished with masks: {out}"
                for pos in range(len(p), len(p) + len(out)):
                    assert commits.get((r, pos), 0) == 1, (
                        f"{rule!r}: row {r} position {pos} committed {commits.get((r, pos), 0)} times net (want 1)")
                assert all(pos >= len(p) for (row, pos) in commits if row == r), f"{rule!r}: row {r} wrote the prompt"

    def test_kv_cache_matches_recompute_longer(self):
        """Cache on == cache off on a real LLaDA2 model over more blocks than the base check, with
        prompts whose tails straddle the grid (the partly final grid block is where a dynamic
        cache goes wrong)."""
        from dlm_toolkit.testing.models import tiny_llada2

        model = tiny_llada2(7)
        for n, rule in enumerate(self.rules()):
            bl = rule.block_length  # type: ignore[attr-defined]
            rng = random.Random(100 + n)
            prompts = [[rng.randrange(0, 60) for _ in range(rng.randint(1, 3 * bl))] for _ in range(3)]
            policy = self.policy_for(rule)
            on = decode(model, prompts, policy, 5 * bl, kv_cache=True, seed=n)
            off = decode(model, prompts, policy, 5 * bl, kv_cache=False, seed=n)
            assert on.tokens == off.tokens, f"{rule!r}: tokens with the KV cache differ from recomputing"
            assert [r.nfe for r in on.rows] == [r.nfe for r in off.rows], f"{rule!r}: NFE with the KV cache differs"
