"""Blocks ``dsb``: Dynamic Sliding Block, an active block that slides to the first masked position
and whose length follows how many tokens the rules were confident enough to commit.

Paper: "DSB: Dynamic Sliding Block Scheduling for Diffusion LLMs" (arXiv 2602.05992); reference
code: github.com/lizhuo008/DSB, ``llada/generate.py`` (``generate_s``/``generate_s_cache``:
DSB (const.), ``generate_i``/``generate_i_cache``: DSB (greedy)); the paper's Algorithm 1 (the
dynamic sliding block loop) and its pointer updates. After each forward, with ``n`` the number
of positions committed in the step, the block ``[s, e)`` becomes

    s' = the first masked position in [s, e)            (e if the block holds no mask)
    e' = min(max(e + n, s' + block_length), s' + max_block_length, prompt + gen_length)

so high-confidence steps (many commits) widen the block, tokens near its old end get decoded
early, and low-confidence positions keep the block's start waiting for context. The paper's two
variants are the two ends of ``max_block_length``: ``== block_length`` is DSB (const.) (the block
keeps its length and only slides: ``e' = s' + block_length``); no cap is DSB (greedy)
(``e' = e + n``: the end grows by exactly the commits, so the block always holds
``block_length`` masks).

Paper defaults: ``block_length`` 32 (LLaDA-8B-Instruct, generation 256) with the Fast-dLLM
threshold commit rule at 0.9 (set ``m2t: threshold, threshold: 0.9`` in the policy: DSB is a
schedule, not a commit rule).

Where the paper is silent or does not fit this engine, our choices:

- ``max_block_length`` defaults to 64 (= 2 × 32). The paper's greedy run has no cap
  (``max_block_length=-1``), but a shape-static decode needs the largest block as its window width;
  64 holds every block of the greedy rule while the commits of a step are within 32 of the
  block's start.
- Attention and cache (the paper runs LLaDA with full attention and an approximate "DSB Cache"):
  block-causal and exact, via :class:`~dlm_toolkit.hooks.dynamic_blocks.DynamicBlockSchedule`. Final
  positions attend by their 32-grid block and enter the KV cache a whole grid block at a time;
  the final part of the grid block the active block starts in is recomputed every forward (the
  analogue of DSB Cache's refreshed prefix window, here of at most ``block_length - 1``
  positions).
- The block starts at the first generated position (the paper's ``block_start = prompt length``)
  and never extends past ``prompt + gen_length`` (the paper's canvas); near the end it shrinks
  to what is left, where the paper's const. variant clamps its start back to keep 32 positions.
- T2T edits reach only the active block (positions behind it are final); post steps
  (``max_post_steps``) run only on the last block, once no mask is left; ``eos_early_stop`` ends a
  row as soon as an EOS is final (behind the block). With a T2T-free policy and no EOS this is the
  paper's loop.
"""

from __future__ import annotations

import torch

from dlm_toolkit import BLOCKS, DecodeState, StepContext
from dlm_toolkit.hooks.dynamic_blocks import DynamicBlockConfig, DynamicBlockSchedule


@BLOCKS.register("dsb")
class DynamicSlidingBlock(DynamicBlockSchedule):
    class Config(DynamicBlockConfig):
        pass

    def first_bounds(self, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
        lo = state.prompt_len.clone()
        return lo, torch.minimum(lo + self.block_length, state.gen_end)

    def next_bounds(self, state: DecodeState, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        assert state.block_lo is not None and state.block_hi is not None and ctx.commit is not None
        lo, hi, width = state.block_lo, state.block_hi, self.window_width()
        committed = torch.zeros_like(lo).index_put_((ctx.rows,), ctx.commit.sum(1) * ctx.live)
        idx = lo[:, None] + torch.arange(width, device=lo.device)
        # nothing past the block was ever written, so the first mask from lo on is the first in the
        # block, or hi itself when the block holds none
        masked = state.canvas.gather(1, idx.clamp(max=state.canvas.shape[1] - 1)) == state.mask_token_id
        start = torch.where(masked.any(1), lo + masked.long().argmax(1), hi)
        end = torch.minimum(torch.maximum(hi + committed, start + self.block_length), start + width)
        end = torch.minimum(end, state.gen_end)
        last = start >= state.gen_end  # nothing left to decode: stay for the post steps
        return torch.where(last, lo, start), torch.where(last, hi, end)
