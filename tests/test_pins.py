"""Behaviours no other test pinned (issue 36, part 1): each test here fails on a small, realistic
change to the code (named in its docstring) and passes on the code as it is. Expected values are
worked out by hand from scripted models, never read from the engine."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from dlm_toolkit import BLOCKS, T2T, DecodingPolicy, StrategyError, decode
from dlm_toolkit.testing import ScriptedLM, mixing_logits, table_logits

indel_module = importlib.import_module("dlm_toolkit.hooks.indel")

V, MASK, EOS = 12, 11, 10
A, B = 1, 2


class CachedScripted(ScriptedLM):
    """A scripted model that accepts the engine's KV-cache arguments: its logits depend on no cached
    key (``fn`` reads the window's ids and positions only), so the cache changes no logit."""

    supports_kv_cache = True

    def new_cache(self, batch_size: int, max_length: int):
        return {"rows": batch_size, "length": max_length}


def flat_table(seed: int = 0) -> torch.Tensor:
    table = torch.randn(64, V, generator=torch.Generator().manual_seed(seed)) * 3
    table[:, MASK] = -torch.inf
    table[:, EOS] = -9.0  # no EOS: nothing stops a row early
    return table


def register(registry, name: str, cls) -> str:
    if name not in registry.names():
        registry.register(name)(cls)
    return name


# -- the per-block forward bound, exact with a host read every step ---------------------------------
class _NeverEnds(BLOCKS.get("semi_ar")):
    """Never ends a block: every live row forwards again, forever."""

    def prepare(self, state):
        return ~state.done

    def finish_step(self, state, ctx):
        pass


@pytest.mark.parametrize("post", [0, 3])
def test_the_per_block_forward_bound_stops_after_exactly_limit_plus_one_forwards(post):
    """With ``check_every=1`` the bound's flag is read before every forward: forward ``limit + 1``
    trips it (block_step > limit) and the read before the next one raises. Fails on ``>=`` (limit
    forwards) and on ``> limit + 1`` (limit + 2)."""
    name = register(BLOCKS, "_pins_never_ends", _NeverEnds)
    pol = DecodingPolicy({"m2t": {"name": "threshold", "params": {"threshold": 0.01}},
                          "blocks": {"name": name, "params": {"block_length": 4, "max_post_steps": post}}})
    limit = 4 + post  # block_length + max_post_steps (the schedule's documented bound)
    model = ScriptedLM(table_logits(flat_table()), V, MASK, EOS)
    with pytest.raises(StrategyError, match=rf"'{name}' exceeded {limit} forwards in one block"):
        decode(model, [[1, 2, 3]], pol, 8, kv_cache=False, check_every=1)
    assert model.calls == limit + 1


# -- the engine's three schedule errors ---------------------------------------------------------------
class _StartsBackInCache(BLOCKS.get("semi_ar")):
    """From the second forward of block 2 on, the window starts a block earlier (inside the KV cache by
    then); declared windows are two blocks wide, so only the cache rule breaks."""

    def window_width(self):
        return 2 * self.block_length

    def window(self, state, rows):
        lo, hi = super().window(state, rows)
        back = (state.block[rows] == 2) & (state.block_step[rows] >= 1)
        return torch.where(back, lo - self.block_length, lo), hi


class _TooWide(BLOCKS.get("semi_ar")):
    """Block 2's window reaches one block back: 8 positions against a declared ``window_width()`` of 4."""

    def window(self, state, rows):
        lo, hi = super().window(state, rows)
        return torch.where(state.block[rows] == 2, lo - self.block_length, lo), hi


class _SkipsABlock(BLOCKS.get("semi_ar")):
    """When a block ends the row jumps over the next one (two blocks past the cache at once)."""

    def finish_step(self, state, ctx):
        before = state.block.clone()
        super().finish_step(state, ctx)
        state.advance_blocks((state.block != before) & ~state.done, False)


def schedule_policy(name: str, threshold: float = 0.5) -> DecodingPolicy:
    return DecodingPolicy({"m2t": {"name": "threshold", "params": {"threshold": threshold}},
                           "blocks": {"name": name, "params": {"block_length": 4, "max_post_steps": 0,
                                                               "eos_early_stop": False}}})


def test_a_window_start_moved_back_into_the_kv_cache_is_refused():
    """Fails when the engine's cache-rule check (``bad_cache``) is dropped."""
    name = register(BLOCKS, "_pins_back_in_cache", _StartsBackInCache)
    model = CachedScripted(table_logits(flat_table()), V, MASK, EOS)
    with pytest.raises(StrategyError, match=rf"block schedule '{name}' moved a window start back into the KV cache"):
        decode(model, [[1, 2, 3, 4]], schedule_policy(name, threshold=1.0), 8)
    # near miss: the same schedule without the cache breaks nothing (no cache to move back into)
    res = decode(ScriptedLM(table_logits(flat_table()), V, MASK, EOS), [[1, 2, 3, 4]], schedule_policy(name, 1.0), 8,
                 kv_cache=False)
    assert MASK not in res.tokens[0] and len(res.tokens[0]) == 8


@pytest.mark.parametrize("kv", [True, False], ids=["kv", "no-kv"])
def test_a_window_wider_than_window_width_is_refused(kv):
    """Fails when the engine's width check (``too_wide``) is dropped."""
    name = register(BLOCKS, "_pins_too_wide", _TooWide)
    model = (CachedScripted if kv else ScriptedLM)(table_logits(flat_table()), V, MASK, EOS)
    with pytest.raises(StrategyError, match=rf"block schedule '{name}' returned a window wider than its "
                                            r"window_width\(\) \(4 positions\)"):
        decode(model, [[1, 2, 3, 4]], schedule_policy(name), 8, kv_cache=kv)


def test_a_window_two_blocks_past_the_cache_between_reads_is_refused():
    """Threshold 1.0 commits one position per forward: block 1 takes 4 forwards and a post one (5);
    with ``check_every=2`` the reads come before forwards 1, 3, 5, 7, so the jump to block 3 at the end of
    forward 5 is forwarded (6) without a read: 12 positions past the cache in a forward 8 wide. Fails
    when the engine's overflow flag is dropped; with ``check_every=1`` the read widens the forward
    and the same schedule decodes (the near miss)."""
    name = register(BLOCKS, "_pins_skips_a_block", _SkipsABlock)
    pol = DecodingPolicy({"m2t": {"name": "threshold", "params": {"threshold": 1.0}},
                          "blocks": {"name": name, "params": {"block_length": 4, "max_post_steps": 1,
                                                              "eos_early_stop": False}}})
    model = CachedScripted(table_logits(flat_table()), V, MASK, EOS)
    with pytest.raises(StrategyError, match=rf"block schedule '{name}' moved its window more than one block past the "
                                            r"KV cache between host reads; decode with check_every=1"):
        decode(model, [[1, 2, 3, 4]], pol, 12, check_every=2)
    assert model.calls == 1 + 6  # the prefill, then forwards 1..6
    res = decode(model, [[1, 2, 3, 4]], pol, 12, check_every=1)
    assert res.tokens[0][4:8] == [MASK] * 4 and MASK not in res.tokens[0][:4] + res.tokens[0][8:]


# -- insert/delete edits never touch the prompt -------------------------------------------------------
class _DeletesOnce(T2T.get("indel")):
    """At the decode's first step only, deletes one token: the prompt's last (``target='prompt'``) or the
    first written generated one (the near miss); no other insert/delete ever."""

    target = "prompt"

    def indel(self, ctx):
        first = ctx.step[:, None] == 0
        if self.target == "prompt":
            pick = ctx.valid & ctx.is_prompt & ctx.in_block
            pick = pick & (pick.long().flip(1).cumsum(1).flip(1) == 1)  # the last prompt slot of the block
        else:
            written = indel_module.written_window(ctx) != ctx.mask_token_id
            pick = indel_module.indel_region(ctx) & written
            pick = pick & (pick.long().cumsum(1) == 1)
        return torch.zeros_like(ctx.valid), pick & first


class _DeletesGeneratedOnce(_DeletesOnce):
    target = "generated"


def indel_policy(name: str) -> DecodingPolicy:
    return DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 4, "t2t.name": name,
                                           "m2t.params.threshold": 0.3})


def test_deleting_a_prompt_token_once_at_the_first_step_is_refused():
    """The prompt's tail shares block 0 with the first generated positions. A rule that deletes the
    prompt's last token once (step 0, never again) must be refused at once: without ``~is_prompt``
    in ``indel_region`` the delete is applied silently and the decode returns with a shifted prompt."""
    name = register(T2T, "_pins_deletes_prompt_once", _DeletesOnce)
    model = ScriptedLM(mixing_logits(V, seed=1, scale=2.5, mix=2.0), V, MASK, EOS)
    prompt = [1, 2, 3, 4, 5, 6]
    with pytest.raises(StrategyError, match=rf"t2t rule '{name}' asked to delete position 5, outside what the active "
                                            r"block \[4, 8\) of batch row 0 allows"):
        decode(model, [prompt], indel_policy(name), 6)


def test_deleting_a_generated_token_once_keeps_the_prompt_intact():
    """The near miss of the test above: the same one-off delete of a generated token is applied."""
    name = register(T2T, "_pins_deletes_generated_once", _DeletesGeneratedOnce)
    model = ScriptedLM(mixing_logits(V, seed=1, scale=2.5, mix=2.0), V, MASK, EOS)
    prompt = [1, 2, 3, 4, 5, 6]
    res = decode(model, [prompt], indel_policy(name), 6)
    assert res.rows[0].deletes == 1
    assert res.canvas[0, :6].tolist() == prompt


# -- dynamic blocks: an empty block, and the post-step budget ------------------------------------------
class _EmptySecondBlock(BLOCKS.get("dsb")):
    """Proposes ``[lo, lo)`` (no position) once the first block has moved on."""

    def next_bounds(self, state, ctx):
        lo, hi = super().next_bounds(state, ctx)
        return lo, torch.where(lo > state.prompt_len, lo, hi)


@pytest.mark.parametrize("kv", [True, False], ids=["kv", "no-kv"])
def test_an_empty_dynamic_block_is_refused_with_its_own_message(kv):
    """Fails when ``hi <= lo`` becomes ``hi < lo`` in ``set_bounds`` (the decode then returns masks),
    and when the message reports an empty block as one that leaves the canvas."""
    name = f"{__name__}:_EmptySecondBlock"
    pol = DecodingPolicy({"m2t": {"name": "threshold", "params": {"threshold": 0.5}},
                          "blocks": {"name": name, "params": {"block_length": 4, "max_block_length": 4}}})
    model = (CachedScripted if kv else ScriptedLM)(table_logits(flat_table()), V, MASK, EOS)
    with pytest.raises(StrategyError, match=rf"block schedule '{name}' proposed the active block \[(\d+), \1\) for batch "
                                            r"row 0, which is empty \(it holds no position\)"):
        decode(model, [[1, 2, 3, 4]], pol, 8, kv_cache=kv)


def flip_model(cached: bool) -> ScriptedLM:
    """Each position's argmax follows its own token only: a mask -> A, A -> B, B -> A, all at 0.99, so a
    block without masks is edited at every post forward and never converges."""
    follow = torch.full((V,), A)
    follow[A] = B

    def fn(ids, pos, attn):
        out = torch.full((*ids.shape, V), torch.tensor(0.01 / (V - 2)).log().item())
        out.scatter_(-1, follow[ids][..., None], torch.tensor(0.99).log().item())
        out[..., MASK] = -torch.inf
        return out

    return (CachedScripted if cached else ScriptedLM)(fn, V, MASK, EOS)


@pytest.mark.parametrize("kv", [True, False], ids=["kv", "no-kv"])
@pytest.mark.parametrize("post", [0, 1, 3])
@pytest.mark.parametrize("schedule", ["dsb", "semi_ar"])
def test_post_steps_run_exactly_max_post_steps_forwards(schedule, post, kv):
    """Prompt of one block, 8 generated positions in blocks of 4, the flip model (every post forward
    edits all 4 positions). ``semi_ar``: each block takes 1 commit forward + ``post`` post forwards.
    ``dsb`` (post steps on the last block only): 1 + 1 + ``post``. Fails on ``post >= max_post_steps``
    in either schedule's ``prepare`` (one post forward fewer)."""
    params = {"block_length": 4, "max_post_steps": post, "eos_early_stop": False}
    if schedule == "dsb":
        params["max_block_length"] = 4
    pol = DecodingPolicy({"m2t": {"name": "threshold", "params": {"threshold": 0.5}},
                          "t2t": {"name": "threshold", "params": {"threshold": 0.5}},
                          "blocks": {"name": schedule, "params": params}})
    res = decode(flip_model(kv), [[3, 4, 5, 6]], pol, 8, kv_cache=kv)
    row = res.rows[0]
    blocks_with_post = 2 if schedule == "semi_ar" else 1
    assert row.nfe == 2 + blocks_with_post * post
    assert (row.post_forwards, row.post_forwards_with_edit, row.edits) == (blocks_with_post * post,) * 2 + (
        blocks_with_post * post * 4,)
    flips = [A if post % 2 == 0 else B] * 4  # A committed, then one flip per post forward
    assert res.tokens[0] == (flips if schedule == "semi_ar" else [A] * 4) + flips


# -- stop strings --------------------------------------------------------------------------------------
class CharTokenizer:
    """Token ``i`` is the letter ``'a' + i`` (the mask and EOS never reach ``decode``: EOS is cut first)."""

    def decode(self, ids):
        return "".join(chr(ord("a") + int(i)) for i in ids)


def letters_model(eos_at: int | None = None) -> ScriptedLM:
    """Position ``p`` of the canvas is ``(p - 4) % 10`` ("a".."j" from position 4 on) at 0.99; with
    ``eos_at`` that position is EOS."""
    table = torch.full((64, V), -20.0)
    for p in range(64):
        table[p, (p - 4) % 10] = 20.0
    if eos_at is not None:
        table[eos_at] = -20.0
        table[eos_at, EOS] = 20.0
    table[:, MASK] = -torch.inf
    return ScriptedLM(table_logits(table), V, MASK, EOS)


def stop_policy(**blocks) -> DecodingPolicy:
    return DecodingPolicy({"m2t": {"name": "threshold", "params": {"threshold": 0.5}}, "t2t": {"name": "none"},
                           "blocks": {"name": "semi_ar", "params": {"block_length": 4, "max_post_steps": 1, **blocks}}})


@pytest.mark.parametrize("stop, text, blocks", [
    ("bc", "a", 1),      # inside block 1 (positions 4..7: "abcd")
    ("de", "abc", 2),    # "d" ends block 1, "e" starts block 2: seen only once block 2 is decoded
    ("fg", "abcde", 2),  # inside block 2
])
def test_a_stop_string_across_a_block_boundary_stops_the_row(stop, text, blocks):
    """Prompt of one block, 20 generated positions (5 blocks of 4), 2 forwards per block (its commit
    and one post forward). A row stops after the block that completes the stop string: 2 forwards
    per decoded block, not 10 for the whole budget. Fails when the stop check reads only the
    segment's own text (the straddling "de" is then missed: 10 forwards, the same text)."""
    from dlm_toolkit.evaluation.generate import generate

    rows, _ = generate(letters_model(), CharTokenizer(), [[0, 1, 2, 3]], stop_policy(), 20, stop=[stop], seeds=[0])
    row = rows[0]
    assert (row.text, row.stopped, row.nfe, row.blocks_skipped) == (text, "stop", 2 * blocks, 5 - blocks)
    assert row.tokens == [(p - 4) % 10 for p in range(4, 4 + 4 * blocks)]


def test_the_unsegmented_path_reports_an_eos_without_eos_early_stop():
    """Blocks aligned after the prompt are decoded whole (not segmented); with ``eos_early_stop`` off
    the decode does not report the EOS (``eos_stopped`` false), yet the row did end at one:
    ``stopped`` is "eos". Fails when ``stopped`` reads only ``eos_stopped``."""
    from dlm_toolkit.evaluation.generate import generate, segmentable

    pol = stop_policy(align="prompt", eos_early_stop=False)
    model = letters_model(eos_at=3 + 6)  # prompt of 3: the seventh generated position (after "jabcde")
    assert not segmentable(model, pol)
    rows, _ = generate(model, CharTokenizer(), [[0, 1, 2]], pol, 12, stop=["zz"], seeds=[0])
    assert (rows[0].text, rows[0].stopped) == ("jabcde", "eos")
    assert rows[0].tokens == [9, 0, 1, 2, 3, 4, EOS]
    # near miss: no EOS in the budget, no stop string: ran to the budget
    rows, _ = generate(letters_model(), CharTokenizer(), [[0, 1, 2]], pol, 12, stop=["zz"], seeds=[0])
    assert (rows[0].text, rows[0].stopped) == ("jabcdefghija", None)


# -- atomic writes: the fsync / replace order, and all or nothing part-way ----------------------------
def _record_syncs_and_renames(monkeypatch) -> list[tuple[str, str]]:
    """Patch ``os.fsync`` and ``os.replace`` to log ``("fsync", path)`` / ``("replace", target name)``
    (then do the real call)."""
    import os

    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        calls.append(("replace", os.path.basename(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return calls


def test_atomic_write_many_syncs_every_file_then_renames_then_syncs_the_folder(tmp_path, monkeypatch):
    """Each temporary is fsynced (its bytes on disk) before any rename, and the folder once after the
    last rename (the renames on disk). Fails without the temporary's fsync and with the folder fsynced
    before the renames."""
    from dlm_toolkit.util.files import atomic_write_many

    calls = _record_syncs_and_renames(monkeypatch)
    names = ["b.txt", "a.txt", "c.txt"]
    atomic_write_many(tmp_path, {n: (lambda tmp, n=n: tmp.write_text(n)) for n in names})
    kinds = [(kind, Path(p).name if kind == "fsync" else p) for kind, p in calls]
    synced = [name for kind, name in kinds[:3]]
    assert [k for k, _ in kinds] == ["fsync"] * 3 + ["replace"] * 3 + ["fsync"]
    assert [s.split(".tmp-")[0] for s in synced] == [f".{n}" for n in names]  # the temporaries, in order
    assert [name for _, name in kinds[3:6]] == names
    assert Path(calls[-1][1]) == tmp_path.resolve()
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {n: n for n in names}


def test_a_multi_file_write_failing_part_way_changes_no_file(tmp_path):
    """The third of three files fails after two were complete: every previous file keeps its bytes
    and no temporary is left. Fails if a file is renamed as soon as it is written."""
    from dlm_toolkit.util.files import atomic_write_many

    for n in ("a", "b", "c"):
        (tmp_path / n).write_text(f"old {n}")

    def broken(tmp):
        tmp.write_text("half")
        raise RuntimeError("writer failed")

    with pytest.raises(RuntimeError, match="writer failed"):
        atomic_write_many(tmp_path, {"a": lambda t: t.write_text("new a"), "b": lambda t: t.write_text("new b"),
                                     "c": broken})
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {n: f"old {n}" for n in ("a", "b", "c")}


def test_a_tokenizer_save_failing_at_its_last_file_changes_no_file(tmp_path, monkeypatch):
    """save_tokenizer claims all or nothing: the disk fills while the last of its three files is
    synced (the first two complete by then): every previous file keeps its bytes, nothing is left
    behind, and the error names the file (the last in name order)."""
    import json

    from dlm_toolkit.util import files
    from dlm_toolkit.models.tokenizer import build_char_tokenizer, save_tokenizer

    testbed = Path(__file__).resolve().parents[1] / "checkpoints" / "testbed-editable"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / name).write_text(json.dumps(json.loads((testbed / name).read_text())))  # other bytes
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real = files.fsync_file
    synced: list[str] = []

    def fsync_file(path):
        synced.append(path.name)
        if len(synced) == 3:
            raise OSError(28, "No space left on device")
        return real(path)

    monkeypatch.setattr(files, "fsync_file", fsync_file)
    with pytest.raises(files.NoSpaceError, match=r"no space left on device while writing .*tokenizer_config\.json"):
        save_tokenizer(build_char_tokenizer(), tmp_path)
    assert len(synced) == 3
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
