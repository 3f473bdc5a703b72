// The run explorer's page: curves, staleness, timeline and trajectories of one hpcrl run.
// Live: reads the explorer's JSON API and refreshes while the run goes on. Exported: reads the data
// embedded in the file (window.HPCRL_EXPORT) and never touches the network.
"use strict";

const EXPORT = window.HPCRL_EXPORT || null;
const REFRESH_MS = 5000;
const PAGE = 50;
const CURVES = [  // [title, candidate keys in order of preference]
  ["reward", ["reward/mean"]],
  ["held-out accuracy", ["eval/accuracy"]],
  ["policy loss", ["loss/pg_loss", "loss/loss"]],
  ["KL to the proximal policy", ["loss/approx_kl", "loss/kl"]],
  ["entropy", ["loss/entropy"]],
  ["clip fraction", ["loss/clip_fraction"]],
  ["train-inference mismatch", ["mismatch/abs_mean", "mismatch/abs_max"]],
  ["samples/s", ["throughput/samples_per_s"]],
];
const EVENT_STYLE = {
  start: ["#2ca02c", "triangle-right"], restart: ["#d62728", "x"], preempt: ["#ff7f0e", "triangle-down"],
  fail: ["#000000", "x-thin-open"],
  stop: ["#7f7f7f", "square"], scale: ["#2ca02c", "diamond"], autoscale: ["#2ca02c", "diamond-open"],
  resume: ["#9467bd", "star"], rewind: ["#9467bd", "star-open"], checkpoint: ["#1f77b4", "line-ns-open"],
  publish: ["#17becf", "circle"], done: ["#2ca02c", "star-square"], failed: ["#d62728", "star-square"],
  stopped: ["#7f7f7f", "star-square"],
};
const MARKED = { restart: "#d62728", preempt: "#ff7f0e", rewind: "#9467bd", resume: "#9467bd" };

const state = { rows: [], evals: [], next: 0, events: [], components: [], summary: null, offset: 0,
  query: {}, nextOffset: null, selected: null };

async function api(route, params = {}) {
  if (EXPORT) return exported(route, params);
  const qs = new URLSearchParams(Object.entries(params).filter(([, v]) => v !== "" && v !== null && v !== undefined));
  const r = await fetch(`api/${route}?${qs}`, { credentials: "same-origin" });
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

function exported(route, params) {
  if (route === "summary") return EXPORT.summary;
  if (route === "curves") return { next: EXPORT.curves.rows.length, rows: params.since ? [] : EXPORT.curves.rows,
    evals: EXPORT.curves.evals };
  if (route === "events") return EXPORT.events;
  if (route === "group") {
    const g = EXPORT.details[params.path];
    if (!g) throw new Error("this trajectory is not in the export (only the first groups of each kind are)");
    return g;
  }
  const kind = params.kind || "trained";
  let rows = (EXPORT.groups[kind] || []).filter((g) => matches(g, params));
  const offset = Number(params.offset || 0);
  return { groups: rows.slice(offset, offset + PAGE), next_offset: offset + PAGE < rows.length ? offset + PAGE : null };
}

function matches(g, p) {
  const key = g.step !== undefined ? g.step : g.max_version;
  if (p.step_min !== undefined && key < Number(p.step_min)) return false;
  if (p.step_max !== undefined && key > Number(p.step_max)) return false;
  if (p.ticket !== undefined && g.ticket !== Number(p.ticket)) return false;
  if (p.replica !== undefined && g.writer.split("-")[0] !== p.replica) return false;
  if (p.reward_min !== undefined && !(g.reward_mean >= Number(p.reward_min))) return false;
  if (p.reward_max !== undefined && !(g.reward_mean <= Number(p.reward_max))) return false;
  if (p.reason !== undefined && !String(g.reason || "").toLowerCase().includes(p.reason.toLowerCase())) return false;
  return true;
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

// ---- curves ------------------------------------------------------------------------------------------
function xOf(row) {
  return document.getElementById("x-axis").value === "time" ? (row["time/elapsed_s"] || 0) / 60 : row.step;
}

function eventX(ev) {
  // an event's place on the current x axis: its wall time, or the step the trainer was at then
  const rows = state.rows.filter((r) => r["time/unix"] !== undefined);
  if (!rows.length) return null;
  if (document.getElementById("x-axis").value === "time") {
    const r0 = rows[0];
    return (ev.time - r0["time/unix"] + (r0["time/elapsed_s"] || 0)) / 60;
  }
  let step = rows[0].step;
  for (const r of rows) { if (r["time/unix"] <= ev.time) step = r.step; else break; }
  return step;
}

function markers() {
  const shapes = [];
  for (const ev of state.events) {
    const color = MARKED[ev.kind];
    if (!color || !(ev.component.startsWith("trainer") || ev.component === "run" || ev.kind === "preempt")) continue;
    const x = eventX(ev);
    if (x === null) continue;
    shapes.push({ type: "line", xref: "x", yref: "paper", x0: x, x1: x, y0: 0, y1: 1,
      line: { color, width: 1, dash: "dash" } });
  }
  return shapes;
}

function listMetrics() {
  const sel = document.getElementById("more");
  const have = new Set([...sel.options].map((o) => o.value));
  const shown = new Set(CURVES.flatMap(([, keys]) => keys));
  const keys = new Set();
  for (const r of state.rows.slice(-50)) for (const k of Object.keys(r)) keys.add(k);
  for (const k of [...keys].sort()) {
    if (!have.has(k) && !shown.has(k) && k !== "step") sel.append(el("option", { value: k }, k));
  }
}

function drawCurves() {
  const box = document.getElementById("curves");
  const axis = document.getElementById("x-axis").value === "time" ? "minutes" : "step";
  const shapes = markers();
  for (const [title, keys] of CURVES) {
    const id = "curve-" + title.replace(/[^a-z]+/gi, "-");
    const source = title === "held-out accuracy" ? state.evals.concat(state.rows) : state.rows;
    const key = keys.find((k) => source.some((r) => r[k] !== undefined && r[k] !== null));
    let div = document.getElementById(id);
    if (!key) { if (div) div.remove(); continue; }  // not logged by this run's algorithm
    if (!div) { div = el("div", { id, class: "chart curve", "data-title": title }); box.append(div); }
    const pts = key ? source.filter((r) => r[key] !== undefined && r[key] !== null) : [];
    if (title === "held-out accuracy") pts.sort((a, b) => a.step - b.step);
    div.dataset.points = pts.length;
    div.dataset.key = key || "";
    const trace = { x: pts.map(xOf), y: pts.map((r) => r[key]), mode: pts.length < 60 ? "lines+markers" : "lines",
      name: key || title, line: { width: 1.5 } };
    Plotly.react(div, [trace], {
      title: { text: `${title} <span style="font-size:10px;color:#888">${key}</span>`, font: { size: 13 } },
      margin: { l: 45, r: 10, t: 30, b: 35 }, xaxis: { title: { text: axis } }, shapes, showlegend: false,
    }, { displayModeBar: false, responsive: true });
  }
}

// ---- staleness ---------------------------------------------------------------------------------------
function drawStaleness() {
  const div = document.getElementById("staleness");
  const rows = state.rows;
  const eta = state.summary ? state.summary.max_staleness : null;
  const ks = new Set();
  for (const r of rows) for (const k of Object.keys(r)) {
    const m = /^staleness\/tokens_behind_(\d+)$/.exec(k);
    if (m) ks.add(Number(m[1]));
  }
  const window = Math.max(1, Math.ceil(rows.length / 40));
  const traces = [];
  if (ks.size) {
    const buckets = [...ks].sort((a, b) => a - b);
    const wins = [];
    for (let i = 0; i < rows.length; i += window) wins.push(rows.slice(i, i + window));
    // x: the window's place (a restarted trainer logs some steps twice: two windows may span the same steps)
    const labels = wins.map((_, i) => i);
    const spans = wins.map((w) => `steps ${w[0].step}-${w[w.length - 1].step}`);
    for (const k of buckets) {
      const y = wins.map((w) => {
        const count = (r, b) => r[`staleness/tokens_behind_${b}`] || 0;
        const total = w.reduce((s, r) => s + buckets.reduce((t, b) => t + count(r, b), 0), 0);
        return total ? w.reduce((s, r) => s + (r[`staleness/tokens_behind_${k}`] || 0), 0) / total : 0;
      });
      traces.push({ type: "bar", name: `${k}${k === 32 ? "+" : ""} behind`, x: labels, y, text: spans,
        textposition: "none", hovertemplate: "%{text}: %{y:.1%}",
        marker: { color: k > eta ? "#d62728" : `hsl(${210 - 170 * Math.min(k, 8) / 8}, 65%, 50%)` } });
    }
    div.dataset.buckets = buckets.join(",");
  } else {
    // runs from before the per-token histogram: the mean and max versions behind per step
    traces.push({ x: rows.map((r) => r.step), y: rows.map((r) => r["staleness/mean_token"]), name: "mean behind" });
    traces.push({ x: rows.map((r) => r.step), y: rows.map((r) => r["staleness/max_token"]), name: "max behind" });
    div.dataset.buckets = "";
  }
  div.dataset.points = rows.length;
  const shapes = !ks.size && eta !== null ? [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: eta, y1: eta,
    line: { color: "#d62728", dash: "dot" } }] : [];
  Plotly.react(div, traces, {
    barmode: "stack", margin: { l: 50, r: 10, t: 30, b: 60 }, shapes,
    title: { text: `staleness bound η = ${eta}` + (ks.size ? " (share of the window's response tokens)" : ""),
      font: { size: 13 } },
    xaxis: { title: { text: ks.size ? `windows of ${window} logged steps, in order (hover for the steps)` : "step" } },
    yaxis: { title: { text: ks.size ? "share of tokens" : "versions behind" } },
  }, { displayModeBar: false, responsive: true });
}

// ---- timeline ----------------------------------------------------------------------------------------
function drawTimeline() {
  const div = document.getElementById("timeline");
  // every version the trainer published: one per step record (the weights directory keeps only the last few)
  const versions = state.rows.filter((r) => r["time/unix"] !== undefined && r.version !== undefined)
    .map((r) => ({ time: r["time/unix"], component: "weights", kind: "publish", version: r.version,
      text: `version ${r.version} (trained at step ${r.step})`, job_id: "" }));
  const seen = new Set(versions.map((e) => e.version));
  const events = state.events.filter((e) => !(e.kind === "publish" && seen.has(e.version))).concat(versions);
  const lanes = [...new Set([...state.components, ...events.map((e) => e.component)])];
  const byKind = {};
  for (const e of events) (byKind[e.kind] = byKind[e.kind] || []).push(e);
  const traces = Object.entries(byKind).map(([kind, evs]) => {
    const [color, symbol] = EVENT_STYLE[kind] || ["#444", "circle"];
    return { type: "scatter", mode: "markers", name: `${kind} (${evs.length})`,
      x: evs.map((e) => new Date(e.time * 1000)), y: evs.map((e) => e.component),
      text: evs.map((e) => `${e.component} ${kind}${e.job_id ? " job " + e.job_id : ""}<br>${e.text}`),
      hoverinfo: "text+x", marker: { color, symbol, size: kind === "publish" ? 5 : 10, line: { width: 1.5, color } } };
  });
  // trainer progress as a lane of its own, so a death shows as a gap in the steps
  const prog = state.rows.filter((r) => r["time/unix"] !== undefined);
  if (prog.length) traces.push({ type: "scatter", mode: "markers", name: "trainer steps",
    x: prog.map((r) => new Date(r["time/unix"] * 1000)), y: prog.map(() => "trainer steps"),
    text: prog.map((r) => `step ${r.step}`), hoverinfo: "text+x", marker: { size: 4, color: "#999" } });
  div.dataset.events = events.length;
  div.dataset.lanes = lanes.length;
  Plotly.react(div, traces, {
    margin: { l: 110, r: 10, t: 10, b: 40 }, hovermode: "closest",
    yaxis: { type: "category", categoryorder: "array", categoryarray: ["trainer steps", ...lanes].reverse() },
    legend: { orientation: "h", y: -0.2 },
  }, { displayModeBar: false, responsive: true });
}

// ---- trajectories ------------------------------------------------------------------------------------
function readFilters() {
  const q = {};
  for (const [k, v] of new FormData(document.getElementById("filters")).entries()) if (v !== "") q[k] = v;
  return q;
}

async function loadGroups(offset = 0) {
  state.query = readFilters();
  const body = document.querySelector("#groups tbody");
  let page;
  try {
    page = await api("groups", { ...state.query, offset, limit: PAGE });
  } catch (e) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: 6, class: "error" }, e.message)));
    return;
  }
  state.offset = offset;
  state.nextOffset = page.next_offset;
  body.replaceChildren(...page.groups.map((g) => {
    const tr = el("tr", { "data-path": g.path },
      el("td", {}, g.step !== undefined ? g.step : "—"), el("td", {}, g.ticket),
      el("td", {}, g.min_version === g.max_version ? g.min_version : `${g.min_version}–${g.max_version}`),
      el("td", {}, g.writer), el("td", {}, typeof g.reward_mean === "number" ? g.reward_mean.toFixed(3) : "—"),
      el("td", {}, g.path));
    tr.addEventListener("click", () => showGroup(g.path, tr));
    return tr;
  }));
  if (!page.groups.length) {
    body.append(el("tr", {}, el("td", { colspan: 6, class: "empty" },
      page.truncated ? "none yet: many files left to open for the reward filter, press next" : "no groups match")));
  }
  document.getElementById("page-info").textContent = page.groups.length
    ? `${offset + 1}–${offset + page.groups.length}${page.truncated ? " (more files to scan)" : ""}` : "";
  document.getElementById("prev").disabled = offset === 0;
  document.getElementById("next").disabled = page.next_offset === null;
}

function versionColor(v, lo, hi) {
  const t = hi > lo ? (v - lo) / (hi - lo) : 0;
  return `hsl(${Math.round(220 - 200 * t)}, 70%, 72%)`;
}

async function showGroup(path, row) {
  document.querySelectorAll("#groups tr.selected").forEach((r) => r.classList.remove("selected"));
  if (row) row.classList.add("selected");
  const box = document.getElementById("group");
  const asked = (state.asked = (state.asked || 0) + 1);
  let g;
  try {
    g = await api("group", { path });
  } catch (e) {
    if (asked === state.asked) box.replaceChildren(el("p", { class: "error" }, e.message));
    return;
  }
  if (asked !== state.asked) return;  // a later click's answer wins
  state.selected = path;
  box.replaceChildren();
  box.dataset.path = path;
  box.append(el("h3", {}, `ticket ${g.ticket !== undefined ? g.ticket : "?"} · ${path}`));
  if (g.reason) box.append(el("p", { class: "meta" }, `set aside: ${g.reason.reason || JSON.stringify(g.reason)}`));
  if (g.error) { box.append(el("p", { class: "error" }, `unreadable: ${g.error}`)); return; }
  const [lo, hi] = g.versions;
  const legend = el("div", { class: "legend" }, "versions: ");
  for (let v = lo; v <= hi && v - lo < 24; v++) {
    legend.append(el("span", { style: `background:${versionColor(v, lo, hi)}` }, v));
  }
  legend.append(el("span", { class: "tok masked" }, "not trained (masked)"));
  box.append(el("p", { class: "meta" }, `writer ${g.writer} · created ${new Date(g.created * 1000).toLocaleString()}`
    + Object.entries(g.meta).map(([k, v]) => ` · ${k}: ${typeof v === "object" ? JSON.stringify(v) : v}`).join("")));
  box.append(legend);
  box.append(el("div", { class: "tokens" }, ...g.prompt.map((p) => el("span", { class: "tok prompt" }, p))));
  g.samples.forEach((s, i) => {
    const toks = s.tokens.map(([piece, v, lp, m]) => el("span", {
      class: m ? "tok" : "tok masked", "data-version": v, "data-logprob": lp, "data-trained": m,
      title: `version ${v} · logprob ${lp}${m ? "" : " · not trained"}`,
      // colour: the version; shade: the behaviour probability (a faint token was an unlikely pick)
      style: m ? `background:${versionColor(v, lo, hi)};opacity:${(0.35 + 0.65 * Math.exp(lp)).toFixed(3)}` : "",
    }, piece));
    box.append(el("div", { class: "sample", "data-sample": i },
      el("div", { class: "meta" }, `sample ${i} · reward ${s.reward} · ${s.verdict || "no verdict"}`
        + ` · ${s.finish_reason} · ${s.tokens.length} tokens, ${s.tokens.filter((t) => !t[3]).length} masked`),
      el("div", { class: "tokens" }, ...toks)));
  });
}

// ---- refresh -----------------------------------------------------------------------------------------
async function refresh() {
  try {
    const [summary, curves, events] = await Promise.all([api("summary"), api("curves", { since: state.next }),
      api("events")]);
    state.summary = summary;
    state.rows = state.next ? state.rows.concat(curves.rows) : curves.rows;
    state.next = curves.next;
    state.evals = curves.evals;
    state.events = events.events;
    state.components = events.components;
    document.getElementById("run-name").textContent = summary.run;
    document.getElementById("run-state").textContent = `${summary.state} · step ${summary.step ?? "—"}`
      + ` / ${summary.total_steps ?? "?"} · η ${summary.max_staleness} · trained ${summary.counts.trained}`
      + ` · dropped ${summary.counts.dropped} · quarantined ${summary.counts.quarantine}`;
    listMetrics();
    drawCurves();
    drawStaleness();
    drawTimeline();
    document.body.dataset.loaded = "1";
    document.getElementById("refresh").textContent = EXPORT ? `exported ${EXPORT.exported}`
      : summary.state === "running" ? `live · ${new Date().toLocaleTimeString()}` : summary.state;
    if (!EXPORT && summary.state === "running") setTimeout(refresh, REFRESH_MS);
  } catch (e) {
    document.getElementById("refresh").textContent = `error: ${e.message}`;
    if (!EXPORT) setTimeout(refresh, REFRESH_MS);
  }
}

document.getElementById("x-axis").addEventListener("change", drawCurves);
document.getElementById("more").addEventListener("change", (e) => {
  if (e.target.value) CURVES.push([e.target.value, [e.target.value]]);
  e.target.value = "";
  drawCurves();
});
document.getElementById("filters").addEventListener("submit", (e) => { e.preventDefault(); loadGroups(0); });
document.getElementById("prev").addEventListener("click", () => loadGroups(Math.max(0, state.offset - PAGE)));
document.getElementById("next").addEventListener("click", () => loadGroups(state.nextOffset));
refresh().then(() => loadGroups(0));
