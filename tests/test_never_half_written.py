"""Never overwrite, never half-write: `dlm train --out` refuses a checkpoint folder unless
--overwrite; a full disk (a child under RLIMIT_FSIZE, or a small tmpfs) or a SIGKILL while a
model, a resume point or any file is written leaves the previous files byte for byte as they were."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlm_toolkit.cli import main as cli_main
from dlm_toolkit.util.files import NoSpaceError, atomic_write, read_regular, write_text

REPO = Path(__file__).resolve().parents[1]
TESTBED = REPO / "checkpoints" / "testbed-editable"
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, n_group=2,
            topk_group=1, max_position_embeddings=64, tasks={"add": 1.0}, steps=6, batch_tokens=128,
            warmup_steps=1, eval_n=0, checkpoint_interval=2, block_lengths=[4])
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def config_file(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "train.json"
    path.write_text(json.dumps({**TINY, **changes}))
    return path


def dlm(args: list[str], fsize: int | None = None, **kw) -> subprocess.CompletedProcess:
    """`dlm ARGS` in a child; ``fsize``: its RLIMIT_FSIZE (writes past it fail with EFBIG, as on a full disk)."""
    def limit() -> None:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run([sys.executable, "-c", "import sys\nfrom dlm_toolkit.cli import main\nsys.exit(main())",
                           *args], capture_output=True, text=True, env=ENV, preexec_fn=limit, timeout=300, **kw)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in done.stderr, done.stderr
    return lines[0]


# ----------------------------------------------------------------------------------------------- --out
@pytest.mark.parametrize("held", [["config.json", "model.safetensors"], ["training.json"], ["tokenizer.json"]])
def test_train_refuses_a_folder_holding_what_it_would_replace(held, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    for name in held:
        shutil.copy(TESTBED / name, out / name)
    before = snapshot(out)
    assert cli_main(["train", str(config_file(tmp_path)), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"out: {out} already holds {held[0]}" in err[0] and "--overwrite" in err[0]
    assert snapshot(out) == before


def test_overwrite_replaces_a_checkpoint_completely(tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(TESTBED, out)
    (out / "notes.txt").write_text("mine")  # not something train writes: kept, and not a reason to refuse
    assert cli_main(["train", str(config_file(tmp_path)), "--out", str(out), "--no-progress", "--overwrite"]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["hidden_size"] == 32 and json.loads((out / "training.json").read_text())["steps"] == 6
    assert (out / "notes.txt").read_text() == "mine"
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "no staging or temporary left"
    fresh = tmp_path / "fresh"
    assert cli_main(["train", str(config_file(tmp_path)), "--out", str(fresh), "--no-progress"]) == 0
    assert (fresh / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_a_refused_train_creates_nothing(tmp_path, capsys):
    out = tmp_path / "never"
    assert cli_main(["train", str(config_file(tmp_path, max_position_embeddings=16)), "--out", str(out),
                     "--no-progress"]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err and not out.exists()


# ----------------------------------------------------------------------------------------------- disk full
def test_disk_full_while_writing_a_resume_point_keeps_the_previous_one(tmp_path, monkeypatch):
    from dlm_toolkit.training import loop as training
    from dlm_toolkit.training import load_train_config, train

    out, cfg = tmp_path / "out", config_file(tmp_path)
    real = training.lr_at

    def lr_or_die(step, config):
        if step == 3:
            raise KeyboardInterrupt("killed")  # after the resume point of step 2
        return real(step, config)

    with monkeypatch.context() as m:
        m.setattr(training, "lr_at", lr_or_die)
        with pytest.raises(KeyboardInterrupt):
            train(load_train_config(cfg), out, progress=False)
    before = snapshot(out)
    size = (out / "resume" / "model.safetensors").stat().st_size
    line = one_error_line(dlm(["train", str(cfg), "--out", str(out), "--no-progress", "--resume"], fsize=size // 2))
    assert line == (f"error: no space left on device while writing {out / 'resume.tmp' / 'model.safetensors'}"
                    "; the previous resume point is unchanged")
    assert snapshot(out) == before  # the step-2 point as it was, no resume.tmp
    train(load_train_config(cfg), out, progress=False, resume=True)  # and it still continues
    assert (out / "model.safetensors").is_file() and not (out / "resume").exists()


def test_disk_full_while_saving_the_trained_model_keeps_the_previous_checkpoint(tmp_path):
    out = tmp_path / "out"
    shutil.copytree(TESTBED, out)
    before = snapshot(out)
    line = one_error_line(dlm(["train", str(config_file(tmp_path, checkpoint_interval=0)), "--out", str(out),
                               "--no-progress", "--overwrite"], fsize=20_000))
    assert line == (f"error: no space left on device while writing {out / 'model.safetensors'}; "
                    "the previous model.safetensors is unchanged")
    assert snapshot(out) == before and not [p for p in out.iterdir() if p.name.startswith(".")]


SAVE = """
import sys, time
import safetensors.torch
from dlm_toolkit.models.checkpoint import load_model, save_model
model = load_model(sys.argv[1])
for p in model.parameters():
    p.data.mul_(-1.0)  # other weights than the ones on disk
if sys.argv[3] == "slow":  # a slow disk: the new file is written, then the process is killed before the rename
    real = safetensors.torch.save_file
    def slow(tensors, file, metadata=None):
        real(tensors, file, metadata=metadata)
        print("written", flush=True)
        time.sleep(60)
    import dlm_toolkit.models.checkpoint as c
    c.save_file = slow
save_model(model, sys.argv[2], max_shard_bytes=int(sys.argv[4]) or None)
"""


@pytest.mark.parametrize("layout", [0, 400_000])  # one file / shards with an index
def test_disk_full_while_saving_a_model_leaves_the_previous_files(layout, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(TESTBED, out)
    before = snapshot(out)
    script = tmp_path / "save.py"
    script.write_text(SAVE)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, 30_000))

    full = subprocess.run([sys.executable, str(script), str(TESTBED), str(out), "fast", str(layout)], env=ENV,
                          capture_output=True, text=True, preexec_fn=limit, timeout=300)
    last = full.stderr.strip().splitlines()[-1]
    prefix = f"dlm_toolkit.util.files.NoSpaceError: no space left on device while writing {out}/"
    if layout:  # the first shard is a new name: nothing of it existed before
        assert re.fullmatch(re.escape(prefix) + r"(model-00001-of-\d{5}\.safetensors); \1 was not written", last), last
    else:
        assert last == prefix + "model.safetensors; the previous model.safetensors is unchanged"
    assert full.returncode == 1
    assert snapshot(out) == before


def test_a_model_save_killed_midway_leaves_the_previous_files(tmp_path):
    from dlm_toolkit.models.checkpoint import load_model, save_model

    out = tmp_path / "ckpt"
    shutil.copytree(TESTBED, out)
    before = snapshot(out)
    script = tmp_path / "save.py"
    script.write_text(SAVE)
    slow = subprocess.Popen([sys.executable, str(script), str(TESTBED), str(out), "slow", "0"], env=ENV,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert slow.stdout.readline().strip() == "written"
        assert [p.name for p in out.iterdir() if ".tmp-" in p.name], "the new file sits under a temporary name"
        os.kill(slow.pid, signal.SIGKILL)
    finally:
        slow.kill()
        slow.wait()
    assert {k: v for k, v in snapshot(out).items() if ".tmp-" not in k} == before
    model = load_model(out)  # still the complete previous checkpoint
    save_model(model, out)
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name], "the next save removes a dead writer's temporary"
    assert snapshot(out) == before  # the same weights written again: the same bytes


# ----------------------------------------------------------------------------------------------- the helper
def test_atomic_write_keeps_the_old_file_on_failure_and_names_the_file_when_full(tmp_path):
    target = tmp_path / "pareto.json"
    target.write_text("old")

    def boom(tmp: Path) -> None:
        tmp.write_text("half")
        raise RuntimeError("writer bug")

    with pytest.raises(RuntimeError):
        atomic_write(target, boom)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["pareto.json"]

    def full(tmp: Path) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(NoSpaceError, match=f"writing {target}; the previous pareto.json is unchanged"):
        atomic_write(target, full)
    with pytest.raises(NoSpaceError, match="new.json was not written"):
        atomic_write(tmp_path / "new.json", full)
    assert [p.name for p in tmp_path.iterdir()] == ["pareto.json"] and target.read_text() == "old"
    write_text(target, "new")
    assert target.read_text() == "new"


TMPFS_SCRIPT = """
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("files", sys.argv[1])  # the module alone: no torch to import
files = importlib.util.module_from_spec(spec)
spec.loader.exec_module(files)
NoSpaceError, write_bytes = files.NoSpaceError, files.write_bytes
target = Path('/full/data.bin')
write_bytes(target, b'old' * 1000)
try:
    write_bytes(target, b'x' * 300_000)
except NoSpaceError as err:
    print('refused:', err)
print('kept:', target.read_bytes() == b'old' * 1000, sorted(p.name for p in Path('/full').iterdir()))
"""


def test_a_real_full_disk_on_a_small_tmpfs(tmp_path):
    """ENOSPC from a 200 kB tmpfs (bubblewrap mounts it in a private namespace; the tests need bwrap)."""
    bwrap = shutil.which("bwrap")
    assert bwrap, "bubblewrap missing: install it with `apt-get install bubblewrap` (scripts/test.sh does)"
    script = tmp_path / "full.py"
    script.write_text(TMPFS_SCRIPT)
    done = subprocess.run([bwrap, "--dev-bind", "/", "/", "--size", "200000", "--tmpfs", "/full", sys.executable,
                           str(script), str(REPO / "dlm_toolkit" / "util" / "files.py")], capture_output=True, text=True,
                          env=ENV, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "refused: no space left on device while writing /full/data.bin; the previous data.bin is " \
           "unchanged" in done.stdout
    assert "kept: True ['data.bin']" in done.stdout


def test_reads_refuse_special_and_oversized_files(tmp_path):
    from dlm_toolkit.util.files import InputFileError

    fifo = tmp_path / "policy.json"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(InputFileError, match="must be a regular file, this is a FIFO"):
        read_regular(fifo, 100)
    assert time.monotonic() - start < 1
    with pytest.raises(InputFileError, match="this is a character device"):
        read_regular("/dev/zero", 100)
    with pytest.raises(InputFileError, match="this is a folder"):
        read_regular(tmp_path, 100)
    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(InputFileError, match="101 bytes; file is limited to 100 bytes"):
        read_regular(tmp_path / "big", 100)
    assert read_regular(tmp_path / "big", 101) == b"x" * 101


def test_the_final_checkpoint_is_replaced_all_at_once(tmp_path, monkeypatch):
    """The disk fills at the last file of the final save (the loss plot): nothing of the previous
    checkpoint may have been replaced yet -- no new weights beside an old training.json."""
    from dlm_toolkit.training import loop as training
    from dlm_toolkit.training import load_train_config, train

    out = tmp_path / "out"
    shutil.copytree(TESTBED, out)
    special = out / "special_tokens_map.json"  # other bytes than a new save writes, same meaning
    special.write_text(json.dumps(json.loads(special.read_text())))
    before = snapshot(out)

    def full(history, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(training, "plot_loss", full)
    with pytest.raises(NoSpaceError, match="the previous model.safetensors is unchanged"):
        train(load_train_config(config_file(tmp_path, checkpoint_interval=0)), out, progress=False, overwrite=True)
    assert snapshot(out) == before and not [p for p in out.iterdir() if p.name.startswith(".")]


def test_pareto_files_are_replaced_whole_or_not_at_all(tmp_path):
    """pareto.png/.csv/.json written while the disk fills up (RLIMIT_FSIZE lowered around the call:
    Python ignores SIGXFSZ, so writes past it fail with EFBIG) keep their previous contents."""
    from dlm_toolkit.sweep.pareto import TrialPoint, plot, summarize_points, write_all, write_csv, write_json

    def summary(n: int):
        points = [TrialPoint(i, {"accuracy": i / n, "tpf": 1 + (n - i) / n, "n": 8}) for i in range(n)]
        return summarize_points("s", {"accuracy": "maximize", "tpf": "maximize"}, points, {"complete": n})

    write_all(summary(3), tmp_path)
    before = snapshot(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    for write, name in ((plot, "pareto.png"), (write_csv, "pareto.csv"), (write_json, "pareto.json")):
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))
        try:
            with pytest.raises(NoSpaceError, match=f"writing {tmp_path / name}; the previous {name} is unchanged"):
                write(summary(40), tmp_path / name)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert snapshot(tmp_path) == before


def test_tokenizer_files_are_replaced_whole_or_not_at_all(tmp_path):
    from dlm_toolkit.models.tokenizer import build_char_tokenizer, save_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / name).write_text(json.dumps(json.loads((TESTBED / name).read_text())))  # other bytes
    before = snapshot(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))  # tokenizer.json is larger: the disk "fills" there
    try:
        with pytest.raises(NoSpaceError, match="the previous tokenizer.json is unchanged"):
            save_tokenizer(build_char_tokenizer(), tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert snapshot(tmp_path) == before
