// Config: each role's resolved config (configs/*.toml as the launcher wrote them, secrets as
// references) of the first selected run, and with several runs selected, every key of the resolved
// config whose value differs between them.
"use strict";

async function showConfig(run, name, pre, tabs) {
  for (const b of tabs.children) b.classList.toggle("on", b.dataset.name === name);
  const d = await H.api("/api/config", { run, name });
  pre.textContent = d.text;
  H.setQuery("name", name === "resolved" ? "" : name);
}

async function init() {
  const runs = H.selectedRuns();
  const main = H.main();
  main.replaceChildren();
  if (runs.length > 1) {
    const d = await H.api("/api/config_diff", { runs: runs.join(",") });
    const t = H.el("table", {}, H.el("tr", {}, H.el("th", { text: "key" }), runs.map((id) => H.el("th", {},
      H.el("span", { class: "sw", style: { background: H.runColor(id), display: "inline-block", width: "10px", height: "10px", marginRight: "5px" } }),
      H.runName(id)))));
    for (const r of d.rows) {
      t.append(H.el("tr", {}, H.el("td", { class: "mono", text: r.key }),
        r.values.map((v) => H.el("td", { class: "mono" + (v === null ? " muted" : ""), text: v === null ? "(unset)" : v }))));
    }
    main.append(H.el("h2", { text: `differences between ${runs.length} runs (resolved config)` }),
      d.rows.length ? H.el("div", { class: "card" }, t) : H.el("p", { class: "muted", text: "the resolved configs are the same" }));
  }
  for (const run of runs.slice(0, runs.length > 1 ? runs.length : 1)) {
    const list = (await H.api("/api/configs", { run })).names;
    main.append(H.el("h2", { text: `${H.runName(run)}: configs/` }));
    if (!list.length) { main.append(H.el("p", { class: "muted", text: "no configs/ in this run directory yet" })); continue; }
    const pre = H.el("pre", { class: "config" });
    const tabs = H.el("div", { class: "tabs" });
    for (const name of list) {
      tabs.append(H.el("button", { text: name === "resolved" ? "resolved (all sections)" : name, "data-name": name,
        onclick: () => showConfig(run, name, pre, tabs).catch((e) => { pre.textContent = String(e.message || e); }) }));
    }
    main.append(tabs, pre);
    const want = H.query.get("name");
    await showConfig(run, list.includes(want) ? want : list[0], pre, tabs);
  }
}

H.boot({ multi: true }, () => init().catch((e) => H.main().replaceChildren(H.el("p", { class: "error", text: String(e.message || e) }))));
