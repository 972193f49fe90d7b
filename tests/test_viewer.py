"""The trajectory viewer without a browser: replay, kinds, escaping, bounds and where pages are written
(tests/test_viewer_browser.py opens the pages)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dlm_toolkit import DecodingPolicy, decode
from viewer_helpers import TESTBED, load_testbed, recorded, replay


def _frames_tokens(traj, row, every=1):
    """The canvas after each frame, built from what the page embeds (start + changes)."""
    from dlm_toolkit.viewer.replay import row_frames

    start, frames = row_frames(traj, row, every)
    canvas = [c.token for c in start]
    out = [list(canvas)]
    for f in frames:
        for p, c in f.changes.items():
            canvas[p] = c.token
        out.append(list(canvas))
    return out, frames


def test_testbed_decode_edits_remasks_and_reaches_back():
    res = recorded()
    rows = res.rows
    assert sum(r.edits for r in rows) > 0 and sum(r.remasks for r in rows) > 0, "nothing to see: the tests check nothing"
    traj = res.trajectory
    behind = [s for s in traj.steps if any(p < s.block_lo for p in s.edit)]
    assert behind, "no edit outside the active block: the MBE window is not exercised"


def test_reference_replay_ends_on_the_engines_canvas():
    res = recorded()
    for row in range(len(res.rows)):
        ref = replay(res.trajectory, row)
        assert len(ref) == res.rows[row].nfe + 1
        assert ref[-1] == res.canvas[row, :len(ref[-1])].tolist()


@pytest.mark.parametrize("every", [1, 3])
def test_page_frames_are_the_canvas_after_each_forward(every):
    res = recorded()
    for row in range(len(res.rows)):
        ref = replay(res.trajectory, row)
        got, frames = _frames_tokens(res.trajectory, row, every)
        want = [ref[0]] + [ref[min(k * every, len(ref) - 1)] for k in range(1, len(got))]
        assert got == want
        assert [f.forward for f in frames][-1] == len(ref) - 1  # the last forward always has its frame
        assert len(frames) == -(-(len(ref) - 1) // every)


def test_insert_and_delete_shifts_replay_to_the_engines_canvas():
    from dlm_toolkit.step.state import row_seed
    from dlm_toolkit.testing import tiny_llada2
    from dlm_toolkit.viewer.replay import DELETE, INSERT

    eager = {"t2t.name": "indel", "t2t.params.delete_threshold": 0.3, "t2t.params.insert_threshold": 0.3,
             "t2t.params.keep_below": 0.95, "blocks.params.block_length": 4}
    res = decode(tiny_llada2(seed=1), [[5, 6, 7]], DecodingPolicy("llada2.1-q", **eager), 12, record=True,
                 seed=[row_seed(0, 0)])
    assert res.rows[0].inserts + res.rows[0].deletes > 0
    got, frames = _frames_tokens(res.trajectory, 0)
    assert got == replay(res.trajectory, 0)
    assert got[-1] == res.canvas[0, :len(got[-1])].tolist()
    kinds = {c.kind for f in frames for c in f.changes.values()}
    assert {INSERT, DELETE} & kinds


def test_kind_is_what_last_happened():
    from dlm_toolkit.viewer.replay import COMMIT, EDIT, MASKED, PROMPT, REMASK, row_frames

    res = recorded()
    traj = res.trajectory
    seen = set()
    for row in range(len(res.rows)):
        start, frames = row_frames(traj, row)
        plen = len(traj.canvases[row].prompt)
        assert [c.kind for c in start] == [PROMPT] * plen + [MASKED] * (len(start) - plen)
        for f in frames:
            s = f.record
            conf = dict(zip(s.positions, s.confidence))
            for positions, kind in ((s.commit, COMMIT), (s.edit, EDIT), (s.remask, REMASK)):
                for p in positions:
                    if kind != REMASK and p in s.remask:
                        continue  # a remask of the same step wins
                    cell = f.changes.get(p)
                    if cell is None:  # re-written with the same token, kind and confidence
                        continue
                    assert (cell.kind, cell.confidence) == (kind, conf[p])
                    seen.add(kind)
    assert seen == {COMMIT, EDIT, REMASK}


def test_runner_up_is_another_token_no_likelier_than_the_top():
    res = recorded()
    n = 0
    for s in res.trajectory.steps:
        assert len(s.runner_up) == len(s.positions) == len(s.runner_up_confidence)
        for tok, ru, p_ru in zip(s.sampled, s.runner_up, s.runner_up_confidence):
            assert ru != tok and 0.0 <= p_ru <= 1.0
            n += 1
    assert n > 0


def test_script_json_is_inert_in_a_script_element():
    from dlm_toolkit.viewer.page import script_json

    hostile = {"t": "</script><script>alert(1)</script>", "u": "<!-- \u2028\u2029 & >", "k": '"><img onerror=x>'}
    text = script_json(hostile)
    assert not set("<>&\u2028\u2029") & set(text)
    assert json.loads(text) == hostile


class HostileTokenizer:
    """Token texts that are markup: the page must show them as text."""

    TEXTS = {0: "<script>window.__pwned=1</script>", 1: '"><img src=x onerror="window.__pwned=2">', 2: "</script>"}

    def __init__(self, inner):
        self.inner = inner

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.TEXTS.get(i % 3, "") + self.inner.decode([i]) for i in ids)


def test_page_embeds_markup_only_as_escaped_text():
    from dlm_toolkit.viewer import trajectory_page

    _, tok, _, _ = load_testbed()
    page = trajectory_page(recorded(), HostileTokenizer(tok))
    assert page.count("<script") == 2 and page.count("</script>") == 2  # the data blob and the viewer's code
    assert "onerror" in page and "<img" not in page


def test_not_recorded_says_how():
    from dlm_toolkit.viewer import ViewerError, trajectory_page

    model, _, prompts, gen = load_testbed()
    res = decode(model, prompts[:1], "llada2.1-s", gen)
    with pytest.raises(ViewerError, match=r"pass record=True"):
        trajectory_page(res)


def test_size_bound_and_every(monkeypatch):
    import dlm_toolkit.viewer as viewer

    res = recorded()
    cells = sum(c.length * (r.nfe + 1) for c, r in zip(res.trajectory.canvases, res.rows))
    monkeypatch.setattr(viewer, "MAX_CELLS", cells)
    viewer.trajectory_page(res)  # exactly at the bound
    assert viewer.fit_every(res) == 1
    monkeypatch.setattr(viewer, "MAX_CELLS", cells - 1)
    with pytest.raises(viewer.ViewerError, match=rf"{cells:,} canvas cells .*limit {cells - 1:,}.*every=K"):
        viewer.trajectory_page(res)
    assert viewer.fit_every(res) == 2
    viewer.trajectory_page(res, every=2)
    viewer.trajectory_page(res, rows=[0])  # a subset of the rows fits too
    with pytest.raises(viewer.ViewerError, match=r"rows: must be batch row indices in \[0, 2\)"):
        viewer.trajectory_page(res, rows=[2])
    with pytest.raises(viewer.ViewerError, match=r"every: must be an integer >= 1"):
        viewer.trajectory_page(res, every=0)


def test_compare_refuses_other_prompts():
    from dlm_toolkit.viewer import ViewerError, compare_page

    model, _, prompts, gen = load_testbed()
    other = decode(model, prompts[::-1], "llada2.1-s", gen, record=True)
    with pytest.raises(ViewerError, match="same prompts"):
        compare_page(recorded(), other)


def test_jupyter_repr_is_a_sandboxed_frame():
    html = recorded().trajectory._repr_html_()
    assert html.startswith('<iframe sandbox="allow-scripts"') and "<script" not in html  # all of it inside srcdoc


def test_write_page_refuses_existing_file_and_missing_folder(tmp_path):
    from dlm_toolkit.viewer import ViewerError, write_page

    out = tmp_path / "v.html"
    write_page(out, "one")
    with pytest.raises(ViewerError, match="exists; pass --overwrite"):
        write_page(out, "two")
    assert out.read_text() == "one"
    write_page(out, "two", overwrite=True)
    assert out.read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["v.html"]
    with pytest.raises(ViewerError, match="does not exist"):
        write_page(tmp_path / "no" / "v.html", "x")
    with pytest.raises(ViewerError, match="is a folder"):
        write_page(tmp_path, "x", overwrite=True)
    with pytest.raises(ViewerError, match="/dev/null: is not a regular file"):
        write_page("/dev/null", "x", overwrite=True)


def test_cli_decode_html(tmp_path, capsys):
    from dlm_toolkit.cli import main

    out = tmp_path / "d.html"
    args = ["decode", "--checkpoint", str(TESTBED), "--prompt", "pick:<script>x</script>|", "--gen-length", "8",
            "--html", str(out)]
    assert main(args) == 0
    page = out.read_text()
    assert page.count("<script") == 2 and "<script>x" not in page and '"\\u003c"' in page  # the character "<"
    before = page
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --html {out}: exists; pass --overwrite (overwrite=True) to replace it"
    assert out.read_text() == before
    assert main(args + ["--overwrite", "--every", "0"]) == 2
    assert "--every: must be an integer >= 1" in capsys.readouterr().err
    assert main(args + ["--overwrite", "--every", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"viewer: {out}"


def test_cli_compare_html(tmp_path, capsys):
    from dlm_toolkit.cli import main

    out = tmp_path / "c.html"
    assert main(["compare", "--checkpoint", str(TESTBED), "--task", "pick", "--n", "2", "--no-progress",
                 "--html", str(out), "--n-boot", "100"]) == 0
    data = json.loads(re.search(r'id="dlm-data">(.*?)</script>', out.read_text()).group(1))
    assert [p["title"] for p in data["panes"]] == ["A llada2.1-q", "B llada2.1-s"]
    assert len(data["panes"][0]["rows"]) == 2


def test_trial_logs_a_trajectory_page(tmp_path):
    from mlflow import MlflowClient

    from dlm_toolkit.sweep.tracking import Tracker, TrialRun
    from dlm_toolkit.tasks import get_task
    from sweep_helpers import tracking_uri

    model, tok, _, _ = load_testbed()
    uri = tracking_uri(tmp_path)
    tracker = Tracker(uri, "viewer")
    run = tracker.client.create_run(tracker.experiment_id)
    trial = TrialRun(tracker, run.info.run_id)
    tracker.client.set_tag(run.info.run_id, "mlflow.note.content", "Trial 0 of study 's'")
    assert trial.log_trajectories(model, tok, get_task("pick"), DecodingPolicy("llada2.1-s").config, 0) == "trajectory.html"
    client = MlflowClient(uri)
    assert "trajectory.html" in [a.path for a in client.list_artifacts(run.info.run_id)]
    tags = client.get_run(run.info.run_id).data.tags
    assert tags["trajectory_html"] == "trajectory.html" and "trajectory_html_error" not in tags
    assert tags["mlflow.note.content"].startswith("Trial 0 of study 's'\n\nStep-by-step decode of 2 eval instances")


def test_a_batch_decoded_in_slices_replays_row_by_row():
    """Trajectory.concat (a batch past the largest capture bucket) keeps each slice's prompts and
    canvas lengths, renumbered with its rows."""
    model, _, prompts, gen = load_testbed()
    first = decode(model, prompts[:1], "llada2.1-s", gen, record=True, seed=[11])
    second = decode(model, [prompts[1][:40]], "llada2.1-s", gen, record=True, seed=[12])
    whole = first.trajectory.concat([second.trajectory], [first, second])
    assert [c.prompt for c in whole.canvases] == [prompts[0], prompts[1][:40]]
    for row, part in ((0, first), (1, second)):
        got, _ = _frames_tokens(whole, row)
        assert got == replay(whole, row) and got[-1] == part.canvas[0, :len(got[-1])].tolist()


def test_pareto_html_on_the_parent_run_links_each_trial_run(tmp_path):
    import optuna
    from mlflow import MlflowClient

    from dlm_toolkit.sweep.pareto import TrialPoint, summarize_points
    from dlm_toolkit.sweep.tracking import Tracker
    from sweep_helpers import tracking_uri

    uri = tracking_uri(tmp_path)
    tracker = Tracker(uri, "viewer")
    parent = tracker.client.create_run(tracker.experiment_id).info.run_id
    study = optuna.create_study(directions=["maximize", "maximize"])
    for i, (acc, tpf) in enumerate([(0.9, 2.0), (0.8, 1.0)]):
        study.add_trial(optuna.trial.create_trial(values=[acc, tpf], user_attrs={"mlflow_run_id": f"run{i}"}))
    points = [TrialPoint(t.number, {"accuracy": t.values[0], "tpf": t.values[1], "n": 10}) for t in study.trials]
    tracker.log_pareto(parent, summarize_points("s", {"accuracy": "maximize", "tpf": "maximize"}, points), study)
    page = Path(MlflowClient(uri).download_artifacts(parent, "pareto.html", str(tmp_path))).read_text()
    page = page.replace("\\u002f", "/")  # plotly writes "/" escaped in its JSON
    for i in range(2):  # a local store: the link resolves inside the MLflow UI that serves the page
        assert f'"/#/experiments/{tracker.experiment_id}/runs/run{i}?workflowType=machine_learning"' in page


def test_a_trial_whose_page_cannot_be_made_keeps_its_run(tmp_path, monkeypatch):
    import dlm_toolkit.viewer as viewer
    from mlflow import MlflowClient

    from dlm_toolkit.sweep.tracking import Tracker, TrialRun
    from dlm_toolkit.tasks import get_task
    from sweep_helpers import tracking_uri

    model, tok, _, _ = load_testbed()
    monkeypatch.setattr(viewer, "MAX_CELLS", 10)  # no page fits, whatever the stride
    uri = tracking_uri(tmp_path)
    tracker = Tracker(uri, "viewer")
    run = tracker.client.create_run(tracker.experiment_id)
    assert TrialRun(tracker, run.info.run_id).log_trajectories(model, tok, get_task("pick"), DecodingPolicy("llada2.1-s").config, 0) is None
    client = MlflowClient(uri)
    assert "trajectory.html" not in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert client.get_run(run.info.run_id).data.tags["trajectory_html_error"].startswith("ViewerError: the trajectory is too large")
