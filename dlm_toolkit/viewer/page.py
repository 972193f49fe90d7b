"""The self-contained HTML page of the viewer: one template, inline CSS and JS, data as JSON.

The data goes into ``<script type="application/json">`` through :func:`script_json`, which escapes
``<``, ``>`` and ``&`` (so no token text can close the script element or open a comment) and the
two line separators JavaScript once refused. The script reads it with ``JSON.parse`` and puts
every token's text into the page with ``textContent`` only: text never becomes markup. A lone
surrogate (a tokenizer's half of a pair, an undecodable byte of a command line) becomes U+FFFD: the
page is always valid UTF-8.
"""

from __future__ import annotations

import html
import json
import re
from typing import Any

_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"})
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_TITLE_CHARS = 300


def script_json(data: Any) -> str:
    """``data`` as JSON that is inert inside a ``<script type="application/json">`` element."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False).translate(_ESCAPES)


def valid_utf8(text: str) -> str:
    """``text`` with each lone surrogate (which UTF-8 cannot encode) replaced by U+FFFD."""
    return _LONE_SURROGATE.sub("\ufffd", text)


def cut_text(text: str, most: int) -> str:
    """``text`` up to ``most`` characters; a cut text says how much it lost."""
    return text if len(text) <= most else f"{text[:most]}\u2026[+{len(text) - most:,} chars]"


CSS = """
body{font-family:system-ui,sans-serif;margin:12px;color:#222;background:#fff}
h1{font-size:16px;margin:0 0 8px}
.controls{display:flex;gap:8px;align-items:center;flex-wrap:wrap;margin-bottom:6px}
.controls input[type=range]{width:320px}
.status{font-family:monospace;font-size:12px;margin:4px 0}
.legend span{display:inline-block;padding:1px 6px;margin-right:4px;border-radius:3px;font-size:12px}
.panes{display:flex;gap:16px;align-items:flex-start}
.pane{flex:1;min-width:0}
.pane h2{font-size:13px;margin:6px 0}
.canvas{font-family:monospace;font-size:12px;line-height:1.9}
.blk{display:flex;flex-wrap:wrap;border-top:1px dashed #bbb;padding:2px 0;position:relative}
.blk.active{background:#fffbe6}
.blk .bl{color:#999;font-size:10px;width:44px;flex:none}
.tok{display:inline-block;min-width:10px;padding:0 2px;margin:1px;border-radius:3px;white-space:pre;
 border:1px solid transparent;cursor:default}
.tok.win{border-bottom:2px solid #6a5acd}
.tok.diff{outline:2px solid #d00;outline-offset:0}
.k-prompt{background:#e6e6e6;color:#555}
.k-masked{background:#fafafa;color:#bbb}
.k-commit{background:rgba(46,125,50,var(--a))}
.k-edit{background:rgba(239,108,0,var(--a))}
.k-remask{background:rgba(198,40,40,var(--a));color:#fff}
.k-insert{background:rgba(0,151,167,var(--a))}
.k-delete{background:rgba(123,31,162,var(--a));color:#fff}
.strip{display:flex;align-items:flex-end;height:48px;gap:1px;margin:6px 0;border-bottom:1px solid #ccc;overflow-x:auto}
.strip div{width:6px;flex:none;background:#2e7d32;position:relative;cursor:pointer;min-height:1px}
.strip div.post{background:#9e9e9e}
.strip div.cur{outline:2px solid #000}
.strip div i{position:absolute;left:0;right:0;bottom:0;background:#ef6c00}
#tip{position:fixed;display:none;background:#222;color:#fff;font:12px monospace;padding:4px 6px;border-radius:3px;
 pointer-events:none;z-index:9;white-space:pre}
.tok.run{font-style:italic}
#marks span{padding:3px 6px 1px;margin-right:4px;font-size:12px}
.final{font-family:monospace;font-size:12px;white-space:pre-wrap;background:#f5f5f5;padding:4px;margin-top:6px}
"""

JS = r"""
(function(){
"use strict";
const D = JSON.parse(document.getElementById("dlm-data").textContent);
const KINDS = D.kinds;
const $ = (id) => document.getElementById(id);
const slider = $("frame"), rowSel = $("row"), tip = $("tip");
let timer = null;

function text(tok){ return Object.prototype.hasOwnProperty.call(D.vocab, tok) ? D.vocab[tok] : String(tok); }
function rowsOf(pane, r){ return D.panes[pane].rows[r]; }
function framesMax(){ let m = 0; for (const p of D.panes) m = Math.max(m, p.rows[+rowSel.value].frames.length); return m; }

// cells after frame k (0: before the first forward): [token, kind, conf, runner-up, runner-up conf]
function cellsAt(row, k){
  const cells = row.init.map((t, i) => [t, i < row.prompt_len ? 0 : 1, -1, -1, -1]);
  const n = Math.min(k, row.frames.length);
  for (let f = 0; f < n; f++) for (const c of row.frames[f].ch) cells[c[0]] = c.slice(1);
  return cells;
}

// hook marks (StepRecord.marks): one colour per output name, a bar along the top of the token
const MARK_COLORS = ["#e91e63", "#3f51b5", "#00897b", "#f9a825", "#6d4c41", "#8e24aa"];
const MARKS = [...new Set(D.panes.flatMap((p) => p.rows.flatMap((r) => r.frames.flatMap((f) => Object.keys(f.mk)))))].sort();
function markColor(name){ return MARK_COLORS[MARKS.indexOf(name) % MARK_COLORS.length]; }

// what a chip shows of position i: consecutive EOS after the canvas's last other token (masks
// aside) that look the same (kind, window, differs, marks) on one line draw as one chip "EOS ×n"
function look(i, c, frame, other, marksAt){
  return {kind: KINDS[c[1]], win: !!(frame && i >= frame.win[0] && i < frame.win[1]),
          diff: other !== null && (other[i] === undefined || other[i][0] !== c[0]), marks: (marksAt[i] || []).join(",")};
}
function same(a, b){ return a.kind === b.kind && a.win === b.win && a.diff === b.diff && a.marks === b.marks; }

function render(){
  const r = +rowSel.value, k = +slider.value;
  const states = D.panes.map((p) => cellsAt(p.rows[r], k));
  D.panes.forEach((p, pi) => {
    const row = p.rows[r], cells = states[pi], other = D.panes.length === 2 ? states[1 - pi] : null;
    const fr = Math.min(k, row.frames.length), frame = fr > 0 ? row.frames[fr - 1] : null;
    const box = $("canvas-" + pi);
    box.textContent = "";
    const bounds = new Set(row.bounds), marksAt = {};
    if (frame) for (const name of Object.keys(frame.mk)) for (const q of frame.mk[name]) (marksAt[q] = marksAt[q] || []).push(name);
    let tail = cells.length;  // past the last token that is neither EOS nor a mask: the trailing EOS
    while (tail > row.prompt_len && (cells[tail - 1][0] === D.eos || cells[tail - 1][0] === D.mask)) tail--;
    let line = null;
    for (let i = 0; i < cells.length;){
      if (line === null || bounds.has(i)){
        line = document.createElement("div"); line.className = "blk";
        const lab = document.createElement("span"); lab.className = "bl"; lab.textContent = String(i);
        line.appendChild(lab); box.appendChild(line);
      }
      const c = cells[i], s = document.createElement("span"), l = look(i, c, frame, other, marksAt);
      let n = 1;
      if (i >= tail && c[0] === D.eos)
        while (i + n < cells.length && !bounds.has(i + n) && cells[i + n][0] === D.eos &&
               same(l, look(i + n, cells[i + n], frame, other, marksAt))) n++;
      s.className = "tok k-" + l.kind;
      if (frame && i + n > frame.blk[0] && i < frame.blk[1]) line.classList.add("active");
      if (l.win) s.classList.add("win");
      if (l.diff){ s.classList.add("diff"); s.dataset.diff = "1"; }
      if (l.marks){
        s.dataset.marks = l.marks;
        s.style.boxShadow = l.marks.split(",").map((m, j) => "inset 0 " + 3 * (j + 1) + "px 0 " + markColor(m)).join(",");
      }
      s.style.setProperty("--a", c[2] >= 0 ? (0.25 + 0.75 * c[2]).toFixed(3) : "0.6");
      s.dataset.pos = i; s.dataset.token = c[0]; s.dataset.kind = l.kind;
      s.dataset.conf = c[2]; s.dataset.ru = c[3]; s.dataset.rup = c[4];
      s.textContent = c[0] === D.mask ? "\u00b7" : text(c[0]);
      if (n > 1){ s.dataset.count = n; s.classList.add("run"); s.textContent = "EOS \u00d7" + n; }  // short: a grid line holds it
      line.appendChild(s);
      i += n;
    }
    const st = $("status-" + pi);
    const marked = frame ? Object.keys(frame.mk).map((m) => m + " " + frame.mk[m].length).join(", ") : "";
    st.textContent = frame === null ? "before the first forward" :
      ("forward " + frame.f + " of " + row.nfe + " (NFE " + frame.f + ")  wrote " + frame.n[0] + "  edits " + frame.n[1] +
       "  remasks " + frame.n[2] + (frame.n[3] + frame.n[4] ? "  inserts " + frame.n[3] + "  deletes " + frame.n[4] : "") +
       (frame.post ? "  [post step]" : "") + (frame.ver ? "  [verified]" : "") +
       "  block [" + frame.blk[0] + "," + frame.blk[1] + ")  window [" + frame.win[0] + "," + frame.win[1] + ")" +
       (marked ? "  marks: " + marked : ""));
    const strip = $("strip-" + pi);
    for (let f = 0; f < strip.children.length; f++) strip.children[f].classList.toggle("cur", f === fr - 1);
  });
  $("fno").textContent = k + " / " + slider.max;
}

function buildStrips(){
  const r = +rowSel.value;
  D.panes.forEach((p, pi) => {
    const row = p.rows[r], strip = $("strip-" + pi);
    strip.textContent = "";
    const most = Math.max(1, ...row.frames.map((f) => f.n[0] + f.n[1] + f.n[2]));
    row.frames.forEach((f, i) => {
      const bar = document.createElement("div");
      const total = f.n[0] + f.n[1] + f.n[2];
      bar.style.height = (4 + 40 * total / most) + "px";
      if (f.post) bar.classList.add("post");
      const e = document.createElement("i"); e.style.height = (100 * (f.n[1] + f.n[2]) / Math.max(total, 1)) + "%";
      bar.appendChild(e);
      bar.title = "forward " + f.f + ": wrote " + f.n[0] + ", edits " + f.n[1] + ", remasks " + f.n[2];
      bar.addEventListener("click", () => { slider.value = i + 1; render(); });
      strip.appendChild(bar);
    });
    $("final-" + pi).textContent = row.final;
  });
  slider.max = framesMax();
  if (+slider.value > +slider.max) slider.value = slider.max;
}

function step(d){ slider.value = Math.max(0, Math.min(+slider.max, +slider.value + d)); render(); }
function play(){
  if (timer !== null){ clearInterval(timer); timer = null; $("play").textContent = "play"; return; }
  if (+slider.value >= +slider.max) slider.value = 0;
  $("play").textContent = "pause";
  timer = setInterval(() => { if (+slider.value >= +slider.max){ play(); } else step(1); }, 350);
}

D.panes[0].rows.forEach((row, i) => {
  const o = document.createElement("option"); o.value = i; o.textContent = row.label; rowSel.appendChild(o);
});
rowSel.addEventListener("change", () => { buildStrips(); render(); });
slider.addEventListener("input", render);
$("prev").addEventListener("click", () => step(-1));
$("next").addEventListener("click", () => step(1));
$("first").addEventListener("click", () => { slider.value = 0; render(); });
$("last").addEventListener("click", () => { slider.value = slider.max; render(); });
$("play").addEventListener("click", play);
// the page's keys win wherever the focus is (captured before the row selector or the slider sees them)
const KEYS = {ArrowRight: () => step(1), ArrowLeft: () => step(-1), Home: () => { slider.value = 0; render(); },
              End: () => { slider.value = slider.max; render(); }};
document.addEventListener("keydown", (e) => {
  const act = e.altKey || e.ctrlKey || e.metaKey ? undefined : KEYS[e.key];
  if (act === undefined) return;
  e.preventDefault(); e.stopPropagation(); act();
}, true);
document.addEventListener("mouseover", (e) => {
  const s = e.target.closest ? e.target.closest(".tok") : null;
  if (!s){ tip.style.display = "none"; return; }
  const conf = +s.dataset.conf, ru = +s.dataset.ru;
  const n = +(s.dataset.count || 1), pos = n > 1 ? "positions " + s.dataset.pos + "-" + (+s.dataset.pos + n - 1) +
        " (the trailing run of EOS, " + n + " tokens)" : "position " + s.dataset.pos;
  let t = pos + "  " + s.dataset.kind + "\ntoken " + JSON.stringify(text(+s.dataset.token)) + " (id " + s.dataset.token + ")";
  if (s.dataset.marks) t += "\nmarks " + s.dataset.marks.split(",").join(", ");
  if (conf >= 0) t += "\nconfidence " + conf.toFixed(4);
  if (ru >= 0) t += "\nrunner-up " + JSON.stringify(text(ru)) + " (id " + ru + ") p " + (+s.dataset.rup).toFixed(4);
  tip.textContent = t; tip.style.display = "block";
  const r = s.getBoundingClientRect(); tip.style.left = (r.left) + "px"; tip.style.top = (r.bottom + 4) + "px";
});
for (const m of MARKS){
  const e = document.createElement("span"); e.textContent = m; e.style.boxShadow = "inset 0 3px 0 " + markColor(m);
  $("marks").appendChild(e);
}
buildStrips();
slider.value = 0;
render();
})();
"""


def render(title: str, data: dict[str, Any], blob: str | None = None) -> str:
    """The page: ``data`` holds ``panes`` (one, or two side by side), ``vocab``, ``kinds``, ``mask``
    and ``eos``; ``blob``: ``data`` as :func:`script_json` already made it."""
    title = html.escape(cut_text(title, MAX_TITLE_CHARS))
    legend = "".join(f'<span class="tok k-{k}" style="--a:0.8">{k}</span>' for k in data["kinds"])
    panes = "".join(
        f'<div class="pane"><h2>{html.escape(p["title"])}</h2><div class="status" id="status-{i}"></div>'
        f'<div class="strip" id="strip-{i}" title="per forward: tokens written (green), edits and remasks '
        f'(orange), post steps grey"></div><div class="canvas" id="canvas-{i}"></div>'
        f'<div class="final" id="final-{i}"></div></div>'
        for i, p in enumerate(data["panes"]))
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<title>{title}</title><style>{CSS}</style></head><body>
<h1>{title}</h1>
<div class="controls"><label>row <select id="row"></select></label>
<button id="first">|&lt;</button><button id="prev">&lt;</button><button id="play">play</button>
<button id="next">&gt;</button><button id="last">&gt;|</button>
<input type="range" id="frame" min="0" max="0" value="0" step="1"> <span id="fno"></span>
<span class="status">keys: &larr; &rarr; Home End</span></div>
<div class="legend">{legend} <span>shade: confidence</span>
<span style="border-bottom:2px solid #6a5acd">window</span>
<span style="outline:2px solid #d00">differs</span> <span class="tok run">EOS \u00d7n: the trailing EOS</span>
<span id="marks"></span></div>
<div class="panes">{panes}</div><div id="tip"></div>
<script type="application/json" id="dlm-data">{script_json(data) if blob is None else blob}</script>
<script>{JS}</script>
</body></html>
"""
    return valid_utf8(page)
