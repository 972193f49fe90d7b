"""Oracle models: exact answer distributions of the list tasks (:mod:`dlm_toolkit.tasks.list_ops`).

An oracle is a :class:`~dlm_toolkit.models.base.DiffusionLM` that knows the answer distribution of a
task with a known one and reports, for every answer position of the canvas, the exact marginal of
that distribution given every *other* answer token the position sees:

* a masked position: given every written answer token it may attend to;
* a written position: leave-one-out (given the others, not itself), so T2T edits and remasking
  act on something true;
* **inconsistent canvases**: when no valid answer agrees with every visible token, the marginal is
  taken over the valid answers at minimum Hamming distance from the visible tokens (distance counted
  over the conditioning positions only; a foreign token disagrees with every answer). A canvas that
  is consistent is the special case at distance 0.

Positions past the answer get the EOS token with probability 1; prompt positions repeat their own
token. Impossible tokens get :data:`IMPOSSIBLE` (a finite, very negative logit: its softmax is an
exact 0 and entropies stay finite), so logits are log-probabilities computed in float64 and returned
in the model's dtype.

The oracle reads the instance from the prompt tokens (``kind:items[,extra]=``, one character per
item, with the character tokenizer), so one oracle serves every ``n_items`` and alphabet. How each
distribution is computed: ``list_copy``/``list_reverse``/``list_sort`` have one answer;
``list_replace``/``list_insert`` enumerate their ``n``/``n + 1`` answers and ``latin_square`` its
squares (576 of order 4), filtered by the visible tokens with tensor ops; ``list_shuffle`` (``n!``
answers) is counted: given visible distinct items ``D`` the marginal is uniform over the items not in
``D`` (ParallelBench's variant without the original order subtracts the one permutation it excludes).

:meth:`OracleLM.joint_consistency` is the capability the reference rule
(``strategies/m2t_reference.py``) asks for: the exact probability that independently sampled
tokens at a set of masked positions are jointly consistent with some valid answer.

This module parses prompts and defines the answers; the task classes (prompts, verifiers, the
instance stream) are in :mod:`dlm_toolkit.tasks.list_ops`, which imports from here.
"""

from __future__ import annotations

import itertools
import math
import string
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

__all__ = ["IMPOSSIBLE", "ITEM_CHARS", "KINDS", "ListInstance", "OracleLM", "answer_length", "is_valid",
           "is_oracle_spec", "latin_squares", "load_oracle", "parse_prompt", "prompt_text", "valid_answers"]

ITEM_CHARS = string.ascii_lowercase + string.ascii_uppercase + string.digits
"""The item alphabet: an alphabet of size ``a`` is its first ``a`` characters (62 at most)."""
KINDS = ("list_copy", "list_reverse", "list_sort", "list_shuffle", "list_replace", "list_insert", "latin_square")
EXCLUDE_SUFFIX = "_new"  # list_shuffle_new: ParallelBench's shuffle that excludes the original order
IMPOSSIBLE = -1.0e4
MAX_PROMPT = 128  # prompt characters the parser reads at most


@dataclass(frozen=True)
class ListInstance:
    """One parsed prompt: the task ``kind``, its ``items`` (distinct characters), the ``extra`` item
    (the new item of replace/insert, else ``""``) and whether the original order is excluded."""

    kind: str
    items: str
    extra: str = ""
    exclude_original: bool = False


def prompt_text(inst: ListInstance) -> str:
    """The prompt of ``inst``: ``kind[_new]:items[,extra]=``."""
    header = inst.kind + (EXCLUDE_SUFFIX if inst.exclude_original else "")
    return f"{header}:{inst.items}{',' + inst.extra if inst.extra else ''}="


def parse_prompt(text: str) -> ListInstance | None:
    """The instance a prompt describes, or None when ``text`` is not a well-formed list-task prompt."""
    head, sep, body = text.partition(":")
    if not sep or not body.endswith("="):
        return None
    exclude = head == "list_shuffle" + EXCLUDE_SUFFIX
    kind = "list_shuffle" if exclude else head
    if kind not in KINDS:
        return None
    items, _, extra = body[:-1].partition(",")
    needs_extra = kind in ("list_replace", "list_insert")
    chars = items + extra
    if (not items or bool(extra) != needs_extra or len(extra) > 1 or any(c not in ITEM_CHARS for c in chars)
            or len(set(chars)) != len(chars)):
        return None
    if kind == "latin_square" and not 2 <= len(items) <= 4:
        return None
    return ListInstance(kind, items, extra, exclude)


def answer_length(kind: str, n_items: int) -> int:
    """Answer tokens of a ``kind`` instance with ``n_items`` items (latin square: the order)."""
    if kind == "latin_square":
        return n_items * n_items
    return n_items + (kind == "list_insert")


@lru_cache(maxsize=None)
def latin_squares(order: int) -> tuple[tuple[int, ...], ...]:
    """Every latin square of ``order`` (row-major symbol indices), enumerated by backtracking."""
    cells = order * order
    out: list[tuple[int, ...]] = []
    grid = [0] * cells

    def fill(c: int) -> None:
        if c == cells:
            out.append(tuple(grid))
            return
        r, k = divmod(c, order)
        used = set(grid[r * order:c]) | {grid[i * order + k] for i in range(r)}
        for s in range(order):
            if s not in used:
                grid[c] = s
                fill(c + 1)

    fill(0)
    return tuple(out)


def valid_answers(inst: ListInstance) -> list[str] | None:
    """Every valid answer of ``inst``, each equally likely; None for ``list_shuffle`` (``n!``
    answers: counted, never listed)."""
    items, x = inst.items, inst.extra
    if inst.kind == "list_copy":
        return [items]
    if inst.kind == "list_reverse":
        return [items[::-1]]
    if inst.kind == "list_sort":
        return ["".join(sorted(items, key=ITEM_CHARS.index))]
    if inst.kind == "list_replace":
        return [items[:k] + x + items[k + 1:] for k in range(len(items))]
    if inst.kind == "list_insert":
        return [items[:k] + x + items[k:] for k in range(len(items) + 1)]
    if inst.kind == "latin_square":
        return ["".join(items[s] for s in sq) for sq in latin_squares(len(items))]
    return None


def is_valid(inst: ListInstance, answer: str) -> bool:
    """Whether ``answer`` is a valid answer of ``inst`` (the tasks' verifier)."""
    items = inst.items
    if inst.kind == "list_shuffle":
        return sorted(answer) == sorted(items) and not (inst.exclude_original and answer == items)
    if inst.kind == "latin_square":
        k = len(items)
        rows = [answer[r * k:(r + 1) * k] for r in range(k)]
        return (len(answer) == k * k and all(sorted(r) == sorted(items) for r in rows)
                and all(sorted(col) == sorted(items) for col in zip(*rows)))
    answers = valid_answers(inst)
    assert answers is not None
    return answer in answers


# ----------------------------------------------------------------------------------------------
# The model


@dataclass
class _Row:
    """A parsed row of one forward: its instance, prompt length, items and candidate answers as ids."""

    inst: ListInstance
    prompt_len: int
    items: torch.Tensor  # (n,) long item ids in prompt order
    cands: torch.Tensor | None  # (K, A) long valid answers as ids; None for shuffle


class OracleLM:
    """The exact model of one list task (module docstring), with the LLaDA2 model's interface.

    ``kind``: the task it models (``list_shuffle`` covers the variant without the original order:
    the prompt says which). ``tokenizer``: the character tokenizer whose ids it reads and writes.
    Block-causal attention like LLaDA2, no KV cache (the engine forwards the whole prefix, so the
    prompt is always in the window).
    """

    attention = "block_causal"
    supports_kv_cache = False

    def __init__(self, kind: str, tokenizer: Any, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        from dlm_toolkit.models.tokenizer import special_ids

        if kind not in KINDS:
            raise ValueError(f"oracle: unknown task {kind!r}; oracle tasks: {', '.join(KINDS)}")
        self.kind, self.dtype, self.device = kind, dtype, torch.device(device)
        self.mask_token_id, self.eos_token_id = special_ids(tokenizer)
        vocab = tokenizer.get_vocab()
        self.vocab_size = len(vocab)
        self._id = {c: vocab[c] for c in set(ITEM_CHARS) | set(":,=_" + string.ascii_lowercase)}
        self._char = {i: c for c, i in vocab.items() if len(c) == 1}
        self._rows: dict[tuple[int, ...], _Row] = {}
        self.calls = 0

    def new_cache(self, batch_size: int, max_length: int) -> None:
        raise NotImplementedError("the oracle keeps no KV cache")

    def check_task(self, task: Any) -> None:
        """Refuse, in one line, a task this oracle does not model (called before an evaluation)."""
        if getattr(task, "name", None) != self.kind:
            raise ValueError(f"checkpoint oracle:{self.kind} models task '{self.kind}' but the task is "
                             f"'{getattr(task, 'name', task)}': use --checkpoint oracle:{getattr(task, 'name', '?')}")

    # -------------------------------------------------------------- parsing
    def _parse(self, ids: list[int], pos: list[int], row: int) -> _Row:
        at: dict[int, int] = {}
        for t, p in zip(ids, pos):
            at.setdefault(p, t)
        chars = []
        for p in range(MAX_PROMPT):
            c = self._char.get(at.get(p, -1))
            if c is None:  # a mask, a special token or no slot: the prompt cannot go on
                break
            chars.append(c)
            if c == "=":
                break
        key = tuple(at.get(p, -1) for p in range(len(chars)))
        hit = self._rows.get(key)
        if hit is not None:
            return hit
        text = "".join(chars)
        inst = parse_prompt(text)
        if inst is None or inst.kind != self.kind:
            raise ValueError(f"oracle:{self.kind}: batch row {row} does not start with a {self.kind} prompt "
                             f"(kind:items[,extra]=, distinct items; got {text[:40]!r})")
        items = torch.tensor([self._id[c] for c in inst.items], dtype=torch.long, device="cpu")
        answers = valid_answers(inst)
        cands = None if answers is None else torch.tensor([[self._id[c] for c in a] for a in answers], device="cpu")
        out = _Row(inst, len(text), items, cands)
        if len(self._rows) < 65536:
            self._rows[key] = out
        return out

    def _layout(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn_mask: torch.Tensor
                ) -> tuple[list[_Row], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Parsed rows and, per row, ``slot`` (B, A) the window slot of each answer position (0 if
        absent), ``present`` (B, A), ``tok`` (B, A) its token, ``see`` (B, A, A) whether answer
        position i's query attends answer position j."""
        B, T = input_ids.shape
        ids_l, pos_l = input_ids.tolist(), position_ids.tolist()
        rows = [self._parse(ids_l[b], pos_l[b], b) for b in range(B)]
        lengths = {answer_length(r.inst.kind, len(r.inst.items)) for r in rows}
        if len(lengths) != 1:
            raise ValueError(f"oracle:{self.kind}: the rows of one forward must have one answer length, got "
                             f"{sorted(lengths)}")
        A = lengths.pop()
        start = torch.tensor([r.prompt_len for r in rows], device=input_ids.device)
        want = start[:, None] + torch.arange(A, device=input_ids.device)  # (B, A) absolute positions
        hit = position_ids[:, None, :] == want[:, :, None]  # (B, A, T)
        present = hit.any(-1)
        slot = hit.int().argmax(-1)  # first slot holding the position
        tok = input_ids.gather(1, slot)
        own = attn_mask[:, :, attn_mask.shape[2] - T:]  # the window's own key columns
        q = own.gather(1, slot[:, :, None].expand(-1, -1, T))  # (B, A, T) keys each answer query sees
        see = q.gather(2, slot[:, None, :].expand(-1, A, -1)) & present[:, None, :] & present[:, :, None]
        return rows, slot, present, tok, see

    # -------------------------------------------------------------- distributions
    def _marginals(self, rows: list[_Row], tok: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """(B, A, V) float64 exact marginals; ``cond`` (B, A, A): answer j conditions query i."""
        B, A = tok.shape
        V = self.vocab_size
        dev = tok.device
        out = torch.zeros(B, A, V, dtype=torch.float64, device=dev)
        condf = cond.float()  # counts below are small integers: exact in float32
        if rows[0].cands is None:  # shuffle: counted
            items = torch.stack([r.items for r in rows]).to(dev)  # (B, n), n == A
            n = items.shape[1]
            eq = (tok[:, :, None] == items[:, None, :]).float()  # (B, A=j, n=m): answer j shows item m
            count = torch.einsum("bij,bjm->bim", condf, eq)  # (B, A, n): times item m is shown to query i
            shown = count > 0
            count = count.double()
            w = (~shown).double()
            exclude = torch.tensor([r.inst.exclude_original for r in rows], device=dev)
            if bool(exclude.any()):
                # drop the identity from the min-distance set: it is in it iff every shown item shows at its
                # own position; its weight relative to one min-distance permutation is 1 / (prod c_d (f-1)!)
                agree = cond & (tok == items)[:, None, :]  # (B, i, m): query i sees item m at position m
                ident = (~shown | agree).all(-1)  # (B, A)
                free = n - shown.sum(-1)  # (B, A) >= 1
                fact = torch.tensor([math.factorial(k) for k in range(n + 1)], dtype=torch.float64, device=dev)
                per = torch.where(shown, count, torch.ones_like(count)).prod(-1) * fact[free - 1]
                own = torch.eye(n, dtype=torch.float64, device=dev)[None]  # query i's original item is item i
                drop = (exclude[:, None] & ident).double()[:, :, None] * own / per[:, :, None]
                w_ex = w - drop
                # only left: the identity, one free slot -> the nearest others are the transpositions (i j)
                empty = w_ex.sum(-1, keepdim=True) <= 0
                w_ex = torch.where(empty, 1.0 - own, w_ex)
                w = torch.where(exclude[:, None, None], w_ex, w)
            out.scatter_(2, items[:, None, :].expand(-1, A, -1), w)
        else:
            cands = torch.stack([r.cands for r in rows]).to(dev)  # (B, K, A)
            written = tok != self.mask_token_id
            miss = (written[:, None, :] & (cands != tok[:, None, :])).float()  # (B, K, A)
            dist = torch.einsum("bij,bkj->bik", condf, miss)  # (B, A, K) Hamming distance on the conditions
            w = (dist == dist.min(-1, keepdim=True).values).double()
            out.scatter_add_(2, cands.transpose(1, 2), w)
        return out / out.sum(-1, keepdim=True)

    def forward_window(self, input_ids, position_ids, attn_mask, cache=None, cache_rows=None, cache_write=None):
        """Log-marginals (B, T, V) in the model's dtype; see the module docstring."""
        self.calls += 1
        B, T = input_ids.shape
        rows, slot, present, tok, see = self._layout(input_ids, position_ids, attn_mask)
        A = tok.shape[1]
        written = present & (tok != self.mask_token_id)
        cond = see & written[:, None, :] & ~torch.eye(A, dtype=torch.bool, device=tok.device)
        probs = self._marginals(rows, tok, cond)  # (B, A, V)
        logp = probs.log().clamp(min=IMPOSSIBLE).to(self.dtype)  # exact in float64, reported in the dtype
        # every slot: its own token (prompt), EOS (past the answer), or its answer position's marginal
        start = torch.tensor([r.prompt_len for r in rows], device=input_ids.device)[:, None]
        rel = position_ids - start  # (B, T) answer index of each slot
        base = torch.full((B, T, self.vocab_size), IMPOSSIBLE, dtype=self.dtype, device=input_ids.device)
        base.scatter_(2, torch.where(rel >= A, self.eos_token_id, input_ids)[:, :, None], 0.0)
        in_answer = (rel >= 0) & (rel < A)
        answer = logp.gather(1, rel.clamp(0, A - 1)[:, :, None].expand(-1, -1, self.vocab_size))
        return torch.where(in_answer[:, :, None], answer, base)

    def joint_consistency(self, canvas: torch.Tensor, orders: list[list[int]]) -> list[torch.Tensor]:
        """The oracle's joint, as the reference rule (``strategies/m2t_reference.py``) asks for it.

        ``canvas`` (B, L): whole canvases from absolute position 0 (prompt included); ``orders[b]``:
        masked absolute positions of row b, most preferred first. Returns, per row, a float64 tensor
        whose entry k is the exact probability that tokens drawn independently from this canvas's
        marginals at the first k + 1 positions of ``orders[b]`` are, with the written tokens,
        consistent with some valid answer (positions past the answer hold EOS surely: they never
        break consistency). Exact for a consistent canvas; on an inconsistent one every entry is 0
        (nothing drawn repairs it) except for shuffle, where it is the chance the draws are distinct.
        """
        B, L = canvas.shape
        pos = torch.arange(L, device=canvas.device).expand(B, L)
        see_all = torch.ones(B, L, L, dtype=torch.bool, device=canvas.device)
        rows, slot, present, tok, see = self._layout(canvas, pos, see_all)
        A = tok.shape[1]
        written = present & (tok != self.mask_token_id)
        cond = see & written[:, None, :] & ~torch.eye(A, dtype=torch.bool, device=canvas.device)
        probs = self._marginals(rows, tok, cond)  # (B, A, V)
        out = []
        for b, r in enumerate(rows):
            rel = [p - r.prompt_len for p in orders[b]]
            ks = [k for k in rel if 0 <= k < A]
            pa = _prefix_consistency(probs[b], _consistent_candidates(r, tok[b], written[b]), ks).tolist()
            seen, acc = 0, []
            for k in rel:  # the prefixes of the whole order: only answer positions can break consistency
                seen += 0 <= k < A
                acc.append(pa[seen - 1] if seen else 1.0)
            out.append(torch.tensor(acc, dtype=torch.float64, device=canvas.device))
        return out


def _consistent_candidates(r: _Row, tok: torch.Tensor, written: torch.Tensor) -> torch.Tensor | None:
    """(K', A) the valid answers agreeing with every written token; None for shuffle (counted). The
    shuffle without its original order is enumerated (``n_items <= 8``)."""
    cands = None if r.cands is None else r.cands.to(tok.device)
    if cands is None:
        if not r.inst.exclude_original:
            return None
        if len(r.inst.items) > 8:
            raise ValueError("oracle: joint_consistency of list_shuffle with exclude_original enumerates "
                             "the permutations: n_items must be <= 8")
        cands = torch.tensor(list(itertools.permutations(r.items.tolist())), device=tok.device)
        cands = cands[(cands != r.items.to(tok.device)[None]).any(-1)]
    ok = ((cands == tok[None]) | ~written[None]).all(-1)
    return cands[ok]


def _prefix_consistency(probs: torch.Tensor, cands: torch.Tensor | None, ks: list[int]) -> torch.Tensor:
    """P(consistent) of the first 1..len(ks) positions of ``ks`` drawn independently (float64)."""
    out = []
    if cands is None:  # shuffle: each masked marginal is one uniform over the m unplaced items
        m = int((probs[ks[0]] > 0).sum()) if ks else 0
        acc = 1.0
        for k in range(len(ks)):
            acc *= max(m - k, 0) / m
            out.append(acc)
        return torch.tensor(out, dtype=torch.float64, device=probs.device)
    for k in range(1, len(ks) + 1):
        proj = torch.unique(cands[:, ks[:k]], dim=0)  # distinct consistent assignments of the first k
        pk = probs[torch.tensor(ks[:k], device=probs.device)]  # (k, V)
        p = pk[torch.arange(k, device=probs.device)[None, :], proj]  # (P, k)
        out.append(float(p.prod(-1).sum()) if proj.numel() else 0.0)
    return torch.tensor(out, dtype=torch.float64, device=probs.device)


def is_oracle_spec(spec: object) -> bool:
    """Whether a checkpoint argument names an oracle (``oracle:TASK``) rather than a folder."""
    return isinstance(spec, str) and spec.startswith("oracle:")


def load_oracle(spec: str, dtype: torch.dtype | None = None, device: torch.device | str | None = None
                ) -> tuple[OracleLM, Any]:
    """``(model, tokenizer)`` for a checkpoint spec ``oracle:TASK`` (one line naming the tasks if not)."""
    from dlm_toolkit.models.tokenizer import build_char_tokenizer

    kind = spec.removeprefix("oracle:")
    if kind not in KINDS:
        raise ValueError(f"checkpoint {spec!r}: unknown oracle task {kind!r}; oracle tasks: {', '.join(KINDS)}")
    tok = build_char_tokenizer()
    # no weights to save: a half-precision request (a GPU's default) is served in float32, which keeps the
    # exact marginals to float32 rounding; float64 is honoured
    dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return OracleLM(kind, tok, dtype=dtype, device=device or "cpu"), tok
