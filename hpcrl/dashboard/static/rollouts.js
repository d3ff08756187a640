// Rollouts: the saved rollouts of one step (the newest by default, followed as the run goes on),
// train or eval, grouped by prompt with every member's reward and advantage from the index; a
// rollout opens in full below its group (RV.render).
"use strict";

const R = {
  step: /^\d+$/.test(H.query.get("step") || "") ? Number(H.query.get("step")) : null,
  split: H.query.get("split") || "train",
  env: H.query.get("env") || "",
  sort: H.query.get("sort") || "",
  page: Number(H.query.get("page") || 0),
  mode: H.query.get("color") || "logprob",
  steps: [],
  newest: null,
  followNewest: !/^\d+$/.test(H.query.get("step") || ""),
  cache: new Map(),  // "step/split/row" -> record
  open: null,  // {key, row} of the rollout shown
};

function rewardColor(r) {
  if (typeof r !== "number") return "";
  const v = Math.max(0, Math.min(1, r));
  return `rgba(${Math.round(220 - 200 * v)}, ${Math.round(60 + 103 * v)}, 60, 0.18)`;
}

async function records(rows) {
  const missing = rows.filter((r) => !R.cache.has(`${R.step}/${R.split}/${r}`));
  if (missing.length) {
    const d = await H.api("/api/rollout_records", { run: H.run(), step: R.step, split: R.split, rows: missing.join(",") });
    for (const rec of d.records) R.cache.set(`${R.step}/${R.split}/${rec.row}`, rec);
  }
  return rows.map((r) => R.cache.get(`${R.step}/${R.split}/${r}`)).filter(Boolean);
}

async function openRollout(groupEl, g, row) {
  for (const other of document.querySelectorAll(".group")) {  // one rollout open at a time
    if (other === groupEl) continue;
    other.querySelector(".view").replaceChildren();
    for (const c of other.querySelectorAll(".chip.sel")) c.classList.remove("sel");
  }
  for (const c of groupEl.querySelectorAll(".chip")) c.classList.toggle("sel", Number(c.dataset.row) === row);
  const view = groupEl.querySelector(".view");
  const recs = await records(g.rows.map((r) => r.row));  // the whole group: its siblings open at once
  const rec = recs.find((x) => x.row === row);
  R.open = { key: `${g.env}/${g.example_id}`, row };
  view.replaceChildren(rec ? RV.render(rec, R.mode, g.rows.map((r) => r.advantage)) : H.el("p", { class: "muted", text: "this rollout could not be read" }));
}

function groupEl(g) {
  const el = H.el("div", { class: "group" });
  const advs = g.rows.map((r) => (typeof r.advantage === "number" ? r.advantage : null));
  el.append(H.el("div", { class: "head" },
    H.el("strong", { text: `${g.env} · example ${g.example_id}` }),
    H.el("span", { text: `reward ${H.fmt(g.mean, 3)} ± ${H.fmt(g.std, 3)}` }),
    H.el("span", { class: "muted", text: `${g.rows.length} rollouts` }),
    g.errored ? H.el("span", { class: "badge bad", text: `${g.errored} errored` }) : null,
    R.split === "train" ? H.el("span", { class: "badge " + (g.trained ? "ok" : "warn"), text: g.trained ? "trained" : "dropped" }) : null,
    H.el("span", { class: "muted mono", text: `advantages [${advs.map((a) => (a === null ? "–" : (a >= 0 ? "+" : "") + a.toFixed(2))).join(", ")}]` })));
  const chips = H.el("div", { class: "chips" });
  for (const r of g.rows) {
    const chip = H.el("span", {
      class: "chip" + (r.ok ? "" : " err") + (R.split === "train" && !r.trained ? " dropped" : ""),
      "data-row": r.row,
      title: `rollout ${r.index}: reward ${H.fmt(r.reward)}, advantage ${H.fmt(r.advantage)}${r.ok ? "" : " (errored)"}`,
      style: { background: rewardColor(r.reward) },
      text: `#${r.index} r=${H.fmt(r.reward, 3)} A=${r.advantage === null ? "–" : (r.advantage >= 0 ? "+" : "") + r.advantage.toFixed(2)}`,
    });
    chip.addEventListener("click", () => openRollout(el, g, r.row).catch(showErr));
    chips.append(chip);
  }
  el.append(chips, H.el("div", { class: "view" }));
  return el;
}

function showErr(e) { const x = document.getElementById("err"); if (x) x.textContent = String(e.message || e); }

async function loadGroups() {
  const list = document.getElementById("groups");
  if (R.step === null) {
    list.replaceChildren(H.el("p", { class: "muted", text: "no saved rollouts yet: they appear after the first step (orchestrator.save_rollouts)" }));
    return;
  }
  const d = await H.api("/api/rollout_groups", { run: H.run(), step: R.step, split: R.split, env: R.env, sort: R.sort, page: R.page, size: 20 });
  R.split = d.split;
  R.page = d.page;
  syncControls(d);
  if (!d.groups.length) {
    list.replaceChildren(H.el("p", { class: "muted", text: `no saved rollouts at step ${R.step}` }));
    return;
  }
  const els = d.groups.map(groupEl);
  list.replaceChildren(...els);
  // open the rollout that was open (same group), else the first one of the page
  let i = R.open ? d.groups.findIndex((g) => `${g.env}/${g.example_id}` === R.open.key) : -1;
  let row = i >= 0 ? R.open.row : null;
  if (i < 0) { i = 0; row = d.groups[0].rows[0].row; }
  await openRollout(els[i], d.groups[i], row);
}

function syncControls(d) {
  document.getElementById("stepin").value = R.step;
  const sp = document.getElementById("split");
  sp.replaceChildren(...["train", "eval"].map((s) => H.el("option", { value: s, text: d.splits.includes(s) ? s : `${s} (none)`, selected: s === d.split, disabled: !d.splits.includes(s) })));
  const ev = document.getElementById("envsel");
  ev.replaceChildren(H.el("option", { value: "", text: "every env" }), ...d.envs.map((e) => H.el("option", { value: e, text: e, selected: e === R.env })));
  document.getElementById("pageinfo").textContent = `step ${d.step}: ${d.rollouts} rollouts in ${d.groups_total} groups · page ${d.page + 1}/${d.pages}`;
  document.getElementById("prevpage").disabled = d.page <= 0;
  document.getElementById("nextpage").disabled = d.page >= d.pages - 1;
  H.setQuery("step", R.followNewest ? "" : R.step);
  H.setQuery("split", R.split === "train" ? "" : R.split);
  H.setQuery("page", R.page || "");
}

function goStep(step, follow) {
  R.followNewest = follow;
  document.getElementById("newest").checked = follow;
  if (step === R.step) return;
  R.step = step; R.page = 0; R.open = null;
  loadGroups().catch(showErr);
}

function neighbour(dir) {
  const i = R.steps.indexOf(R.step);
  const j = i < 0 ? R.steps.length - 1 : i + dir;
  if (j >= 0 && j < R.steps.length) goStep(R.steps[j], false);
}

async function refreshSteps() {
  const d = await H.api("/api/rollout_steps", { run: H.run() });
  R.steps = d.steps; R.newest = d.newest;
  const info = document.getElementById("stepsinfo");
  info.textContent = d.newest === null ? "" : `newest step ${d.newest}`;
  if (R.step === null || (R.followNewest && d.newest !== null && d.newest !== R.step)) {
    if (d.newest !== null) { R.step = d.newest; R.page = 0; R.open = null; }
    await loadGroups();
  }
}

function controls() {
  const stepin = H.el("input", { id: "stepin", type: "number", min: 0, style: { width: "90px" } });
  stepin.addEventListener("change", () => { if (/^\d+$/.test(stepin.value)) goStep(Number(stepin.value), false); });
  const newest = H.el("input", { id: "newest", type: "checkbox", checked: R.followNewest });
  newest.addEventListener("change", () => { if (newest.checked && R.newest !== null) goStep(R.newest, true); else R.followNewest = newest.checked; });
  const split = H.el("select", { id: "split" });
  split.addEventListener("change", () => { R.split = split.value; R.page = 0; R.open = null; loadGroups().catch(showErr); });
  const env = H.el("select", { id: "envsel" });
  env.addEventListener("change", () => { R.env = env.value; H.setQuery("env", R.env); R.page = 0; loadGroups().catch(showErr); });
  const sort = H.el("select", {}, [["", "file order"], ["-reward", "reward, high first"], ["reward", "reward, low first"], ["std", "reward spread"]].map(([v, t]) => H.el("option", { value: v, text: t, selected: v === R.sort })));
  sort.addEventListener("change", () => { R.sort = sort.value; H.setQuery("sort", R.sort); R.page = 0; loadGroups().catch(showErr); });
  const mode = H.el("select", { id: "colour" }, RV.MODES.map(([v, t]) => H.el("option", { value: v, text: t, selected: v === R.mode })));
  mode.addEventListener("change", () => { R.mode = mode.value; H.setQuery("color", R.mode === "logprob" ? "" : R.mode); loadGroups().catch(showErr); });
  const page = (dir) => () => { R.page += dir; loadGroups().catch(showErr); };
  return H.el("div", { class: "controls" },
    H.el("label", {}, "step", H.el("button", { text: "◀", title: "previous step", onclick: () => neighbour(-1) }), stepin,
      H.el("button", { text: "▶", title: "next step", onclick: () => neighbour(1) })),
    H.el("label", {}, newest, "follow newest"), H.el("span", { id: "stepsinfo", class: "muted" }),
    split, env, sort, H.el("label", {}, "colour tokens by", mode),
    H.el("button", { id: "prevpage", text: "‹ groups", onclick: page(-1) }), H.el("button", { id: "nextpage", text: "groups ›", onclick: page(1) }),
    H.el("span", { id: "pageinfo", class: "muted" }), H.el("span", { id: "err", class: "error" }));
}

H.boot({ multi: false }, () => {
  H.main().replaceChildren(controls(), H.el("div", { id: "groups" }, H.el("p", { class: "muted", text: "loading…" })));
  H.poll(refreshSteps, 4000);
});
