// Charts: one uPlot per curve set. The server sends each line already downsampled (mean per bucket,
// with the bucket's min and max as "lo"/"hi", drawn as a faint band so a spike still shows); lines
// of several runs or roles are aligned on one x with uPlot.join and overlaid.
"use strict";

function cssVar(name, fallback) {
  const v = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return v || fallback;
}

function fmtElapsed(s) {
  if (s === null || s === undefined) return "";
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
  return h ? `${h}h${String(m).padStart(2, "0")}` : `${m}m${String(Math.floor(s % 60)).padStart(2, "0")}`;
}

class Chart {
  constructor(parent, title, height = 220) {
    this.height = height;
    this.box = H.el("div", { class: "chart" }, H.el("div", { class: "title", text: title }));
    this.plot = H.el("div");
    this.box.append(this.plot);
    parent.append(this.box);
    this.u = null;
    this.sig = "";
    this.zoomed = false;
    this.ro = new ResizeObserver(() => {
      if (this.u) this.u.setSize({ width: this.width(), height: this.height });
    });
    this.ro.observe(this.box);
  }

  width() { return Math.max(200, this.box.clientWidth - 18); }

  empty(text) {
    if (this.u) { this.u.destroy(); this.u = null; }
    this.sig = "";
    this.plot.replaceChildren(H.el("div", { class: "empty", text }));
  }

  // lines: [{label, color, x: [], y: [], lo?, hi?}]; xKind: step | elapsed | time
  set(lines, xKind) {
    lines = lines.filter((l) => l.x && l.x.length);
    if (!lines.length) return this.empty("no data yet");
    const tables = [], series = [{ label: xKind }], bands = [], bandIdx = new Set();
    for (const l of lines) {
      tables.push([l.x, l.y]);
      series.push({ label: l.label, stroke: l.color, width: 1.6, spanGaps: true, points: { show: l.x.length < 40 } });
      if (l.lo && l.hi) {
        tables.push([l.x, l.hi], [l.x, l.lo]);
        const hi = series.length, lo = series.length + 1;
        series.push({ label: l.label + " max", stroke: l.color + "40", width: 0.5, spanGaps: true, points: { show: false } });
        series.push({ label: l.label + " min", stroke: l.color + "40", width: 0.5, spanGaps: true, points: { show: false } });
        bands.push({ series: [hi, lo], fill: l.color + "1c" });
        bandIdx.add(hi).add(lo);
      }
    }
    const data = tables.length === 1 ? tables[0] : uPlot.join(tables);
    const sig = xKind + "|" + series.map((s) => s.label).join("|");
    if (this.u && sig === this.sig) {
      this.u.setData(data, !this.zoomed);
      return;
    }
    if (this.u) this.u.destroy();
    this.plot.replaceChildren();
    this.sig = sig;
    this.zoomed = false;
    const muted = cssVar("--muted", "#6b7385"), grid = cssVar("--line", "#e3e6ec");
    const axis = { stroke: muted, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 } };
    const xAxis = { ...axis };
    if (xKind === "elapsed") xAxis.values = (u, vals) => vals.map(fmtElapsed);
    if (xKind === "step") xAxis.values = (u, vals) => vals.map((v) => (Number.isInteger(v) ? v.toLocaleString() : ""));
    const opts = {
      width: this.width(),
      height: this.height,
      series,
      bands,
      scales: { x: { time: xKind === "time" } },
      axes: [xAxis, { ...axis, size: 62, values: (u, vals) => vals.map((v) => H.fmt(v, 3)) }],
      legend: { live: true },
      cursor: { sync: { key: "hpcrl" } },
      hooks: {
        setSelect: [() => { this.zoomed = true; }],
      },
    };
    this.u = new uPlot(opts, data, this.plot);
    this.u.over.addEventListener("dblclick", () => { this.zoomed = false; });
    const rows = this.u.root.querySelectorAll(".u-legend .u-series");
    rows.forEach((row, i) => { if (bandIdx.has(i)) row.style.display = "none"; });
  }

  destroy() {
    this.ro.disconnect();
    if (this.u) this.u.destroy();
    this.box.remove();
  }
}

// The lines of one metric from /api/series: one per run and role, coloured by run (or by name
// when one run shows several names).
function linesOf(seriesByName, names, multiRun) {
  const out = [];
  names.forEach((name, ni) => {
    for (const s of seriesByName[name] || []) {
      const roles = (seriesByName[name] || []).filter((t) => t.run === s.run).length;
      const parts = [];
      if (multiRun) parts.push(H.runName(s.run));
      if (names.length > 1) parts.push(name);
      if (roles > 1) parts.push(s.role);
      const color = multiRun ? H.runColor(s.run + ni * 3) : PALETTE[ni % PALETTE.length];
      out.push({ label: parts.join(" · ") || name, color, x: s.x, y: s.y, lo: s.lo, hi: s.hi });
    }
  });
  return out;
}
