// One saved rollout in full (docs/observability.md "Saved rollouts"): its figures, each rubric
// function's score and weight, the whole conversation (tool calls and results included), and each
// sampled turn's tokens coloured by logprob, advantage or trainer-sampler mismatch where saved.
"use strict";

const RV = {
  MODES: [["none", "plain text"], ["logprob", "logprob"], ["advantage", "advantage"], ["mismatch", "mismatch"]],

  text(content) {
    if (content === null || content === undefined) return "";
    if (typeof content === "string") return content;
    if (Array.isArray(content)) return content.map((p) => (typeof p === "string" ? p : p.text ?? (p.type ? `[${p.type}]` : JSON.stringify(p)))).join("");
    return JSON.stringify(content, null, 2);
  },

  pretty(args) {
    if (typeof args !== "string") return JSON.stringify(args, null, 2);
    try { return JSON.stringify(JSON.parse(args), null, 2); } catch (e) { return args; }
  },

  // The turns whose tokens the page can colour: every trace's, in order.
  turns(rec) {
    const out = [];
    for (const tr of rec.traces || []) for (const t of tr.turns || []) out.push({ ...t, traceAdvantage: tr.advantage });
    return out;
  },

  hasMismatch(rec) { return this.turns(rec).some((t) => Array.isArray(t.mismatch) || Array.isArray(t.trainer_logprobs)); },
  hasTokens(rec) { return this.turns(rec).some((t) => Array.isArray(t.tokens) && t.tokens.length); },

  // [background colour, tooltip] of token i of turn t
  shade(t, i, mode, scale) {
    const lp = (t.logprobs || [])[i];
    const tip = [`token ${JSON.stringify(t.tokens[i])}`];
    if (typeof lp === "number") tip.push(`logprob ${lp.toFixed(3)} (p ${Math.exp(lp).toFixed(3)})`);
    let bg = "";
    if (mode === "logprob" && typeof lp === "number") {
      bg = `rgba(220, 38, 38, ${(0.75 * (1 - Math.exp(lp))).toFixed(3)})`;
    } else if (mode === "advantage") {
      const a = Array.isArray(t.advantages) ? t.advantages[i] : t.traceAdvantage;
      if (typeof a === "number") {
        tip.push(`advantage ${a.toFixed(3)}`);
        const alpha = Math.min(1, Math.abs(a) / (scale || 1)) * 0.6;
        bg = a >= 0 ? `rgba(22, 163, 74, ${alpha.toFixed(3)})` : `rgba(220, 38, 38, ${alpha.toFixed(3)})`;
      }
    } else if (mode === "mismatch") {
      let m = Array.isArray(t.mismatch) ? t.mismatch[i] : undefined;
      if (m === undefined && Array.isArray(t.trainer_logprobs) && typeof lp === "number") m = Math.abs(t.trainer_logprobs[i] - lp);
      if (typeof m === "number") {
        tip.push(`mismatch ${m.toFixed(4)}`);
        bg = `rgba(124, 58, 237, ${Math.min(0.8, m * 4).toFixed(3)})`;
      }
    }
    return [bg, tip.join("\n")];
  },

  tokens(t, mode, scale) {
    const box = H.el("div", { class: "text" });
    (t.tokens || []).forEach((tok, i) => {
      const [bg, tip] = this.shade(t, i, mode, scale);
      box.append(H.el("span", { class: "tok", title: tip, style: bg ? { background: bg } : null, text: tok }));
    });
    return box;
  },

  legend(mode) {
    const steps = [0, 0.25, 0.5, 0.75, 1];
    const col = {
      logprob: (v) => `rgba(220, 38, 38, ${0.75 * v})`,
      advantage: (v) => (v < 0.5 ? `rgba(220, 38, 38, ${(0.5 - v) * 1.2})` : `rgba(22, 163, 74, ${(v - 0.5) * 1.2})`),
      mismatch: (v) => `rgba(124, 58, 237, ${0.8 * v})`,
    }[mode];
    if (!col) return null;
    const ends = { logprob: ["p=1", "p=0"], advantage: ["−", "+"], mismatch: ["0", "≥0.2"] }[mode];
    return H.el("span", { class: "muted" }, ends[0] + " ", H.el("span", { class: "legend-scale" }, steps.map((v) => H.el("span", { style: { background: col(v) } }))), " " + ends[1]);
  },

  message(m, i, rec, turn, mode, scale) {
    const role = m.role || "?";
    const head = [role + (i < (rec.num_prompt_messages || 0) ? " · prompt" : "")];
    if (m.name) head.push(m.name);
    if (role === "tool" && m.tool_call_id) head.push(`result of ${m.tool_call_id}`);
    if (turn) head.push(`turn: ${turn.finish_reason || ""}${turn.policy ? `, policy ${turn.policy.start}–${turn.policy.end}` : ""}`);
    const el = H.el("div", { class: "msg " + role }, H.el("div", { class: "who", text: head.join(" · ") }));
    if (m.reasoning_content) el.append(H.el("details", {}, H.el("summary", { class: "muted", text: "reasoning" }), H.el("div", { class: "text", text: m.reasoning_content })));
    const text = this.text(m.content);
    if (turn && mode !== "none" && Array.isArray(turn.tokens) && turn.tokens.length) el.append(this.tokens(turn, mode, scale));
    else if (text) el.append(H.el("div", { class: "text", text }));
    for (const c of m.tool_calls || []) {
      const f = c.function || c;
      el.append(H.el("div", { class: "call" }, H.el("strong", { text: `${f.name || "?"}` }), c.id ? H.el("span", { class: "muted", text: `  (${c.id})` }) : null,
        "\n" + this.pretty(f.arguments ?? "")));
    }
    return el;
  },

  // groupAdvantages: every member's advantage (from the index), the scale of the advantage colours
  render(rec, mode, groupAdvantages) {
    const box = H.el("div", { class: "rollout" });
    const adv = (groupAdvantages || (rec.group && rec.group.advantages) || []).filter((a) => typeof a === "number");
    const scale = adv.length ? Math.max(...adv.map(Math.abs)) : Math.abs(rec.advantage || 1);
    const kv = H.el("div", { class: "kv" });
    const put = (k, v) => { if (v !== undefined && v !== null && v !== "") kv.append(H.el("span", { class: "k", text: k }), H.el("span", { class: "mono", text: String(v) })); };
    put("id", rec.id);
    put("reward", H.fmt(rec.reward));
    put("advantage", H.fmt(rec.advantage));
    put("state", `${rec.ok === false ? "errored" : "ok"}${rec.split === "train" ? (rec.trained ? ", trained" : ", dropped by a filter") : ""}${rec.is_truncated ? ", truncated" : ""}`);
    if (rec.policy) put("policy", `${rec.policy.start}–${rec.policy.end}`);
    put("tokens", rec.num_input_tokens !== undefined ? `${rec.num_input_tokens} in, ${rec.num_output_tokens} out` : "");
    put("turns", rec.num_turns);
    if (rec.timing && rec.timing.duration !== undefined) put("duration", `${H.fmt(rec.timing.duration, 3)} s`);
    if (rec.task) put("example", `${rec.task.example_id}${rec.task.epoch !== undefined ? ` (epoch ${rec.task.epoch})` : ""}`);
    if (rec.task && rec.task.answer !== undefined && rec.task.answer !== null) put("answer", typeof rec.task.answer === "string" ? rec.task.answer : JSON.stringify(rec.task.answer));
    for (const e of rec.errors || []) put("error", `${e.type || ""}: ${e.message || ""}`);
    box.append(kv);
    const fns = Object.entries(rec.rewards || {});
    if (fns.length) {
      const t = H.el("table", { style: { marginTop: "6px", maxWidth: "640px" } }, H.el("tr", {}, ["rubric function", "score", "weight", "score × weight"].map((h) => H.el("th", { text: h }))));
      for (const [fn, s] of fns) {
        const score = typeof s === "object" && s !== null ? s.score : s, w = typeof s === "object" && s !== null ? s.weight : undefined;
        t.append(H.el("tr", {}, H.el("td", { class: "mono", text: fn }), H.el("td", { text: H.fmt(score) }), H.el("td", { text: H.fmt(w) }),
          H.el("td", { text: typeof w === "number" && typeof score === "number" ? H.fmt(score * w) : "–" })));
      }
      box.append(t);
    }
    if (mode !== "none" && !this.hasTokens(rec)) {
      box.append(H.el("p", { class: "muted", text: "no per-token data saved for this rollout (orchestrator.save_rollouts.tokens)" }));
    } else if (mode === "mismatch" && !this.hasMismatch(rec)) {
      box.append(H.el("p", { class: "muted", text: "this run saved no trainer logprobs: sampling logprobs only (colour by logprob)" }));
    } else if (mode !== "none") {
      box.append(H.el("div", { style: { margin: "6px 0" } }, this.legend(mode)));
    }
    const turns = this.turns(rec);
    const msgs = rec.messages || [];
    const sampled = msgs.map((m, i) => (m.role === "assistant" && i >= (rec.num_prompt_messages || 0) ? i : -1)).filter((i) => i >= 0);
    const paired = sampled.length === turns.length;  // each sampled assistant message is one turn
    msgs.forEach((m, i) => {
      const k = sampled.indexOf(i);
      box.append(this.message(m, i, rec, paired && k >= 0 ? turns[k] : null, mode, scale));
    });
    if (!paired && mode !== "none" && this.hasTokens(rec)) {
      box.append(H.el("h3", { text: "sampled turns" }));
      turns.forEach((t, i) => box.append(H.el("div", { class: "msg assistant" }, H.el("div", { class: "who", text: `turn ${i}` }), this.tokens(t, mode, scale))));
    }
    if (rec.tools && rec.tools.length) {
      box.append(H.el("details", {}, H.el("summary", { class: "muted", text: `tools (${rec.tools.length})` }), H.el("pre", { text: JSON.stringify(rec.tools, null, 2) })));
    }
    return box;
  },
};
