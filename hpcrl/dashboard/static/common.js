// hpcrl dashboard: what every page shares. No framework: DOM built with H.el (text only, never
// innerHTML, so nothing a run wrote can become markup), JSON fetched from the dashboard's own /api.
"use strict";

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d",
  "#ea580c", "#4f46e5", "#0d9488", "#a16207"];

const PAGES = [["/", "overview"], ["/metrics", "metrics"], ["/rollouts", "rollouts"], ["/logs", "logs"],
  ["/config", "config"]];

const H = {
  runs: [],
  query: new URLSearchParams(location.search),

  el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else if (k === "style" && typeof v === "object") Object.assign(e.style, v);
      else e.setAttribute(k, v === true ? "" : v);
    }
    for (const c of kids.flat()) {
      if (c === undefined || c === null || c === false) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  },

  async api(path, params) {
    const qs = new URLSearchParams();
    for (const [k, v] of Object.entries(params || {})) {
      if (v === undefined || v === null || v === "") continue;
      if (Array.isArray(v)) v.forEach((x) => qs.append(k, x));
      else qs.append(k, v);
    }
    const res = await fetch(path + (qs.toString() ? "?" + qs : ""), { headers: { Accept: "application/json" } });
    let body = null;
    try { body = await res.json(); } catch (e) { body = null; }
    if (!res.ok) throw new Error((body && body.error) || `${path}: HTTP ${res.status}`);
    return body;
  },

  setQuery(k, v) {
    if (v === undefined || v === null || v === "") this.query.delete(k); else this.query.set(k, v);
    const qs = this.query.toString();
    history.replaceState(null, "", location.pathname + (qs ? "?" + qs : ""));
    this.navLinks();
  },

  // The runs a multi-run page shows (?runs=0,1; default: all), or the one run of a single-run page.
  selectedRuns() {
    const raw = this.query.get("runs");
    const ids = (raw || "").split(",").filter((s) => /^\d+$/.test(s)).map(Number).filter((i) => i < this.runs.length);
    return ids.length ? ids : this.runs.map((r) => r.id);
  },
  run() {
    const raw = this.query.get("run") ?? (this.query.get("runs") || "").split(",")[0];
    const id = /^\d+$/.test(raw || "") ? Number(raw) : 0;
    return id < this.runs.length ? id : 0;
  },
  runColor(id) { return PALETTE[id % PALETTE.length]; },
  runName(id) { const r = this.runs[id]; return r ? r.name : `run ${id}`; },

  navLinks() {
    const nav = document.getElementById("nav");
    nav.replaceChildren();
    const keep = new URLSearchParams();
    for (const k of ["runs", "run"]) if (this.query.get(k)) keep.set(k, this.query.get(k));
    const qs = keep.toString();
    for (const [href, name] of PAGES) {
      const on = document.body.dataset.page === name;
      nav.append(this.el("a", { href: href + (qs ? "?" + qs : ""), class: on ? "on" : "" , text: name }));
    }
  },

  // Run picker in the header: checkboxes (multi-run pages, to overlay runs) or a select.
  runPicker(multi) {
    const onChange = () => location.reload();  // the page starts over with the new ?runs= / ?run=
    const box = document.getElementById("runpick");
    box.replaceChildren();
    if (this.runs.length < 2) {
      if (this.runs.length === 1) box.append(this.el("span", { class: "muted", text: this.runs[0].name, title: this.runs[0].root }));
      return;
    }
    if (multi) {
      const sel = new Set(this.selectedRuns());
      for (const r of this.runs) {
        const cb = this.el("input", { type: "checkbox", checked: sel.has(r.id) });
        cb.addEventListener("change", () => {
          const ids = [...box.querySelectorAll("input")].map((c, i) => (c.checked ? i : -1)).filter((i) => i >= 0);
          this.setQuery("runs", ids.length === this.runs.length ? "" : ids.join(",") || String(r.id));
          onChange();
        });
        box.append(this.el("label", { title: r.root }, cb, this.el("span", { class: "sw", style: { background: this.runColor(r.id) } }), r.name));
      }
    } else {
      const s = this.el("select", {}, this.runs.map((r) => this.el("option", { value: r.id, text: r.name, selected: r.id === this.run() })));
      s.addEventListener("change", () => { this.setQuery("run", s.value); onChange(); });
      box.append(s);
    }
  },

  // Call fn now and every ms while the tab is visible; the header says when the page last updated.
  poll(fn, ms) {
    const live = document.getElementById("live");
    let timer = null;
    const tick = async () => {
      clearTimeout(timer);
      try {
        await fn();
        live.textContent = "updated " + new Date().toLocaleTimeString();
        live.className = "";
      } catch (e) {
        live.textContent = String(e.message || e);
        live.className = "err";
      }
      timer = setTimeout(tick, ms);
    };
    document.addEventListener("visibilitychange", () => { if (!document.hidden) tick(); });
    tick();
    return { now: tick };
  },

  fmt(v, digits = 4) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    if (typeof v !== "number") return String(v);
    if (Number.isInteger(v) && Math.abs(v) < 1e9) return v.toLocaleString();
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
    return v.toPrecision(digits).replace(/\.?0+$/, "");
  },
  duration(s) {
    if (s === null || s === undefined) return "–";
    s = Math.round(s);
    if (s < 60) return `${s}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
    return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
  },
  clock(sec) {  // seconds since midnight -> HH:MM:SS
    if (sec < 0) return "";
    const p = (n) => String(n).padStart(2, "0");
    return `${p(Math.floor(sec / 3600))}:${p(Math.floor((sec % 3600) / 60))}:${p(sec % 60)}`;
  },
  main() { return document.getElementById("main"); },
  debounce(fn, ms) { let t = null; return (...a) => { clearTimeout(t); t = setTimeout(() => fn(...a), ms); }; },

  // Page entry: runs first, then the page's own init.
  async boot(opts, init) {
    try {
      this.runs = (await this.api("/api/runs")).runs;
    } catch (e) {
      this.main().replaceChildren(this.el("p", { class: "error", text: String(e.message || e) }));
      return;
    }
    this.navLinks();
    this.runPicker(opts.multi);
    init();
  },
};
