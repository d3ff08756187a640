// Overview: per run, the job and each role's state (progress files), stalls, top error causes,
// step and ETA, the newest reward and eval figures, recent warnings; then reward, eval, loss and
// throughput curves, every selected run overlaid.
"use strict";

const charts = new Map();  // title -> Chart

function badge(state) {
  return H.el("span", { class: "badge " + String(state || "").replace(/\s+/g, "-"), text: state || "?" });
}

function stat(k, v, title) {
  return H.el("div", { class: "stat", title }, H.el("div", { class: "v", text: v }), H.el("div", { class: "k", text: k }));
}

function runCard(o) {
  const card = H.el("div", { class: "card" });
  const step = o.step ?? o.orchestrator_step;
  const pct = o.max_steps && step !== null && step !== undefined ? Math.min(100, (100 * step) / o.max_steps) : null;
  card.append(
    H.el("div", { class: "row" },
      H.el("span", { class: "sw", style: { background: H.runColor(o.run.id), width: "12px", height: "12px", display: "inline-block", borderRadius: "3px" } }),
      H.el("strong", { text: o.run.name, title: o.run.root }),
      badge(o.job.state),
      H.el("span", { class: "muted", text: o.job.target ? `${o.job.target} ${o.job.id ?? ""}` : "" }),
      H.el("span", { class: "muted", text: o.updated_s !== null ? `last metric ${H.duration(o.updated_s)} ago` : "no metrics yet" })),
  );
  const stats = H.el("div", { class: "row", style: { marginTop: "10px" } },
    stat("step", step === null || step === undefined ? "–" : `${step}${o.max_steps ? " / " + o.max_steps : ""}`),
    stat("ETA", o.eta_s === null ? "–" : H.duration(o.eta_s)));
  for (const [name, v] of Object.entries(o.latest || {})) stats.append(stat(name, H.fmt(v.value, 3), `step ${v.step}`));
  card.append(stats);
  if (pct !== null) card.append(H.el("div", { class: "bar", style: { marginTop: "8px" } }, H.el("div", { style: { width: pct + "%" } })));

  if (o.roles.length) {
    const t = H.el("table", {}, H.el("tr", {}, ["role", "state", "step", "last", "waiting on / stall"].map((h) => H.el("th", { text: h }))));
    for (const r of o.roles) {
      const why = r.stall || (r.waiting_on ? `${r.waiting_on} (${H.duration(r.waiting_s)})` : "");
      t.append(H.el("tr", {},
        H.el("td", { text: r.role }), H.el("td", {}, badge(r.state)), H.el("td", { text: r.step ?? "–" }),
        H.el("td", { text: `${r.last ?? ""} (${H.duration(r.idle_s)} ago)` }), H.el("td", { text: why })));
      for (const s of r.servers || []) {
        const inflight = s.inflight ? `${s.inflight[0]} in flight, oldest ${s.inflight[1]} s` : "";
        t.append(H.el("tr", {}, H.el("td", { text: "  " + s.name, class: "muted" }), H.el("td", {}, badge(s.state)),
          H.el("td", {}), H.el("td", { text: inflight }), H.el("td", {})));
      }
    }
    card.append(H.el("h3", { text: "roles" }), t);
  }
  if (o.causes.length) {
    const t = H.el("table", {}, H.el("tr", {}, ["env", "errored", "cause"].map((h) => H.el("th", { text: h }))));
    for (const c of o.causes) t.append(H.el("tr", {}, H.el("td", { text: c.env }), H.el("td", { text: c.count }), H.el("td", { text: c.cause })));
    card.append(H.el("h3", { text: "errored rollouts (top causes)" }), t);
  }
  if (o.problems.length) {
    const t = H.el("table", {});
    for (const p of o.problems) {
      t.append(H.el("tr", {}, H.el("td", {}, badge(p.level)), H.el("td", { text: p.role }),
        H.el("td", { text: p.count > 1 ? `×${p.count}` : "" }), H.el("td", { class: "mono", text: p.text })));
    }
    card.append(H.el("h3", { text: "recent warnings and errors" }), t);
  }
  return card;
}

async function refresh() {
  const runs = H.selectedRuns();
  const data = await H.api("/api/overview", { runs: runs.join(",") });
  const main = H.main();
  let cards = document.getElementById("cards"), grid = document.getElementById("charts");
  if (!cards) {
    main.replaceChildren();
    cards = H.el("div", { id: "cards" });
    grid = H.el("div", { id: "charts", class: "grid" });
    main.append(cards, H.el("h2", { text: "curves" }), grid);
  }
  cards.replaceChildren(...data.runs.map(runCard));
  // union of every run's charts, by title, in the server's order
  const specs = new Map();
  for (const o of data.runs) for (const c of o.charts) {
    const names = specs.get(c.title) || [];
    for (const n of c.names) if (!names.includes(n)) names.push(n);
    specs.set(c.title, names);
  }
  if (!specs.size && !charts.size) {
    grid.replaceChildren(H.el("p", { class: "muted", text: "no metrics yet: curves appear with the first step" }));
    return;
  } else if (!charts.size) grid.replaceChildren();
  const allNames = [...new Set([...specs.values()].flat())];
  const s = await H.api("/api/series", { runs: runs.join(","), name: allNames, x: "step", points: 500 });
  for (const [title, names] of specs) {
    let c = charts.get(title);
    if (!c) { c = new Chart(grid, title); charts.set(title, c); }
    c.set(linesOf(s.series, names, runs.length > 1), "step");
  }
}

H.boot({ multi: true }, () => H.poll(refresh, 3000));
