// Metrics: every metric of the selected runs, grouped by prefix (reward, eval, loss, optim, perf, ...)
// and, below it, by env or rubric function (reward/<env>/<fn>/mean sits under "reward · <env>").
// Step, elapsed or wall time on x; EMA smoothing done on the server, before downsampling. A chart
// is drawn and polled only while its section is open and on screen.
"use strict";

const state = {
  x: H.query.get("x") || "step",
  smooth: Number(H.query.get("smooth") || 0),
  filter: H.query.get("q") || "",
  names: {},
  charts: new Map(),  // name -> Chart
  visible: new Set(),  // names whose chart is on screen
};
const FIRST_OPEN = ["reward", "eval", "loss"];

function sectionsOf(names) {
  const groups = new Map();
  for (const n of names) {
    const parts = n.split("/");
    const top = parts.length > 1 ? parts[0] : "other";
    const sub = parts.length > 2 ? parts[1] : "";
    if (!groups.has(top)) groups.set(top, new Map());
    const g = groups.get(top);
    if (!g.has(sub)) g.set(sub, []);
    g.get(sub).push(n);
  }
  return groups;
}

function controls() {
  const x = H.el("select", {}, ["step", "elapsed", "time"].map((v) => H.el("option", { value: v, text: v, selected: v === state.x })));
  x.addEventListener("change", () => { state.x = x.value; H.setQuery("x", x.value === "step" ? "" : x.value); redrawAll(); });
  const sm = H.el("input", { type: "range", min: 0, max: 0.99, step: 0.01, value: state.smooth, style: { width: "140px" } });
  const smv = H.el("span", { class: "mono", text: state.smooth.toFixed(2) });
  sm.addEventListener("input", () => { smv.textContent = Number(sm.value).toFixed(2); });
  sm.addEventListener("change", () => { state.smooth = Number(sm.value); H.setQuery("smooth", state.smooth || ""); redrawAll(); });
  const f = H.el("input", { type: "search", placeholder: "filter metrics (e.g. reward/ or mismatch)", value: state.filter, style: { width: "300px" } });
  f.addEventListener("input", H.debounce(() => { state.filter = f.value; H.setQuery("q", f.value); build(); }, 250));
  return H.el("div", { class: "controls" }, f, H.el("label", {}, "x", x), H.el("label", {}, "smoothing", sm, smv),
    H.el("span", { id: "count", class: "muted" }));
}

const io = new IntersectionObserver((entries) => {
  let added = false;
  for (const e of entries) {
    const name = e.target.dataset.name;
    if (e.isIntersecting) { if (!state.visible.has(name)) added = true; state.visible.add(name); }
    else state.visible.delete(name);
  }
  if (added) loadVisible();
}, { rootMargin: "200px" });

function build() {
  const list = document.getElementById("sections");
  for (const c of state.charts.values()) { io.unobserve(c.box); c.destroy(); }
  state.charts.clear();
  state.visible.clear();
  list.replaceChildren();
  const needle = state.filter.toLowerCase();
  const names = Object.keys(state.names).filter((n) => !needle || n.toLowerCase().includes(needle)).sort();
  document.getElementById("count").textContent = `${names.length} metrics`;
  if (!names.length) {
    list.append(H.el("p", { class: "muted", text: Object.keys(state.names).length ? "no metric matches the filter" : "no metrics yet" }));
    return;
  }
  const sections = sectionsOf(names);
  const order = [...sections.keys()].sort((a, b) => {
    const ia = FIRST_OPEN.indexOf(a), ib = FIRST_OPEN.indexOf(b);
    return (ia < 0 ? 99 : ia) - (ib < 0 ? 99 : ib) || a.localeCompare(b);
  });
  for (const top of order) {
    const subs = sections.get(top);
    const count = [...subs.values()].reduce((a, v) => a + v.length, 0);
    const det = H.el("details", { open: needle !== "" || FIRST_OPEN.includes(top) || sections.size <= 3 },
      H.el("summary", { text: `${top} (${count})` }));
    const fill = () => {
      if (det.dataset.filled) return;
      det.dataset.filled = "1";
      for (const [sub, ns] of [...subs.entries()].sort()) {
        if (sub) det.append(H.el("h3", { text: `${top} · ${sub}` }));
        const grid = H.el("div", { class: "grid" });
        det.append(grid);
        for (const n of ns) {
          const c = new Chart(grid, n, 200);
          c.box.dataset.name = n;
          state.charts.set(n, c);
          io.observe(c.box);
        }
      }
    };
    det.addEventListener("toggle", () => { if (det.open) fill(); });
    if (det.open) fill();
    list.append(det);
  }
}

let loading = false, again = false;
async function loadVisible(all) {
  if (loading) { again = true; return; }
  const names = [...state.visible].filter((n) => state.charts.has(n) && (all || !state.charts.get(n).sig));
  if (!names.length) return;
  loading = true;
  try {
    const runs = H.selectedRuns();
    for (let i = 0; i < names.length; i += 24) {
      const batch = names.slice(i, i + 24);
      const s = await H.api("/api/series", { runs: runs.join(","), name: batch, x: state.x, smooth: state.smooth || "", points: 400 });
      for (const n of batch) {
        const c = state.charts.get(n);
        if (c) c.set(linesOf(s.series, [n], runs.length > 1), state.x);
      }
    }
  } finally {
    loading = false;
  }
  if (again) { again = false; loadVisible(); }
}

function redrawAll() { loadVisible(true); }

async function refresh() {
  const data = await H.api("/api/metric_names", { runs: H.selectedRuns().join(",") });
  const before = Object.keys(state.names).join("\n");
  state.names = data.names;
  if (Object.keys(state.names).join("\n") !== before) build();
  await loadVisible(true);
}

H.boot({ multi: true }, () => {
  H.main().replaceChildren(controls(), H.el("div", { id: "sections" }));
  H.poll(refresh, 5000);
});
