"""See a decode step by step: self-contained HTML pages of recorded trajectories.

* :func:`trajectory_page` — one decode (``decode(..., record=True)``): the canvas as rows of
  tokens (one row per block), one forward at a time (slider, step/play buttons, arrow keys), each
  token coloured by what last happened to it (prompt, committed by M2T, edited by T2T, remasked,
  inserted, closed up after a delete, still masked) and shaded by that event's confidence; hover
  shows the confidence and the runner-up token. The active block is tinted, the forward's window
  (the MBE edit window) underlined, post steps marked, a step hook's per-slot outputs
  (``StepRecord.marks``) drawn on the tokens they mark, the EOS after the last other token as one
  chip per line; a strip of bars per forward shows tokens written and edits; batch rows are
  selectable (the page's keys step frames wherever the focus is).
* :func:`compare_page` — two decodes of the same prompts in lock-step by forward, the positions
  where their canvases differ outlined, with their final texts, NFE and TPF.
* :func:`view` — the page for Jupyter (``Trajectory._repr_html_`` uses it).

Pages need no network when viewed: CSS, JS and data are inline (the data as an escaped JSON blob;
token texts reach the page only as text, never as markup). A page embeds at most
:data:`MAX_CELLS` canvas cells (positions x frames, summed over the rows shown) and
:data:`MAX_DATA_CHARS` characters of data: past that, ``every=K`` keeps every K-th forward and
``rows=[...]`` a subset of the batch rows. A token's text is cut at :data:`MAX_TOKEN_CHARS`
characters and a final text at :data:`MAX_FINAL_CHARS` (a tokenizer is data too: its token texts
are unbounded).
"""

from __future__ import annotations

import html as _html
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from dlm_toolkit.config import ConfigError
from dlm_toolkit.util.files import write_text
from dlm_toolkit.viewer.page import cut_text, render, script_json
from dlm_toolkit.viewer.replay import KINDS, row_frames

if TYPE_CHECKING:  # the step's trajectory shows itself with this viewer: no import back at run time
    from dlm_toolkit.step.trajectory import Trajectory

MAX_CELLS = 2_000_000  # canvas positions x frames over the rows shown: a 512-position canvas for ~3,900 forwards
MAX_DATA_CHARS = 64_000_000  # the page's JSON data: far above a page at MAX_CELLS with short token texts
MAX_TOKEN_CHARS = 100  # one token's text as shown (real vocabularies stay far below)
MAX_FINAL_CHARS = 20_000  # one row's final text as shown
NOT_RECORDED = "this decode was not recorded: pass record=True to decode() (dlm decode --html records by itself)"


class ViewerError(ConfigError):
    """A page that cannot be made (not recorded, too large, bad rows/every); one line naming why."""


def trajectory_of(result: Any) -> Trajectory:
    """The trajectory of a :class:`~dlm_toolkit.step.state.DecodeResult` (or a trajectory itself)."""
    traj = getattr(result, "trajectory", result)  # a DecodeResult holds one; a Trajectory is one
    if traj is None:
        raise ViewerError(NOT_RECORDED)
    if not hasattr(traj, "canvases"):
        raise ViewerError(f"expected a DecodeResult or a Trajectory, got {type(result).__name__}")
    if not traj.canvases:
        raise ViewerError("the trajectory holds no recorded forward (or was recorded before prompts were kept): "
                          "decode again with record=True")
    return traj


def _texts(tokenizer: Any, ids: set[int], mask_token_id: int) -> tuple[dict[str, str], dict[int, int]]:
    """Each token's text as shown (cut at :data:`MAX_TOKEN_CHARS`; the mask shows as a dot) and its
    full length."""
    out, full = {}, {}
    for t in sorted(ids):
        text = str(t) if tokenizer is None else str(tokenizer.decode([t], skip_special_tokens=False))
        full[t] = len(text)
        if t != mask_token_id:
            out[str(t)] = cut_text(text, MAX_TOKEN_CHARS)
    return out, full


def _bounds(traj: Trajectory, row: int, length: int) -> list[int]:
    """Where a new line of the canvas starts: every block start the decode used."""
    steps = traj.for_row(row)
    b = traj.block_length
    starts = {s.block_lo for s in steps if s.block_lo >= 0} | {s.block_lo + len(s.block_after) for s in steps}
    origins = {s.block_lo - s.block * b for s in steps if s.block_lo >= 0}
    if b > 0 and len(origins) == 1:  # a fixed layout: every block of it, the prompt's included
        origin = origins.pop()
        starts |= set(range(origin % b, length, b))
    return sorted(p for p in starts if 0 < p < length)


def _check_rows(traj: Trajectory, rows: Sequence[int] | None) -> list[int]:
    n = len(traj.canvases)
    chosen = list(range(n)) if rows is None else list(rows)
    bad = [r for r in chosen if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n]
    if not chosen or bad:
        raise ViewerError(f"rows: must be batch row indices in [0, {n}) (got {list(rows or [])!r})")
    return chosen


def check_every(every: int, option: str = "every") -> None:
    """Refuse a frame stride that is not an integer >= 1."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ViewerError(f"{option}: must be an integer >= 1 (got {every!r})")


def _pane_rows(traj: Trajectory, rows: list[int], every: int) -> tuple[list[dict[str, Any]], set[int], int]:
    out, ids, cells = [], set(), 0
    for i, r in enumerate(rows):
        start, frames = row_frames(traj, r, every)
        length = traj.canvases[r].length
        cells += length * (len(frames) + 1)
        ids.update(c.token for c in start)
        fr = []
        for f in frames:
            ch = []
            for p, c in sorted(f.changes.items()):
                ch.append([p, c.token, c.kind, round(c.confidence, 4), c.runner_up, round(c.runner_up_confidence, 4)])
                ids.add(c.token)
                if c.runner_up >= 0:
                    ids.add(c.runner_up)
            fr.append({"f": f.forward, "post": f.post, "ver": f.verified, "win": list(f.window), "blk": list(f.block),
                       "n": [f.commits, f.edits, f.remasks, f.inserts, f.deletes], "ch": ch,
                       "mk": {name: ps for name, ps in sorted(f.marks.items()) if ps}})
        nfe = frames[-1].forward if frames else 0
        out.append({"label": f"row {r}", "prompt_len": len(traj.canvases[r].prompt), "init": [c.token for c in start],
                    "frames": fr, "bounds": _bounds(traj, r, length), "nfe": nfe, "final": ""})
    return out, ids, cells


def _add_finals(pane: list[dict[str, Any]], result: Any, tokenizer: Any, rows: list[int], vocab: dict[str, str],
                full: dict[int, int]) -> None:
    """Each row's final text with its NFE and TPF (a result holds them; a bare trajectory does not)."""
    res_rows = getattr(result, "rows", None)
    if res_rows is None:
        return
    for out, r in zip(pane, rows):
        row = res_rows[r]
        out["final"] = (f"NFE {row.nfe}  TPF {row.tpf:.2f} (tokens up to and including the first EOS per forward)\n"
                        f"{_final_text(row.tokens, tokenizer, vocab, full)}")


def _final_text(tokens: Sequence[int], tokenizer: Any, vocab: dict[str, str], full: dict[int, int]) -> str:
    if tokenizer is None:
        return cut_text(" ".join(map(str, tokens[:MAX_FINAL_CHARS])), MAX_FINAL_CHARS)
    if sum(full.get(t, MAX_FINAL_CHARS + 1) for t in tokens) > MAX_FINAL_CHARS:  # decoded whole, it could fill memory
        return cut_text("".join(vocab.get(str(t), str(t)) for t in tokens[:MAX_FINAL_CHARS]), MAX_FINAL_CHARS)
    return cut_text(str(tokenizer.decode(list(tokens), skip_special_tokens=False)), MAX_FINAL_CHARS)


FEWER = "keep every K-th forward (every=K, --every K) or fewer batch rows (rows=[...])"


def _check_size(cells: int, every: int) -> None:
    if cells > MAX_CELLS:
        raise ViewerError(f"the trajectory is too large to embed: {cells:,} canvas cells (positions x forwards over "
                          f"the rows shown; limit {MAX_CELLS:,}) at every={every}: {FEWER}")


def _page(title: str, traj: Trajectory, panes: list[dict[str, Any]], vocab: dict[str, str], every: int) -> str:
    data = {"kinds": list(KINDS), "mask": traj.mask_token_id, "eos": traj.eos_token_id, "vocab": vocab,
            "panes": panes}
    blob = script_json(data)
    if len(blob) > MAX_DATA_CHARS:
        raise ViewerError(f"the trajectory is too large to embed: {len(blob):,} characters of data (limit "
                          f"{MAX_DATA_CHARS:,}) at every={every}: {FEWER}")
    return render(title, data, blob)


def trajectory_page(result: Any, tokenizer: Any = None, *, every: int = 1, rows: Sequence[int] | None = None,
                    title: str | None = None) -> str:
    """The viewer page of a recorded decode (a ``DecodeResult`` with ``trajectory``, or a
    :class:`Trajectory`). ``tokenizer``: shows token texts (default: ids). ``every``: one frame per
    K forwards. ``rows``: batch rows to include (default all).

    Raises:
        ViewerError: not recorded, bad ``every``/``rows``, or more than :data:`MAX_CELLS` cells.
    """
    traj = trajectory_of(result)
    check_every(every)
    chosen = _check_rows(traj, rows)
    pane, ids, cells = _pane_rows(traj, chosen, every)
    _check_size(cells, every)
    vocab, full = _texts(tokenizer, ids, traj.mask_token_id)
    _add_finals(pane, result, tokenizer, chosen, vocab, full)
    return _page(title or "dlm decode: trajectory", traj, [{"title": "", "rows": pane}], vocab, every)


def page_title(what: str, policy: str, prompt: str | None = None, checkpoint: str | None = None) -> str:
    """A page's title that says which decode it shows: ``what``, the policy (preset or file and its
    overrides), the prompt's start and the checkpoint's folder name."""
    parts = [f"{what}: {policy}"]
    if prompt is not None:
        parts.append(repr(cut_text(" ".join(prompt.split()), 40)))
    if checkpoint is not None:
        parts.append(Path(checkpoint).name or str(checkpoint))
    return " \u00b7 ".join(parts)


def compare_page(a: Any, b: Any, tokenizer: Any = None, *, labels: tuple[str, str] = ("A", "B"), every: int = 1,
                 rows: Sequence[int] | None = None, title: str | None = None,
                 row_labels: Sequence[str] | None = None) -> str:
    """Two recorded decodes of the same prompts side by side, in lock-step by forward; positions
    where the two canvases hold different tokens are outlined on both sides. ``row_labels``: how
    the row selector names each row shown (default ``row N``).

    Raises:
        ViewerError: either not recorded, different prompts, or too large (as :func:`trajectory_page`).
    """
    ta, tb = trajectory_of(a), trajectory_of(b)
    if [c.prompt for c in ta.canvases] != [c.prompt for c in tb.canvases]:
        raise ViewerError("compare: the two decodes must be of the same prompts (same batch rows)")
    check_every(every)
    chosen = _check_rows(ta, rows)
    panes, ids, cells = [], set(), 0
    for label, traj in ((labels[0], ta), (labels[1], tb)):
        pane, pane_ids, pane_cells = _pane_rows(traj, chosen, every)
        panes.append({"title": label, "rows": pane})
        ids |= pane_ids
        cells += pane_cells
    _check_size(cells, every)
    vocab, full = _texts(tokenizer, ids, ta.mask_token_id)
    for pane, res in zip(panes, (a, b)):
        _add_finals(pane["rows"], res, tokenizer, chosen, vocab, full)
        for row, label in zip(pane["rows"], row_labels or []):
            row["label"] = str(label)
    return _page(title or f"dlm compare: {labels[0]} vs {labels[1]}", ta, panes, vocab, every)


def fit_every(result: Any, rows: Sequence[int] | None = None) -> int:
    """The smallest frame stride that keeps a page of ``result`` within :data:`MAX_CELLS` (at
    most one frame per forward of each row, plus its start)."""
    traj = trajectory_of(result)
    chosen = _check_rows(traj, rows)
    nfe = {r: 0 for r in chosen}
    for s in traj.steps:
        if s.row in nfe:
            nfe[s.row] += 1
    every = 1
    while sum(traj.canvases[r].length * (-(-nfe[r] // every) + 1) for r in chosen) > MAX_CELLS:
        every *= 2
        if every > max(nfe.values(), default=1):
            break
    return every


def check_output(path: str | Path, overwrite: bool, option: str = "--html") -> Path:
    """``path`` as an output file: refused if it exists (without ``overwrite``), is a folder or
    anything but a regular file, or its folder does not exist -- checked before any work is done."""
    path = Path(path)
    if path.is_dir():
        raise ViewerError(f"{option} {path}: is a folder; give a file name")
    if path.exists() and not path.is_file():  # a device or FIFO is never replaced by a page
        raise ViewerError(f"{option} {path}: is not a regular file; give a file name")
    if path.exists() and not overwrite:
        raise ViewerError(f"{option} {path}: exists; pass --overwrite (overwrite=True) to replace it")
    if not path.parent.is_dir():
        raise ViewerError(f"{option} {path}: folder {path.parent} does not exist")
    return path


def write_page(path: str | Path, page: str, overwrite: bool = False) -> Path:
    """Write ``page`` to ``path`` atomically (temp name + rename), refusing an existing file
    unless ``overwrite``."""
    path = check_output(path, overwrite)
    write_text(path, page)
    return path


class Page:
    """An HTML page that Jupyter shows inline, in a sandboxed frame of its own (its ids and styles
    never meet the notebook's)."""

    def __init__(self, page: str, height: int = 520) -> None:
        self.page, self.height = page, height

    def _repr_html_(self) -> str:
        return (f'<iframe sandbox="allow-scripts" style="width:100%;height:{self.height}px;border:1px solid #ddd" '
                f'srcdoc="{_html.escape(self.page, quote=True)}"></iframe>')

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        return write_page(path, self.page, overwrite)


def view(result: Any, tokenizer: Any = None, **kwargs: Any) -> Page:
    """:func:`trajectory_page` as a :class:`Page` (shown inline in Jupyter)."""
    return Page(trajectory_page(result, tokenizer, **kwargs))


def view_compare(a: Any, b: Any, tokenizer: Any = None, **kwargs: Any) -> Page:
    """:func:`compare_page` as a :class:`Page`."""
    return Page(compare_page(a, b, tokenizer, **kwargs), height=620)
