"""The viewer pages in a real headless browser (Debian's chromium + chromium-driver, driven by
Selenium through the system chromedriver: nothing is downloaded; scripts/install-test-deps.sh
installs them). One browser for the module.

Each page must load with no console message of level SEVERE and no request but the page itself;
the canvas shown after stepping to forward k is the one the records replay to (every k, both
batch rows); hover shows the confidence; side-by-side pages outline exactly the differing
positions; markup in token texts stays text; the front explorer's points are pareto.json's. The
README's screenshots (docs/viewer_*.png) are written here, through a temporary name.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from viewer_helpers import REPO, load_testbed, recorded, replay, synthetic

CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not (os.path.exists(CHROMEDRIVER) and os.path.exists(CHROMIUM)):
    pytest.skip("chromium and chromium-driver are not installed (scripts/install-test-deps.sh installs them)",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (the test extra) is not installed")


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,900",
                "--no-first-run", "--disable-background-networking", "--disable-component-update"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


def open_page(browser, path: Path) -> None:
    """Load ``path`` and check: no SEVERE console message, no request other than the page itself."""
    browser.get_log("browser"), browser.get_log("performance")  # drop what an earlier page left
    browser.get(path.as_uri())
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []
    events = [json.loads(e["message"])["message"] for e in browser.get_log("performance")]
    urls = [m["params"]["request"]["url"] for m in events if m["method"] == "Network.requestWillBeSent"]
    assert urls == [path.as_uri()]


def canvas(browser, pane: int = 0) -> list[int]:
    """The tokens shown, a chip of a run (``EOS ×n``) counted n times."""
    return browser.execute_script(f"return [...document.querySelectorAll('#canvas-{pane} .tok')]"
                                  ".flatMap(s => Array(+(s.dataset.count || 1)).fill(+s.dataset.token))")


def positions(browser, selector: str) -> list[int]:
    """The canvas positions of the chips that ``selector`` finds, each position of a run's chip."""
    return browser.execute_script(f"return [...document.querySelectorAll('{selector}')].flatMap(s => "
                                  "Array.from({length: +(s.dataset.count || 1)}, (_, j) => +s.dataset.pos + j))")


def press(browser, key: str) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(browser).send_keys(key).perform()


def select_row(browser, row: int) -> None:
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element("id", "row")).select_by_value(str(row))


def screenshot(browser, name: str) -> None:
    """docs/NAME, replaced whole (temp name + rename)."""
    from dlm_toolkit.util.files import atomic_write

    atomic_write(REPO / "docs" / name, lambda tmp: Path(tmp).write_bytes(browser.get_screenshot_as_png()))


@pytest.fixture(scope="module")
def trajectory_file(tmp_path_factory):
    from dlm_toolkit.viewer import trajectory_page

    _, tok, _, _ = load_testbed()
    path = tmp_path_factory.mktemp("pages") / "trajectory.html"
    path.write_text(trajectory_page(recorded(), tok, title="pick: WINO + threshold edits, multi-block editing"))
    return path


def test_stepping_shows_the_canvas_after_every_forward(browser, trajectory_file):
    from selenium.webdriver.common.keys import Keys

    res = recorded()
    open_page(browser, trajectory_file)
    for row in range(len(res.rows)):
        select_row(browser, row)
        ref = replay(res.trajectory, row)
        browser.find_element("id", "first").click()
        assert canvas(browser) == ref[0]
        for k in range(1, len(ref)):
            press(browser, Keys.ARROW_RIGHT)
            assert canvas(browser) == ref[k], f"row {row}, after forward {k}"
        press(browser, Keys.ARROW_RIGHT)  # past the end: stays on the last forward
        assert canvas(browser) == ref[-1]
        browser.find_element("id", "prev").click()
        assert canvas(browser) == ref[-2]
        strip = browser.find_elements("css selector", "#strip-0 > div")
        assert len(strip) == len(ref) - 1
        posts = browser.execute_script("return [...document.querySelectorAll('#strip-0 > div')].map(d => d.classList.contains('post'))")
        assert posts == [s.post for s in res.trajectory.for_row(row)] and any(posts)  # post steps marked
        lines = browser.execute_script("return [...document.querySelectorAll('#canvas-0 .blk')].map(b => "
                                       "[+b.querySelector('.tok').dataset.pos, b.classList.contains('active')])")
        last = res.trajectory.for_row(row)[-2]
        assert lines == [[p, p == last.block_lo] for p in range(0, len(ref[0]), 16)]  # one line per block of 16
        strip[2].click()  # a bar of the per-forward strip jumps to its forward
        assert canvas(browser) == ref[3]


def test_hover_shows_confidence_and_runner_up(browser, trajectory_file):
    from selenium.webdriver.common.action_chains import ActionChains

    res = recorded()
    s = res.trajectory.for_row(0)[0]
    p = s.commit[0]
    i = s.positions.index(p)
    open_page(browser, trajectory_file)
    browser.find_element("id", "next").click()
    tok = browser.find_element("css selector", f'#canvas-0 .tok[data-pos="{p}"]')
    assert tok.get_attribute("data-kind") == "commit"
    ActionChains(browser).move_to_element(tok).perform()
    tip = browser.find_element("id", "tip").text
    assert f"confidence {s.confidence[i]:.4f}" in tip
    assert f"(id {s.runner_up[i]}) p {s.runner_up_confidence[i]:.4f}" in tip
    assert positions(browser, "#canvas-0 .tok.win") == s.positions  # the forward's window is underlined
    # the screenshot: a forward whose edit reaches back into the previous block, that edit hovered
    k, back = next((k, e) for k, e in enumerate(res.trajectory.for_row(0)) if any(p < e.block_lo for p in e.edit))
    browser.find_elements("css selector", "#strip-0 > div")[k].click()
    edited = browser.find_element("css selector", f'#canvas-0 .tok[data-pos="{min(back.edit)}"]')
    assert edited.get_attribute("data-kind") == "edit"
    ActionChains(browser).move_to_element(edited).perform()
    screenshot(browser, "viewer_trajectory.png")


def test_side_by_side_outlines_exactly_the_differing_positions(browser, tmp_path):
    from selenium.webdriver.common.keys import Keys

    from dlm_toolkit.viewer import compare_page

    _, tok, _, _ = load_testbed()
    a, b = recorded(), recorded("llada2.1-s")
    path = tmp_path / "compare.html"
    path.write_text(compare_page(a, b, tok, labels=("A: WINO + edits + MBE", "B: llada2.1-s")))
    open_page(browser, path)
    ra, rb = replay(a.trajectory, 0), replay(b.trajectory, 0)
    differing_seen = 0
    for k in range(max(len(ra), len(rb))):
        ca, cb = ra[min(k, len(ra) - 1)], rb[min(k, len(rb) - 1)]
        want = [p for p in range(max(len(ca), len(cb))) if p >= len(ca) or p >= len(cb) or ca[p] != cb[p]]
        assert canvas(browser, 0) == ca and canvas(browser, 1) == cb
        for pane, c in ((0, ca), (1, cb)):
            got = positions(browser, f"#canvas-{pane} .tok.diff")
            assert got == [p for p in want if p < len(c)], f"pane {pane}, frame {k}"
        differing_seen += bool(want)
        if k == 3:
            screenshot(browser, "viewer_compare.png")
        press(browser, Keys.ARROW_RIGHT)
    assert differing_seen > 0
    finals = [browser.find_element("id", f"final-{i}").text for i in (0, 1)]
    assert finals[1].startswith(f"NFE {b.rows[0].nfe}  TPF {b.rows[0].tpf:.2f}")


def test_markup_in_token_texts_renders_as_text(browser, tmp_path):
    from dlm_toolkit.viewer import trajectory_page
    from test_viewer import HostileTokenizer

    _, tok, _, _ = load_testbed()
    path = tmp_path / "hostile.html"
    path.write_text(trajectory_page(recorded(), HostileTokenizer(tok)))
    open_page(browser, path)  # an executed <img src=x> would have made a request
    assert browser.execute_script("return window.__pwned === undefined")
    assert browser.find_elements("css selector", "#canvas-0 img, #canvas-0 script") == []
    texts = browser.execute_script("return [...document.querySelectorAll('#canvas-0 .tok')].map(s => s.textContent)")
    for text in HostileTokenizer.TEXTS.values():
        assert any(t.startswith(text) for t in texts)


def test_front_explorer_points_are_pareto_json(browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains

    from dlm_toolkit.sweep.pareto import TrialPoint, summarize_points, write_all

    xy = [(0.9, 2.0), (0.95, 1.5), (0.8, 3.0), (0.7, 2.5), (0.85, 2.2), (0.6, 1.2), (0.85, 2.1)]
    points = [TrialPoint(i, {"accuracy": a, "tpf": t, "n": 20}, {"m2t.params.threshold": round(0.1 * i, 2)},
                         preset={0: "llada2.1-s", 5: "llada2.1-q"}.get(i)) for i, (a, t) in enumerate(xy)]
    summary = summarize_points("demo", {"accuracy": "maximize", "tpf": "maximize"}, points, {"complete": len(xy)})
    files = write_all(summary, tmp_path, {3: "http://mlflow.example/#/experiments/1/runs/abc"})
    saved = json.loads(files["json"].read_text())
    open_page(browser, files["html"])
    drawn = browser.execute_script("return [...document.querySelectorAll('.pt')].map(p => [p.dataset.trace, "
                                   "+p.dataset.trial, +p.dataset.tpf, +p.dataset.accuracy, p.getAttribute('fill')])")
    traces = {name: sorted(d[1:4] for d in drawn if d[0] == name) for name in ("front", "dominated", "presets")}
    assert traces["front"] == sorted([r["trial"], r["tpf"], r["accuracy"]] for r in saved["front"])
    assert traces["presets"] == sorted([v["trial"], v["metrics"]["tpf"], v["metrics"]["accuracy"]]
                                       for v in saved["presets"].values())
    on_front = {r["trial"] for r in saved["front"]}
    assert [t for t, _, _ in traces["dominated"]] == [i for i in range(len(xy)) if i not in on_front]
    assert {d[4] for d in drawn if d[0] == "dominated"} == {"#b0b0b0"} and 5 not in on_front  # greyed, a preset too
    dominated = {}  # trial -> the text hovering its point shows
    for el in browser.find_elements("css selector", '.pt[data-trace="dominated"]'):
        ActionChains(browser).move_to_element(el).perform()
        dominated[int(el.get_attribute("data-trial"))] = browser.find_element("id", "tip").text
    assert "accuracy 0.7000 [0.4810, 0.8545] (n=20)" in dominated[3] and "TPF 2.500" in dominated[3]  # Wilson 95 %, by hand
    assert "m2t.params.threshold = 0.3" in dominated[3]
    assert "http://mlflow.example/#/experiments/1/runs/abc" in dominated[3]
    screenshot(browser, "viewer_pareto.png")


def test_keys_win_over_the_row_selector_and_trailing_eos_and_marks_draw(browser, tmp_path):
    """On the hand-written trajectory (viewer_helpers.synthetic): Home/End/arrows step frames even
    while the row selector has focus (ArrowDown still moves the selector: the focus was there);
    the trailing EOS draw as one chip per line; hook marks are drawn per position."""
    from selenium.webdriver.common.keys import Keys

    from dlm_toolkit.viewer import trajectory_page

    traj = synthetic()
    path = tmp_path / "synthetic.html"
    path.write_text(trajectory_page(traj, title="hand-written <decode>"))
    open_page(browser, path)
    assert browser.find_element("tag name", "h1").text == "hand-written <decode>"
    frame = lambda: int(browser.find_element("id", "frame").get_attribute("value"))  # noqa: E731
    row = lambda: browser.find_element("id", "row").get_attribute("value")  # noqa: E731
    browser.execute_script("document.getElementById('row').focus()")
    press(browser, Keys.ARROW_DOWN)
    assert row() == "1" and browser.switch_to.active_element.get_attribute("id") == "row"
    for key, want in ((Keys.END, 3), (Keys.HOME, 0), (Keys.ARROW_RIGHT, 1), (Keys.ARROW_LEFT, 0), (Keys.END, 3)):
        press(browser, key)
        assert (frame(), row()) == (want, "1")
    ref = replay(traj, 1)
    assert canvas(browser) == ref[3]
    runs = browser.execute_script("return [...document.querySelectorAll('#canvas-0 .tok.run')].map(s => "
                                  "[+s.dataset.pos, +s.dataset.count, s.textContent])")
    assert runs == [[6, 2, "EOS \u00d72"], [8, 4, "EOS \u00d74"]]  # one chip per line of the run, though all look alike
    marks = "return Object.fromEntries([...document.querySelectorAll('#canvas-0 [data-marks]')].map(s => [s.dataset.pos, s.dataset.marks]))"
    assert browser.execute_script(marks) == {}
    press(browser, Keys.ARROW_LEFT)  # forward 2: EOS at 6, 7 with masks after them are trailing too
    assert canvas(browser) == ref[2] and browser.execute_script(marks) == {"4": "flagged"}
    assert positions(browser, "#canvas-0 .tok.run") == [6, 7]
    select_row(browser, 0)  # near miss: row 0 marks 6 and 7 differently, so they stay apart
    assert canvas(browser) == replay(traj, 0)[2] and browser.execute_script(marks) == {"6": "flagged,held", "7": "held"}
    assert positions(browser, "#canvas-0 .tok.run") == []
    assert "marks: flagged 1, held 2" in browser.find_element("id", "status-0").text
    press(browser, Keys.ARROW_LEFT)
    assert browser.execute_script(marks) == {"4": "flagged"}
    assert positions(browser, "#canvas-0 .tok.win") == [4, 5, 6, 7]  # the window ends before position 8
