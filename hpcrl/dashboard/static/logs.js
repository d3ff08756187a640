// Logs: one component (a role with its rank logs, an env with its server and workers merged by time,
// a SLURM output), searchable by text or regex and level; newest records first shown, older pages
// on demand (read backwards by byte offset on the server), new records followed while "follow" is on.
"use strict";

const L = {
  component: H.query.get("component") || "",
  q: H.query.get("q") || "",
  regex: H.query.get("regex") === "1",
  level: H.query.get("level") || "",
  follow: true,
  cursor: null,
  after: null,
  more: false,
  gen: 0,  // bumps on every new query: answers to an older one are dropped
};

function highlight(text) {
  if (!L.q) return [text];
  let re;
  try { re = new RegExp(L.regex ? L.q : L.q.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"), "gi"); } catch (e) { return [text]; }
  const out = [];
  let last = 0, m;
  while ((m = re.exec(text)) !== null) {
    if (m[0].length === 0) { re.lastIndex++; continue; }
    out.push(text.slice(last, m.index), H.el("mark", { text: m[0] }));
    last = m.index + m[0].length;
    if (out.length > 400) break;
  }
  out.push(text.slice(last));
  return out;
}

function recEl(r) {
  return H.el("div", { class: "rec " + r.level }, r.source ? H.el("span", { class: "src", text: `[${r.source}] ` }) : null, highlight(r.text));
}

function params(extra) {
  return { run: H.run(), component: L.component, q: L.q, regex: L.regex ? "1" : "", level: L.level, limit: 300, ...extra };
}

async function loadNewest() {
  const gen = ++L.gen;
  const box = document.getElementById("recs");
  const d = await H.api("/api/logs", params({}));
  if (gen !== L.gen) return;
  L.component = d.component;
  L.cursor = d.cursor; L.after = d.after; L.more = d.more;
  box.replaceChildren(...d.records.map(recEl));
  if (!d.records.length) box.append(H.el("div", { class: "muted", text: L.q || L.level ? "no record matches" : "no records yet" }));
  document.getElementById("older").disabled = !d.more;
  box.scrollTop = box.scrollHeight;
}

async function loadOlder() {
  if (!L.more) return;
  const gen = L.gen;
  const box = document.getElementById("recs");
  const d = await H.api("/api/logs", params({ cursor: JSON.stringify(L.cursor) }));
  if (gen !== L.gen) return;
  L.cursor = d.cursor; L.more = d.more;
  const h = box.scrollHeight;
  box.prepend(...d.records.map(recEl));
  box.scrollTop += box.scrollHeight - h;
  document.getElementById("older").disabled = !d.more;
}

async function followTick() {
  if (!L.follow || !L.after) return;
  const gen = L.gen;
  const d = await H.api("/api/logs", params({ after: JSON.stringify(L.after) }));
  if (gen !== L.gen || !d.records.length) { if (gen === L.gen) L.after = d.after; return; }
  L.after = d.after;
  const box = document.getElementById("recs");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  if (box.firstChild && box.firstChild.classList.contains("muted")) box.replaceChildren();
  box.append(...d.records.map(recEl));
  while (box.childElementCount > 5000) box.firstChild.remove();
  if (atBottom) box.scrollTop = box.scrollHeight;
}

async function init() {
  const comps = (await H.api("/api/log_components", { run: H.run() })).components;
  if (!comps.length) {
    H.main().replaceChildren(H.el("p", { class: "muted", text: "no logs yet in this run directory" }));
    return;
  }
  if (!comps.some((c) => c.name === L.component)) L.component = comps.some((c) => c.name === "orchestrator") ? "orchestrator" : comps[0].name;
  const sel = H.el("select", { id: "component" }, comps.map((c) => H.el("option", {
    value: c.name, selected: c.name === L.component, text: c.files > 1 ? `${c.name} (${c.files} files)` : c.name })));
  const q = H.el("input", { id: "search", type: "search", placeholder: "search", value: L.q, style: { width: "280px" } });
  const rx = H.el("input", { type: "checkbox", checked: L.regex });
  const lvl = H.el("select", {}, ["", "info", "warning", "error"].map((v) => H.el("option", { value: v, text: v || "any level", selected: v === L.level })));
  const fol = H.el("input", { type: "checkbox", checked: L.follow });
  const older = H.el("button", { id: "older", text: "load older", disabled: true, onclick: () => loadOlder().catch(showErr) });
  const restart = () => {
    H.setQuery("component", L.component); H.setQuery("q", L.q); H.setQuery("regex", L.regex ? "1" : ""); H.setQuery("level", L.level);
    loadNewest().catch(showErr);
  };
  sel.addEventListener("change", () => { L.component = sel.value; restart(); });
  q.addEventListener("input", H.debounce(() => { L.q = q.value; restart(); }, 300));
  rx.addEventListener("change", () => { L.regex = rx.checked; restart(); });
  lvl.addEventListener("change", () => { L.level = lvl.value; restart(); });
  fol.addEventListener("change", () => { L.follow = fol.checked; });
  H.main().replaceChildren(
    H.el("div", { class: "controls" }, sel, q, H.el("label", {}, rx, "regex"), lvl, H.el("label", {}, fol, "follow"), older,
      H.el("span", { id: "err", class: "error" })),
    H.el("div", { id: "recs", class: "logs" }));
  await loadNewest();
  H.poll(followTick, 2000);
}

function showErr(e) { document.getElementById("err").textContent = String(e.message || e); }

H.boot({ multi: false }, () => init().catch((e) => H.main().replaceChildren(H.el("p", { class: "error", text: String(e.message || e) }))));
