"""Text generation with stop strings: decode a batch and stop each row's further blocks once a
stop string (or EOS) appears in its finished blocks.

:func:`~dlm_toolkit.decoding.loop.decode` knows EOS but not text. Here a row is decoded in *segments*
of ``stop_every`` blocks: after each segment the finished blocks' text is checked for the stop
strings, and a row that has one (or an EOS) is not decoded further, so its remaining blocks cost
no forwards (``blocks_skipped`` counts the blocks it did not decode). Segments end on block
boundaries and the next segment's prompt is everything decoded so far, which is exact when
finished blocks never change and never see later positions: a block-causal model under the
``semi_ar`` schedule with blocks aligned at position 0 (``align: absolute``, the LLaDA2 layout; or
``multi_block_edit`` with ``edit_blocks: 0``). A row that meets EOS stops there even when the
policy's ``eos_early_stop`` is off (then it spends fewer forwards than one long decode). Then a row gets the same
tokens and the same forwards, block for block, as one decode of the whole length (tests check
this); rows are grouped by their offset inside a block, so each decode call keeps every row of a
group on block boundaries. Each segment draws random numbers from its own stream
(``row_seed(stream, segment)``), so with sampling the draws differ from one long decode (still
deterministic and batch-independent). Other schedules and full-attention models are decoded
whole and only the text is cut.

The completion is cut after the first EOS (dropped) and before the earliest stop string, as
lm-evaluation-harness cuts ``until`` strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Any, Sequence

import torch

from dlm_toolkit.config import ConfigError
from dlm_toolkit.decoding.loop import decode
from dlm_toolkit.models.base import DiffusionLM
from dlm_toolkit.decoding.policy import DecodingPolicy
from dlm_toolkit.step.state import row_seed

__all__ = ["Generation", "MAX_STOP_CHARS", "MAX_STOPS", "cut_at_stop", "generate", "segmentable", "strip_eos",
           "validate_stops"]

MAX_STOPS = 64
MAX_STOP_CHARS = 256


@dataclass
class Generation:
    """One row's completion and cost.

    ``tokens``: generated ids (cut after the first EOS, EOS kept), ``text``: the completion
    (EOS dropped, cut before the earliest stop string), ``stopped``: ``"eos"``, ``"stop"`` or
    ``None`` (ran to the generation budget), ``blocks_skipped``: blocks never decoded because the
    row had stopped; the counters are summed over the row's decode calls.
    """

    text: str
    tokens: list[int]
    nfe: int
    edits: int
    remasks: int
    forward_tokens: int
    stopped: str | None
    blocks_skipped: int = 0
    inserts: int = 0  # insert/delete edits of an Indel t2t rule (dlm_toolkit.hooks.indel)
    deletes: int = 0


def validate_stops(stop: Sequence[str] | None, where: str = "stop") -> tuple[str, ...]:
    """The stop strings, checked: strings, none empty, at most :data:`MAX_STOPS` of at most
    :data:`MAX_STOP_CHARS` characters each.

    Raises:
        ConfigError: naming the offending string.
    """
    stops = tuple(stop or ())
    if len(stops) > MAX_STOPS:
        raise ConfigError(f"{where}: {len(stops)} stop strings, more than {MAX_STOPS}")
    for s in stops:
        if not isinstance(s, str):
            raise ConfigError(f"{where}: stop strings must be strings (got {s!r})")
        if s == "":
            raise ConfigError(f"{where}: an empty stop string would stop every completion at once")
        if len(s) > MAX_STOP_CHARS:
            raise ConfigError(f"{where}: a stop string of {len(s)} characters, more than {MAX_STOP_CHARS} "
                              f"({s[:40]!r}...)")
    return stops


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` cut before the earliest occurrence of any stop string, and whether one occurred."""
    at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)


def segmentable(model: DiffusionLM, policy: DecodingPolicy) -> bool:
    """Whether decoding in block segments gives exactly one decode's tokens (module docstring)."""
    blocks = policy.blocks
    if getattr(model, "attention", "block_causal") != "block_causal":
        return False
    if getattr(blocks.config, "align", "absolute") != "absolute":
        return False  # blocks after the prompt: the prompt attends within itself, so a longer prompt differs
    if blocks.name == "semi_ar":
        return True
    return blocks.name == "multi_block_edit" and int(getattr(blocks.config, "edit_blocks", 1)) == 0


def generate(model: DiffusionLM, tokenizer: Any, prompts: Sequence[Sequence[int]], policy: DecodingPolicy,
             gen_length: int, *, stop: Sequence[str] = (), seeds: Sequence[int], kv_cache: bool = True,
             stop_every: int = 1, cuda_graphs: bool | None = None) -> tuple[list[Generation], float]:
    """Decode ``prompts`` (ids) up to ``gen_length`` tokens each, stopping rows at ``stop`` strings.

    Args:
        seeds: one random-stream seed per prompt (as :func:`~dlm_toolkit.decoding.loop.decode` takes).
        stop_every: blocks per segment between stop checks (more: fewer decode calls and prefix
            recomputations, but up to that many blocks decoded past a stop string).
        cuda_graphs: as :func:`~dlm_toolkit.decoding.loop.decode`'s.

    Returns:
        The rows' :class:`Generation`, and the wall time of the decode calls.
    """
    stops = validate_stops(stop)
    if isinstance(stop_every, bool) or not isinstance(stop_every, int) or stop_every < 1:
        raise ConfigError(f"stop_every: must be an integer >= 1 (got {stop_every!r})")
    eos = model.eos_token_id
    if not stops or not segmentable(model, policy):
        t0 = perf_counter()
        result = decode(model, prompts, policy, gen_length, kv_cache=kv_cache, seed=list(seeds),
                        cuda_graphs=cuda_graphs)
        wall = perf_counter() - t0
        out = []
        for row in result.rows:
            text, hit = cut_at_stop(_text(tokenizer, row.tokens, eos), stops)
            out.append(Generation(text, row.tokens, row.nfe, row.edits, row.remasks, row.forward_tokens,
                                  "eos" if row.eos_stopped or eos in row.tokens else ("stop" if hit else None),
                                  inserts=row.inserts, deletes=row.deletes))
        return out, wall
    return _segmented(model, tokenizer, prompts, policy, gen_length, stops, list(seeds), kv_cache, stop_every,
                      cuda_graphs)


def strip_eos(tokens: list[int], eos_id: int) -> list[int]:
    """``tokens`` up to (not including) the first EOS."""
    return tokens[: tokens.index(eos_id)] if eos_id in tokens else tokens


def _text(tokenizer: Any, tokens: list[int], eos: int) -> str:
    return tokenizer.decode(strip_eos(tokens, eos))


def _segmented(model: DiffusionLM, tokenizer: Any, prompts: Sequence[Sequence[int]], policy: DecodingPolicy,
               gen_length: int, stops: tuple[str, ...], seeds: list[int], kv_cache: bool,
               stop_every: int, cuda_graphs: bool | None = None) -> tuple[list[Generation], float]:
    bl = policy.blocks.block_length
    lengths = torch.tensor([len(p) for p in prompts])
    origin, _, num_blocks = policy.blocks.layout(lengths, gen_length)
    n = len(prompts)
    gens = [Generation("", [], 0, 0, 0, 0, None) for _ in range(n)]
    done = [False] * n
    segment = [0] * n
    groups: dict[int, list[int]] = {}
    for r in range(n):  # rows at the same offset inside a block share every segment boundary
        groups.setdefault(int(lengths[r] - origin[r]) % bl, []).append(r)
    wall = 0.0
    while not all(done):
        for rows in groups.values():
            live = [r for r in rows if not done[r]]
            if not live:
                continue
            r0 = live[0]
            have = len(gens[r0].tokens)
            current = int(lengths[r0]) + have - int(origin[r0])
            boundary = (current // bl + stop_every) * bl
            step = min(boundary - current, gen_length - have)
            batch = [list(prompts[r]) + gens[r].tokens for r in live]
            t0 = perf_counter()
            result = decode(model, batch, policy, step, kv_cache=kv_cache, cuda_graphs=cuda_graphs,
                            seed=[seeds[r] if segment[r] == 0 else row_seed(seeds[r], segment[r]) for r in live])
            wall += perf_counter() - t0
            for r, row in zip(live, result.rows):
                g = gens[r]
                g.tokens += row.tokens
                g.nfe += row.nfe
                g.edits += row.edits
                g.remasks += row.remasks
                g.forward_tokens += row.forward_tokens
                g.inserts += row.inserts
                g.deletes += row.deletes
                segment[r] += 1
                text, hit = cut_at_stop(_text(tokenizer, g.tokens, model.eos_token_id), stops)
                g.text = text
                if model.eos_token_id in row.tokens:
                    g.stopped, done[r] = "eos", True
                elif hit:
                    g.stopped, done[r] = "stop", True
                elif len(g.tokens) >= gen_length:
                    done[r] = True
                if done[r]:
                    decoded = -(-(int(lengths[r]) + len(g.tokens) - int(origin[r])) // bl)  # block index reached
                    g.blocks_skipped = max(int(num_blocks[r]) - decoded, 0)
    return gens, wall
