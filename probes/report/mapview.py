"""One sentence's word maps as a self-contained HTML page: a layer x head grid of thumbnails per map kind and
a large view of the selected map, as lines between words (from on the left, to on the right) or as a matrix.

The page needs no network: its CSS and script are inline and the maps are embedded as JSON in a
``<script type="application/json">`` block (read with ``JSON.parse``, never run; every ``<`` escaped). The
selection is the page's address fragment, ``#kind=alti&layer=3&head=5&mode=lines`` (1-based layer and head, the
model's layer numbers), so a thumbnail is a link and a selection can be bookmarked; the page writes what it
draws into the DOM (``body`` attributes ``data-kind``, ``data-layer``, ``data-head``, ``data-mode``; every
drawn line or cell carries ``data-from``, ``data-to``, ``data-value``).
"""

from __future__ import annotations

import html
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from probes.io import atomic_write_text

# Lines fainter than this share of the map's largest absolute value are not drawn in the lines view.
LINE_MIN_SHARE = 0.01


@dataclass(frozen=True)
class KindMaps:
    """The maps of one kind for the page.

    Attributes:
        kind: The map kind's name.
        maps: ``(L', H, R, R)`` array, rows = from, columns = to.
        layers: The model layer (0-based) of each entry of the first axis.
    """

    kind: str
    maps: np.ndarray
    layers: Sequence[int]


def _numbers(a: np.ndarray) -> str:
    """A flat JSON array of ``a``'s values (7 significant digits; NaN and infinities as null)."""
    return "[" + ",".join(f"{v:.7g}" if math.isfinite(v) else "null" for v in a.reshape(-1).tolist()) + "]"


def _payload(labels: Sequence[str], kinds: Sequence[KindMaps], title: str) -> str:
    """The page's data as JSON text safe inside a ``<script>`` element."""
    R = len(labels)
    parts = []
    for k in kinds:
        m = np.asarray(k.maps, dtype=np.float64)  # (L', H, R, R)
        if m.ndim != 4 or m.shape[2:] != (R, R):
            raise ValueError(f"maps of kind {k.kind!r}: expected shape (layers, heads, {R}, {R}) for {R} labels, "
                             f"got {tuple(m.shape)}")
        if len(k.layers) != m.shape[0]:
            raise ValueError(f"maps of kind {k.kind!r}: {m.shape[0]} layers of maps but {len(k.layers)} layer "
                             f"numbers {list(k.layers)}")
        head = json.dumps({"kind": k.kind, "layers": [int(x) for x in k.layers], "heads": int(m.shape[1])})
        parts.append(head[:-1] + ',"values":' + _numbers(m) + "}")
    text = (f'{{"title":{json.dumps(title)},"labels":{json.dumps(list(labels))},'
            f'"minShare":{LINE_MIN_SHARE},"kinds":[{",".join(parts)}]}}')
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


CSS = """
body{font-family:system-ui,sans-serif;margin:1em;color:#222}
h1{font-size:18px;margin:0 0 .4em}
.bar{display:flex;gap:1.2em;align-items:center;font-size:14px;margin-bottom:.6em}
.main{display:flex;gap:2em;align-items:flex-start;flex-wrap:wrap}
table.grid{border-collapse:collapse;font-size:11px}
table.grid th{font-weight:normal;color:#555;padding:1px 3px}
a.thumb{display:block;border:2px solid transparent;line-height:0}
a.thumb.sel{border-color:#d33}
a.thumb canvas{width:44px;height:44px;image-rendering:pixelated;border:1px solid #ccc}
#big text{font-size:12px;fill:#222}
#big text.dim{fill:#bbb}
#big line.dim{stroke-opacity:0.03}
#selected{font-weight:bold}
.note{font-size:12px;color:#666;max-width:700px}
"""

SCRIPT = r"""
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("maps-data").textContent);
  const R = D.labels.length, MIN_SHARE = D.minShare;
  const SVG = "http://www.w3.org/2000/svg";
  const grid = document.getElementById("grid"), big = document.getElementById("big");
  const kindSel = document.getElementById("kind"), modeSel = document.getElementById("mode");
  D.kinds.forEach(function (k, i) {
    const o = document.createElement("option");
    o.value = k.kind; o.textContent = k.kind; kindSel.appendChild(o);
  });
  function map(k, li, h) {  // the (R, R) map of layer index li, head h, as rows of numbers (null: not finite)
    const off = (li * k.heads + h) * R * R, rows = [];
    for (let i = 0; i < R; i++) rows.push(k.values.slice(off + i * R, off + (i + 1) * R));
    return rows;
  }
  function scale(m) {
    let s = 0;
    m.forEach(function (r) { r.forEach(function (v) { if (v !== null) s = Math.max(s, Math.abs(v)); }); });
    return s > 0 ? s : 1;
  }
  function colour(v, s) {  // white -> blue for positive values, white -> red for negative ones
    if (v === null) return [200, 200, 200];
    const t = Math.min(1, Math.abs(v) / s);
    const c = v >= 0 ? [31, 78, 156] : [190, 30, 45];
    return c.map(function (x) { return Math.round(255 + (x - 255) * t); });
  }
  function rgb(c) { return "rgb(" + c.join(",") + ")"; }
  function el(name, attrs, parent) {
    const e = document.createElementNS(SVG, name);
    Object.keys(attrs).forEach(function (a) { e.setAttribute(a, attrs[a]); });
    if (parent) parent.appendChild(e);
    return e;
  }
  function state() {  // the selection from the address fragment, clamped to what exists
    const p = new URLSearchParams(location.hash.slice(1));
    let ki = D.kinds.findIndex(function (k) { return k.kind === p.get("kind"); });
    if (ki < 0) ki = 0;
    const k = D.kinds[ki];
    let li = k.layers.indexOf(parseInt(p.get("layer"), 10) - 1);
    if (li < 0) li = 0;
    let h = parseInt(p.get("head"), 10) - 1;
    if (!(h >= 0 && h < k.heads)) h = 0;
    const mode = p.get("mode") === "matrix" ? "matrix" : "lines";
    return {ki: ki, li: li, h: h, mode: mode};
  }
  function href(ki, li, h, mode) {
    const k = D.kinds[ki];
    return "#kind=" + encodeURIComponent(k.kind) + "&layer=" + (k.layers[li] + 1) + "&head=" + (h + 1) +
      "&mode=" + mode;
  }
  function drawGrid(s) {
    const k = D.kinds[s.ki];
    grid.textContent = "";
    const head = grid.insertRow();
    head.appendChild(document.createElement("th"));
    for (let h = 0; h < k.heads; h++) {
      const th = document.createElement("th");
      th.textContent = k.heads > 1 ? "head " + (h + 1) : "";
      head.appendChild(th);
    }
    k.layers.forEach(function (layer, li) {
      const row = grid.insertRow();
      const th = document.createElement("th");
      th.textContent = "layer " + (layer + 1);
      row.appendChild(th);
      for (let h = 0; h < k.heads; h++) {
        const td = row.insertCell(), a = document.createElement("a");
        a.className = "thumb" + (li === s.li && h === s.h ? " sel" : "");
        a.href = href(s.ki, li, h, s.mode);
        a.title = k.kind + " " + (k.heads > 1 ? (layer + 1) + "-" + (h + 1) : "layer " + (layer + 1));
        a.dataset.layer = layer + 1; a.dataset.head = h + 1;
        const c = document.createElement("canvas");
        c.width = R; c.height = R;
        const m = map(k, li, h), sc = scale(m), ctx = c.getContext("2d"), img = ctx.createImageData(R, R);
        for (let i = 0; i < R; i++) for (let j = 0; j < R; j++) {
          const col = colour(m[i][j], sc), o = 4 * (i * R + j);
          img.data[o] = col[0]; img.data[o + 1] = col[1]; img.data[o + 2] = col[2]; img.data[o + 3] = 255;
        }
        ctx.putImageData(img, 0, 0);
        a.appendChild(c); td.appendChild(a);
      }
    });
  }
  function drawLines(m, sc) {
    const step = 20, width = 460, top = 24, x0 = 150, x1 = width - 150;
    const svg = el("svg", {width: width, height: top + step * R + 8});
    el("text", {x: x0 - 8, y: 14, "text-anchor": "end"}, svg).textContent = "from";
    el("text", {x: x1 + 8, y: 14}, svg).textContent = "to";
    const lines = el("g", {}, svg), left = [], right = [];
    for (let i = 0; i < R; i++) {
      const y = top + step * i + step / 2;
      const a = el("text", {x: x0 - 8, y: y + 4, "text-anchor": "end", "data-row": i}, svg);
      a.textContent = D.labels[i]; left.push(a);
      const b = el("text", {x: x1 + 8, y: y + 4, "data-col": i}, svg);
      b.textContent = D.labels[i]; right.push(b);
    }
    for (let i = 0; i < R; i++) for (let j = 0; j < R; j++) {
      const v = m[i][j];
      if (v === null || Math.abs(v) / sc < MIN_SHARE) continue;
      el("line", {x1: x0, y1: top + step * i + step / 2, x2: x1, y2: top + step * j + step / 2,
                  stroke: v >= 0 ? "#1f4e9c" : "#be1e2d", "stroke-width": 2,
                  "stroke-opacity": Math.min(1, Math.abs(v) / sc).toFixed(4),
                  "data-from": i, "data-to": j, "data-value": v}, lines);
    }
    left.forEach(function (t, i) {  // hovering a word shows only its lines
      t.addEventListener("mouseenter", function () {
        lines.querySelectorAll("line").forEach(function (l) { l.classList.toggle("dim", +l.dataset.from !== i); });
        left.forEach(function (u, k) { u.classList.toggle("dim", k !== i); });
      });
      t.addEventListener("mouseleave", function () {
        lines.querySelectorAll("line").forEach(function (l) { l.classList.remove("dim"); });
        left.forEach(function (u) { u.classList.remove("dim"); });
      });
    });
    return svg;
  }
  function drawMatrix(m, sc) {
    const cell = 22, left = 140, top = 140;
    const svg = el("svg", {width: left + cell * R + 8, height: top + cell * R + 8});
    for (let i = 0; i < R; i++) {
      el("text", {x: left - 6, y: top + cell * i + cell / 2 + 4, "text-anchor": "end"}, svg).textContent = D.labels[i];
      const x = left + cell * i + cell / 2;
      el("text", {x: 0, y: 0, transform: "translate(" + (x + 4) + "," + (top - 6) + ") rotate(-60)"}, svg)
        .textContent = D.labels[i];
    }
    for (let i = 0; i < R; i++) for (let j = 0; j < R; j++) {
      const v = m[i][j];
      const r = el("rect", {x: left + cell * j, y: top + cell * i, width: cell, height: cell,
                            fill: rgb(colour(v, sc)), "data-from": i, "data-to": j,
                            "data-value": v === null ? "null" : v}, svg);
      el("title", {}, r).textContent = D.labels[i] + " \u2192 " + D.labels[j] + ": " + (v === null ? "n/a" : v);
    }
    return svg;
  }
  function draw() {
    const s = state(), k = D.kinds[s.ki], layer = k.layers[s.li] + 1;
    document.body.dataset.kind = k.kind; document.body.dataset.layer = layer;
    document.body.dataset.head = s.h + 1; document.body.dataset.mode = s.mode;
    kindSel.value = k.kind; modeSel.value = s.mode;
    document.getElementById("selected").textContent =
      k.kind + " " + (k.heads > 1 ? layer + "-" + (s.h + 1) + " (layer " + layer + ", head " + (s.h + 1) + ")"
                                   : "layer " + layer);
    drawGrid(s);
    const m = map(k, s.li, s.h), sc = scale(m);
    big.textContent = "";
    big.appendChild(s.mode === "matrix" ? drawMatrix(m, sc) : drawLines(m, sc));
  }
  kindSel.addEventListener("change", function () {
    const s = state(), ki = D.kinds.findIndex(function (k) { return k.kind === kindSel.value; });
    const k = D.kinds[ki], li = Math.min(s.li, k.layers.length - 1), h = Math.min(s.h, k.heads - 1);
    location.hash = href(ki, li, h, s.mode);
  });
  modeSel.addEventListener("change", function () {
    const s = state();
    location.hash = href(s.ki, s.li, s.h, modeSel.value);
  });
  window.addEventListener("hashchange", draw);
  draw();
})();
"""


def view_html(labels: Sequence[str], kinds: Sequence[KindMaps], title: str = "") -> str:
    """The page of one sentence's maps.

    Args:
        labels: The R row/column labels (special tokens and words, in sequence order).
        kinds: The maps of one or more kinds (distinct names), each ``(L', H, R, R)``.
        title: The page's heading (default: the labels joined by spaces).

    Returns:
        The HTML text.
    """
    if not kinds:
        raise ValueError("no maps given: pass the maps of at least one kind")
    names = [k.kind for k in kinds]
    if len(set(names)) != len(names):
        raise ValueError(f"each map kind once, got {names}")
    title = title or " ".join(labels)
    data = _payload(labels, kinds, title)
    note = (f"Rows are 'from', columns 'to'. Click a thumbnail to show that map; hover a word on the left of the "
            f"lines view to show only its lines. Colour and line strength are |value| / the map's largest |value| "
            f"(blue: positive, red: negative); lines under {LINE_MIN_SHARE:g} of it are not drawn.")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{CSS}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<div class="bar"><label>map kind <select id="kind"></select></label>
<label>view <select id="mode"><option value="lines">lines</option><option value="matrix">matrix</option></select>
</label><span id="selected"></span></div>
<div class="main"><table class="grid" id="grid"></table><div id="big"></div></div>
<p class="note">{html.escape(note)}</p>
<script type="application/json" id="maps-data">{data}</script>
<script>{SCRIPT}</script>
</body></html>
"""


def write_view(path: str | os.PathLike, labels: Sequence[str], kinds: Sequence[KindMaps] | Mapping[str, KindMaps],
               title: str = "") -> Path:
    """Write :func:`view_html` to ``path`` atomically (a temporary file beside it, renamed into place).

    Args:
        path: The ``.html`` file to write (its folder is created).
        labels: The R row/column labels.
        kinds: The maps of one or more kinds.
        title: The page's heading.

    Returns:
        The path written.
    """
    kinds = list(kinds.values()) if isinstance(kinds, Mapping) else list(kinds)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, view_html(labels, kinds, title))
