"""``training.claim``: the lock on ``--out`` is re-checked once held (issue 43, boundary rows).

The race: run A holds ``OUT/.dlm-train.lock``; run B opens that file; A ends (removes the file,
then drops its lock); B's ``flock`` now succeeds -- on a file no longer in the folder. Unless B
checks, after locking, that the path still names the file it holds, B goes on as owner while a
third run C creates a new lock file, locks it and goes on too: two writers in one ``--out``. The
interleaving is forced by running A's exit right after B's ``open`` returns (real files, real
``flock``; one process, whose two open files lock each other as two processes' would).
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

import pytest

from dlm_toolkit.config import ConfigError
from dlm_toolkit.training.claim import LOCK_NAME, claim


def _b_opens_then_a_ends(monkeypatch: pytest.MonkeyPatch, a: ExitStack) -> None:
    real_open = os.open

    def open_then_a_ends(*args, **kwargs):
        fd = real_open(*args, **kwargs)
        monkeypatch.setattr(os, "open", real_open)  # once: B's first open only
        a.close()  # A's run ends between B's open and B's flock
        return fd

    monkeypatch.setattr(os, "open", open_then_a_ends)


@pytest.mark.parametrize("a_made_the_folder", [False, True])
def test_a_third_run_is_refused_while_the_second_holds_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           a_made_the_folder: bool) -> None:
    out = tmp_path / "out"
    if not a_made_the_folder:
        out.mkdir()
    a = ExitStack()
    a.enter_context(claim(out))
    _b_opens_then_a_ends(monkeypatch, a)
    with claim(out):  # B: its first lock file was removed under it; it must hold the new one
        with pytest.raises(ConfigError, match=rf"^out: {out} is being written by another dlm train \(pid {os.getpid()} "):
            with claim(out):  # C
                pass
        assert (out / LOCK_NAME).is_file()  # B's, left alone by C
    assert not (out / LOCK_NAME).exists()


def test_without_the_race_the_second_run_is_refused(tmp_path: Path) -> None:
    """The near miss: A still holds ``out`` when B tries; B is refused and A's claim stays."""
    out = tmp_path / "out"
    with claim(out):
        with pytest.raises(ConfigError, match="is being written by another dlm train"):
            with claim(out):
                pass
        assert (out / LOCK_NAME).is_file()
    assert not out.exists()  # A made the folder and left nothing in it
