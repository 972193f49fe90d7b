"""The trajectory viewer without a browser: replay, kinds, escaping, bounds and where pages are written
(tests/test_viewer_browser.py opens the pages)."""

from __future__ import annotations

import html
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


def test_jupyter_repr_comes_from_the_renderer_the_package_registered(monkeypatch):
    """The step never imports the viewer: ``import dlm_toolkit`` registers it; with no renderer
    registered Jupyter gets ``None`` (and shows ``repr``); the last one registered wins."""
    from dlm_toolkit.step import trajectory as traj
    from dlm_toolkit.viewer import view

    trajectory = recorded().trajectory
    assert trajectory._repr_html_() == view(trajectory)._repr_html_()
    monkeypatch.setattr(traj, "_html_renderer", [])
    assert trajectory._repr_html_() is None
    traj.register_html_renderer(lambda t: f"<p>{len(t.steps)}</p>")
    traj.register_html_renderer(lambda t: f"<b>{len(t.steps)}</b>")
    assert trajectory._repr_html_() == f"<b>{len(trajectory.steps)}</b>"


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
    # the title says which decode: policy (default preset), the prompt's start, the checkpoint
    assert "<title>dlm decode: llada2.1-q \u00b7 &#x27;pick:&lt;script&gt;x&lt;/script&gt;|&#x27; \u00b7 " \
           "testbed-v2-editable</title>" in page
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
    rows = [r["label"] for r in data["panes"][0]["rows"]]
    assert sorted(rows) == ["instance 0", "instance 1"]
    said = capsys.readouterr().out.splitlines()[-1]
    assert said.startswith(f"  side by side: {out} (rows: instances {rows[0][9:]}, {rows[1][9:]}, where A and B "
                           "disagree first; ")
    assert said.endswith(" of 2 instances give the same completion under A and B)")
    title = re.search(r"<title>(.*?)</title>", out.read_text()).group(1)
    shown = said.split(" (", 1)[1]
    assert title == f"dlm compare pick: A llada2.1-q vs B llada2.1-s \u00b7 testbed-v2-editable ({shown}"


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
    policy = DecodingPolicy("llada2.1-s").config
    assert trial.log_trajectories(model, tok, get_task("pick"), policy, 0, label="trial 3, m2t.params.threshold=0.83",
                                  checkpoint="checkpoints/testbed-editable") == "trajectory.html"
    client = MlflowClient(uri)
    assert "trajectory.html" in [a.path for a in client.list_artifacts(run.info.run_id)]
    page = (Path(client.download_artifacts(run.info.run_id, "trajectory.html", str(tmp_path))).read_text())
    assert "<title>pick: trial 3, m2t.params.threshold=0.83 \u00b7 testbed-editable</title>" in page
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


# -- issue 42.8, 43, 45.4: bounds, hostile text, window ends, marks, titles, order -------------------
def _data(page: str) -> dict:
    return json.loads(re.search(r'id="dlm-data">(.*?)</script>', page).group(1))


def test_frame_window_ends_after_its_last_position():
    """The hand-written records' windows are [4, 8), [4, 8), [6, 12) on a 12-position canvas: the
    end is one past the window's last position, and position 8 (next block) is outside the first."""
    from dlm_toolkit.viewer import trajectory_page
    from dlm_toolkit.viewer.replay import row_frames
    from viewer_helpers import synthetic

    traj = synthetic()
    _, frames = row_frames(traj, 0)
    assert [(f.window, f.block) for f in frames] == [((4, 8), (4, 8)), ((4, 8), (4, 8)), ((6, 12), (8, 12))]
    _, thinned = row_frames(traj, 0, every=2)  # a thinned frame has its last forward's window
    assert [f.window for f in thinned] == [(4, 8), (6, 12)]
    rows = _data(trajectory_page(traj))["panes"][0]["rows"]
    assert [f["win"] for f in rows[0]["frames"]] == [[4, 8], [4, 8], [6, 12]]


def test_hook_marks_reach_the_page_per_frame():
    from dlm_toolkit.viewer import trajectory_page
    from viewer_helpers import synthetic

    rows = _data(trajectory_page(synthetic()))["panes"][0]["rows"]
    assert [f["mk"] for f in rows[0]["frames"]] == [{"flagged": [4]}, {"flagged": [6], "held": [6, 7]}, {}]
    assert [f["mk"] for f in rows[1]["frames"]] == [{"flagged": [4]}, {"flagged": [4]}, {}]


def test_page_title_is_text_and_bounded():
    from dlm_toolkit.viewer import trajectory_page
    from dlm_toolkit.viewer.page import MAX_TITLE_CHARS
    from viewer_helpers import synthetic

    hostile = '</title><script>alert(1)</script><h1 onclick="x">'
    page = trajectory_page(synthetic(), title=hostile)
    assert page.count("<script") == 2 and "onclick=\"x\"" not in page
    assert page.count(html.escape(hostile)) == 2  # the tab's title and the heading
    exact = "t" * MAX_TITLE_CHARS
    assert f"<title>{exact}</title>" in trajectory_page(synthetic(), title=exact)
    cut = trajectory_page(synthetic(), title=exact + "u")
    assert f"<title>{exact}\u2026[+1 chars]</title>" in cut


class HugeTokenizer:
    """Every token's text is ``size`` characters; remembers the longest text it returned."""

    def __init__(self, size):
        self.size, self.longest = size, 0

    def decode(self, ids, skip_special_tokens=False):
        text = "".join(chr(0x61 + i % 26) * self.size for i in ids)
        self.longest = max(self.longest, len(text))
        return text


def test_token_texts_and_final_texts_are_bounded():
    from dlm_toolkit.viewer import MAX_FINAL_CHARS, MAX_TOKEN_CHARS, trajectory_page
    from viewer_helpers import TextTokenizer, synthetic

    vocab = _data(trajectory_page(synthetic(), TextTokenizer({11: "x" * MAX_TOKEN_CHARS,
                                                              12: "y" * (MAX_TOKEN_CHARS + 1)})))["vocab"]
    assert vocab["11"] == "x" * MAX_TOKEN_CHARS  # at the bound: whole
    assert vocab["12"] == "y" * MAX_TOKEN_CHARS + "\u2026[+1 chars]"
    tok = HugeTokenizer(1_000_000)  # a 50 MB token made a 9.8 GB page; 1 MB shows the same
    res = recorded()
    page = trajectory_page(res, tok)
    assert tok.longest == 1_000_000  # one token at a time: the row was never decoded whole
    assert len(page) < 200_000
    finals = [r["final"].split("\n", 1)[1] for r in _data(page)["panes"][0]["rows"]]
    assert all(len(f) <= MAX_FINAL_CHARS + 20 for f in finals) and all(f.endswith(" chars]") for f in finals)
    small = HugeTokenizer(1)  # near miss: short texts are decoded whole, as the tokenizer joins them
    finals = [r["final"].split("\n", 1)[1] for r in _data(trajectory_page(res, small))["panes"][0]["rows"]]
    assert finals == [small.decode(r.tokens) for r in res.rows]


def test_data_bound_says_what_to_do(monkeypatch):
    import dlm_toolkit.viewer as viewer
    from viewer_helpers import synthetic

    size = len(re.search(r'id="dlm-data">(.*?)</script>', viewer.trajectory_page(synthetic())).group(1))
    monkeypatch.setattr(viewer, "MAX_DATA_CHARS", size)
    viewer.trajectory_page(synthetic())  # exactly at the bound
    monkeypatch.setattr(viewer, "MAX_DATA_CHARS", size - 1)
    with pytest.raises(viewer.ViewerError, match=rf"^the trajectory is too large to embed: {size:,} characters of data "
                                                 rf"\(limit {size - 1:,}\) at every=1: keep every K-th forward "
                                                 r"\(every=K, --every K\) or fewer batch rows \(rows=\[...\]\)$"):
        viewer.trajectory_page(synthetic())


def test_lone_surrogates_become_replacement_characters(tmp_path):
    from dlm_toolkit.viewer import trajectory_page, write_page
    from viewer_helpers import TextTokenizer, synthetic

    page = trajectory_page(synthetic(), TextTokenizer({11: "a\ud800b"}), title="t\udfff")
    write_page(tmp_path / "p.html", page)  # encodes as UTF-8
    assert _data(page)["vocab"]["11"] == "a\ufffdb" and "<title>t\ufffd</title>" in page


def test_disagreeing_instances_come_first():
    from dlm_toolkit.commands.compare import disagreement_order

    a = [{"score": 1.0, "completion": "5"}, {"score": 1.0, "completion": "5"}, {"score": 0.0, "completion": "7"},
         {"score": 0.0, "completion": "8"}, {"score": 0.5, "completion": "x"}]
    b = [{"score": 1.0, "completion": "5"}, {"score": 0.0, "completion": "6"}, {"score": 0.0, "completion": "9"},
         {"score": 0.0, "completion": "8"}, {"score": 0.49, "completion": "x"}]
    # 1 and 4 scored differently (0.5 is right, 0.49 wrong), 2 other completions, 0 and 3 agree
    assert disagreement_order(a, b) == ([1, 4, 2, 0, 3], 2)


def test_plottable_points_and_their_boundaries():
    from dlm_toolkit.sweep.pareto import TrialPoint
    from dlm_toolkit.viewer.front import plottable

    nan, inf = float("nan"), float("inf")
    rows = [({"accuracy": 1.0, "tpf": 2.0, "n": 10}, True), ({"accuracy": 1.0000001, "tpf": 2.0}, False),
            ({"accuracy": 0.0, "tpf": 0.0, "n": 0}, True), ({"accuracy": -1e-9, "tpf": 1.0}, False),
            ({"accuracy": nan, "tpf": 1.0}, False), ({"accuracy": 0.5, "tpf": inf}, False),
            ({"accuracy": 0.5, "tpf": 1.0, "n": -1}, False), ({"accuracy": 0.5, "tpf": 1.0, "n": 2.5}, False),
            ({"accuracy": 0.5, "tpf": 1.0, "n": nan}, False), ({"accuracy": "x", "tpf": 1.0}, False),
            ({"accuracy": 0.5, "tpf": 1.0, "n": 4.0}, True)]
    points = [TrialPoint(i, m) for i, (m, _) in enumerate(rows)] + [TrialPoint(99, {"tpf": 1.0})]
    good, bad = plottable(points)
    assert [p.trial for p in good] == [i for i, (_, ok) in enumerate(rows) if ok]
    assert bad == [i for i, (_, ok) in enumerate(rows) if not ok]  # 99 (no accuracy) is neither


def test_front_page_with_damaged_metrics_is_small_and_says_what_it_left_out(tmp_path):
    from dlm_toolkit.sweep.pareto import TrialPoint, summarize_points, write_all

    xy = [(0.9, 2.0), (float("nan"), 2.0), (0.5, float("inf")), (0.8, 3.0)]
    points = [TrialPoint(i, {"accuracy": a, "tpf": t, "n": 20}, preset="llada2.1-s" if i == 1 else None)
              for i, (a, t) in enumerate(xy)]
    summary = summarize_points("s", {"accuracy": "maximize", "tpf": "maximize"}, points, {"complete": 4})
    files = write_all(summary, tmp_path)
    page = files["html"].read_text()
    assert "left out, metrics not finite or out of range: trials 1, 2</p>" in page
    assert sorted(re.findall(r'data-trial="(\d+)"', page)) == ["0", "3"]
    assert files["png"].stat().st_size > 0
    assert len(page.encode()) < 50_000 and "<script src" not in page  # was 4.8 MB of inline plotly


def test_preset_labels_cover_no_label_and_no_marker():
    from dlm_toolkit.viewer.front import place

    markers = [(400.0, 300.0, 11.0), (404.0, 302.0, 11.0), (380.0, 290.0, 7.0)]
    anchors = [(400.0, 300.0, "llada2.1-s"), (404.0, 302.0, "llada2.1-q"), (404.0, 302.0, "a-long-policy-file-name")]
    boxes = place(anchors, markers, (0, 0, 900, 600))
    blocked = [(x - r, y - r, x + r, y + r) for x, y, r in markers]
    for i, a in enumerate(boxes):
        assert 0 <= a[0] and a[2] <= 900 and 0 <= a[1] and a[3] <= 600
        for b in boxes[:i] + blocked:
            assert min(a[2], b[2]) <= max(a[0], b[0]) or min(a[3], b[3]) <= max(a[1], b[1]), (a, b)
