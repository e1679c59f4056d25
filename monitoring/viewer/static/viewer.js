// The run viewer's page: plain SVG charts and the episode browser, from the server's JSON (/api/...).
// Text from the run's files only ever goes in through textContent / createTextNode: nothing read is run as code.
"use strict";

const REFRESH_MS = Number(new URLSearchParams(location.search).get("refresh_ms")) || 5000;
const PAGE = 50;
const COLORS = ["#0969da", "#d1242f", "#1a7f37", "#8250df", "#bf8700", "#0598bc", "#cf222e", "#57606a"];
const SVG_NS = "http://www.w3.org/2000/svg";

const state = { offset: 0, total: 0, selected: null, listKey: "" };

async function getJSON(url) {
  const r = await fetch(url, { cache: "no-store" });
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || `${r.status} ${url}`);
  return body;
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function sv(tag, attrs, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function fmt(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  const a = Math.abs(v);
  if (Number.isInteger(v)) return String(v);
  if (a >= 1e5 || (a !== 0 && a < 1e-4)) return v.toExponential(1);
  if (a < 1) return String(Number(v.toPrecision(2)));
  return a >= 100 ? v.toFixed(0) : a >= 10 ? v.toFixed(1) : v.toFixed(2);
}

function ticks(lo, hi, n) {
  if (hi <= lo) return [lo];
  const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw) || raw;
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(+t.toFixed(10));
  return out;
}

// series: [{name, points: [[x, y], ...], dots}], opts: {yMin, yMax, xLabel}
function lineChart(box, series, opts) {
  opts = opts || {};
  const W = 460, H = 210, L = 46, R = 10, T = 10, B = 30;
  const svg = sv("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  const pts = series.flatMap(s => s.points);
  svg.setAttribute("data-points", String(pts.length));
  box.replaceChildren(svg);
  if (!pts.length) {
    svg.append(sv("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, opts.empty || "no data yet"));
    return;
  }
  let [x0, x1] = [Math.min(...pts.map(p => p[0])), Math.max(...pts.map(p => p[0]))];
  let y0 = opts.yMin !== undefined ? Math.min(opts.yMin, ...pts.map(p => p[1])) : Math.min(...pts.map(p => p[1]));
  let y1 = opts.yMax !== undefined ? Math.max(opts.yMax, ...pts.map(p => p[1])) : Math.max(...pts.map(p => p[1]));
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= y0 === 0 ? 0 : Math.abs(y0) * 0.1; y1 += y1 === 0 ? 1 : Math.abs(y1) * 0.1; }
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const Y = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  for (const t of ticks(y0, y1, 4)) {
    svg.append(sv("line", { x1: L, x2: W - R, y1: Y(t), y2: Y(t), class: "grid" }));
    svg.append(sv("text", { x: L - 4, y: Y(t) + 3, "text-anchor": "end" }, fmt(t)));
  }
  for (const t of ticks(x0, x1, 6).filter(t => Number.isInteger(t) || x1 - x0 < 4)) {
    svg.append(sv("text", { x: X(t), y: H - B + 13, "text-anchor": "middle" }, fmt(t)));
  }
  svg.append(sv("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }));
  svg.append(sv("line", { x1: L, x2: L, y1: T, y2: H - B, class: "axis" }));
  svg.append(sv("text", { x: (L + W - R) / 2, y: H - 3, "text-anchor": "middle" }, opts.xLabel || "learner step"));
  const legend = el("div", { class: "legend" });
  series.forEach((s, i) => {
    const color = s.color || COLORS[i % COLORS.length];
    if (!s.points.length) return;
    const d = s.points.map((p, j) => `${j ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join("");
    const g = sv("g", { class: "series", "data-name": s.name });
    g.append(sv("path", { d, class: "line", stroke: color, "stroke-dasharray": s.dashed ? "4 3" : "none" }));
    if (s.dots || s.points.length <= 120) {
      for (const p of s.points) {
        const c = sv("circle", { cx: X(p[0]).toFixed(1), cy: Y(p[1]).toFixed(1), r: s.dots ? 3 : 1.8, fill: color, class: "pt" });
        c.append(sv("title", {}, `${s.name}: step ${fmt(p[0])}, ${fmt(p[1])}`));
        g.append(c);
      }
    }
    svg.append(g);
    const sw = el("span", { class: "swatch" });
    sw.style.background = color;
    legend.append(el("span", {}, sw, s.name));
  });
  box.append(legend);
}

function barChart(box, bars, xLabel) {
  const W = 460, H = 210, L = 46, R = 10, T = 10, B = 30;
  const svg = sv("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  svg.setAttribute("data-points", String(bars.length));
  box.replaceChildren(svg);
  if (!bars.length) {
    svg.append(sv("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "no data yet"));
    return;
  }
  const top = Math.max(...bars.map(b => b.value), 1);
  const bw = (W - L - R) / bars.length;
  for (const t of ticks(0, top, 4)) {
    const y = H - B - t / top * (H - T - B);
    svg.append(sv("line", { x1: L, x2: W - R, y1: y, y2: y, class: "grid" }));
    svg.append(sv("text", { x: L - 4, y: y + 3, "text-anchor": "end" }, fmt(t)));
  }
  bars.forEach((b, i) => {
    const h = b.value / top * (H - T - B);
    const r = sv("rect", { x: L + i * bw + bw * 0.1, y: H - B - h, width: bw * 0.8, height: h, fill: COLORS[0], class: "bar" });
    r.append(sv("title", {}, `${b.label}: ${b.value}`));
    svg.append(r);
    svg.append(sv("text", { x: L + (i + 0.5) * bw, y: H - B + 13, "text-anchor": "middle" }, b.label));
  });
  svg.append(sv("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }));
  svg.append(sv("text", { x: (L + W - R) / 2, y: H - 3, "text-anchor": "middle" }, xLabel));
}

function pairs(steps, values) {
  const out = [];
  (values || []).forEach((v, i) => { if (v !== null && v !== undefined && Number.isFinite(v)) out.push([steps[i], v]); });
  return out;
}

function drawCharts(s) {
  const st = s.steps;
  lineChart(document.getElementById("chart-reward"), [
    { name: "batch reward", points: pairs(st, s.reward.batch_reward) },
    { name: "rollout exact match", points: pairs(st, s.reward.rollout_exact_match) },
    { name: "held-out exact match (greedy)", points: s.eval.map(e => [e.step, e.exact_match]), dots: true },
  ], { yMin: 0, yMax: 1 });
  const kinds = [];
  s.kinds.forEach((k, i) => {
    const color = COLORS[i % COLORS.length];
    kinds.push({ name: `rollout, ${k}`, points: pairs(st, s.rollout_em_by_kind[k]), color, dashed: true });
    kinds.push({ name: `held-out, ${k}`, color, dots: true,
      points: s.eval.filter(e => e.by_kind[k] !== undefined && e.by_kind[k] !== null).map(e => [e.step, e.by_kind[k]]) });
  });
  lineChart(document.getElementById("chart-kinds"), kinds, { yMin: 0, yMax: 1 });
  lineChart(document.getElementById("chart-episodes"), [
    { name: "episodes/s since the previous step", points: pairs(st, s.throughput.episodes_per_s) },
    { name: "episodes/s since the start", points: pairs(st, s.throughput.episodes_per_s_average) },
  ], { yMin: 0 });
  lineChart(document.getElementById("chart-tokens"), [
    { name: "generated tokens/s (since the start)", points: pairs(st, s.throughput.gen_tokens_per_s_average) },
    { name: "learner tokens/s", points: pairs(st, s.throughput.learner_tokens_per_s) },
  ], { yMin: 0 });
  barChart(document.getElementById("chart-staleness"),
    s.staleness.histogram.map(h => ({ label: String(h.staleness), value: h.count })),
    "versions behind the learner when sampled (whole run so far)");
  lineChart(document.getElementById("chart-staleness-steps"), [
    { name: "batch mean", points: pairs(st, s.staleness.batch_mean) },
    { name: "batch max", points: pairs(st, s.staleness.batch_max) },
  ], { yMin: 0 });
  lineChart(document.getElementById("chart-tool"), [
    { name: "seconds awaited per search", points: pairs(st, s.tool.seconds_per_search) },
  ], { yMin: 0, empty: "no search yet" });
  lineChart(document.getElementById("chart-tool-share"), [
    { name: "share of episode time awaiting the tool", points: pairs(st, s.tool.wait_share) },
  ], { yMin: 0 });
}

function showRun(r) {
  document.getElementById("run-name").textContent = r.name;
  document.title = `${r.name} · async-agent-rl`;
  const parts = [];
  parts.push(r.step === null ? "no step yet" : `step ${r.step}${r.total_steps ? ` of ${r.total_steps}` : ""}`);
  if (r.elapsed_s !== null) parts.push(`${Math.round(r.elapsed_s)} s of RL`);
  parts.push(r.finished ? "finished" : "running (or stopped before its summary)");
  if (r.summary && r.summary.exact_match_end !== undefined && r.summary.exact_match_start !== undefined)
    parts.push(`held-out EM ${fmt(r.summary.exact_match_start)} → ${fmt(r.summary.exact_match_end)}`);
  parts.push(`episodes kept for ${r.episode_steps} step(s)`);
  parts.push(`read ${new Date().toLocaleTimeString()}`);
  document.getElementById("run-state").textContent = parts.join(" · ");
  const skipped = Object.entries(r.skipped || {});
  const warn = document.getElementById("run-skipped");
  warn.hidden = !skipped.length;
  warn.textContent = skipped.length ? "skipped lines (not JSON): " + skipped.map(([f, n]) => `${f} ${n}`).join(", ") : "";
}

function filters() {
  const p = new URLSearchParams();
  const v = id => document.getElementById(id).value.trim();
  if (v("f-kind")) p.set("kind", v("f-kind"));
  if (v("f-reward")) p.set("reward", v("f-reward"));
  if (v("f-step-min")) p.set("step_min", v("f-step-min"));
  if (v("f-step-max")) p.set("step_max", v("f-step-max"));
  return p;
}

async function loadList() {
  const p = filters();
  p.set("offset", String(state.offset));
  p.set("limit", String(PAGE));
  let data;
  try {
    data = await getJSON("/api/episodes?" + p);
  } catch (e) {
    document.getElementById("episodes-count").textContent = `(${e.message})`;
    return;
  }
  state.total = data.total;
  const kindSel = document.getElementById("f-kind");
  const have = new Set([...kindSel.options].map(o => o.value));
  for (const k of data.kinds) if (!have.has(k)) kindSel.append(el("option", { value: k, text: k }));
  document.getElementById("episodes-count").textContent =
    `(${data.total} matching; steps ${data.steps ? data.steps.join("–") : "none yet"})`;
  document.getElementById("f-page").textContent =
    data.total ? `${state.offset + 1}–${Math.min(state.offset + PAGE, data.total)} of ${data.total}` : "";
  const key = JSON.stringify(data.episodes.map(e => [e.step, e.index, e.reward]));
  if (key === state.listKey) return;  // unchanged: keep the rows (and the hover) as they are
  state.listKey = key;
  const body = document.querySelector("#episode-list tbody");
  body.replaceChildren(...data.episodes.map(e => {
    const reward = el("td", { class: e.reward > 0 ? "reward-pos" : "reward-zero", text: fmt(e.reward) });
    const tr = el("tr", { "data-step": e.step, "data-index": e.index },
      el("td", { text: e.step }), el("td", { text: e.kind }), reward, el("td", { text: e.searches }),
      el("td", { text: e.turns }), el("td", { text: `${fmt(e.versions[0])}–${fmt(e.versions[1])}` }),
      el("td", { class: "q", title: e.question, text: e.question }));
    if (state.selected && state.selected[0] === e.step && state.selected[1] === e.index) tr.classList.add("selected");
    tr.addEventListener("click", () => openEpisode(e.step, e.index));
    return tr;
  }));
}

function versionClass(v) { return "run v" + (((v % 8) + 8) % 8); }

async function openEpisode(step, index) {
  state.selected = [step, index];
  for (const tr of document.querySelectorAll("#episode-list tbody tr"))
    tr.classList.toggle("selected", Number(tr.dataset.step) === step && Number(tr.dataset.index) === index);
  const box = document.getElementById("episode-detail");
  let ep;
  try {
    ep = await getJSON(`/api/episode?step=${step}&index=${index}`);
  } catch (e) {
    box.replaceChildren(el("p", { class: "warn", text: e.message }));
    return;
  }
  const comps = Object.entries(ep.reward_components || {}).map(([k, v]) => `${k} ${fmt(v)}`).join(", ");
  const head = el("div", { class: "ep-head" },
    el("div", {}, el("strong", { text: `step ${ep.step}` }), ` · ${ep.kind} · ${ep.trajectory_id}`),
    el("div", {}, "question: ", el("strong", { text: ep.question || "(none found in the prompt)" })),
    el("div", { text: `gold: ${(ep.gold || []).join(" | ")}` }),
    el("div", {}, "reward ", el("strong", { class: ep.reward > 0 ? "reward-pos" : "reward-zero", text: fmt(ep.reward) }),
      comps ? ` (${comps})` : "", ` · finish ${ep.finish} · ${ep.num_searches} search(es) · ${ep.num_turns} turn(s)`),
    el("div", { text: `tokens: prompt ${ep.prompt_tokens}, response ${ep.response_tokens} (${ep.generated_tokens} generated, with loss); policy versions ${ep.min_version}–${ep.max_version}` }));
  const versions = [...new Set((ep.turns || []).flatMap(t => (t.runs || []).map(r => r.version)))].sort((a, b) => a - b);
  const legend = el("div", { class: "versions-legend" }, "policy version of each generated token: ",
    ...versions.map(v => el("span", { class: versionClass(v), text: `v${v}` })));
  const turns = (ep.turns || []).map((t, i) => renderTurn(t, i));
  box.replaceChildren(head, legend, ...turns);
}

function renderTurn(t, i) {
  const kind = String(t.kind);
  const masked = t.loss === false && kind !== "prompt";
  const cls = `turn ${kind}${masked ? " masked" : ""}`;
  const tokens = t.tokens !== undefined ? ` · ${t.tokens} tokens` : "";
  if (kind === "prompt") {
    const d = el("details", {}, el("summary", { class: "label", text: `prompt${tokens} · no loss` }), el("pre", { text: t.text }));
    return el("div", { class: cls, "data-kind": kind }, d);
  }
  if (kind === "model") {
    const pre = el("pre");
    for (const r of t.runs || [{ text: t.text, version: 0, tokens: t.tokens }]) {
      pre.append(el("span", { class: versionClass(r.version), title: `policy version ${r.version}, ${r.tokens} token(s)`, text: r.text }));
    }
    const vs = (t.runs || []).map(r => r.version);
    const span = vs.length ? ` · versions ${Math.min(...vs)}–${Math.max(...vs)}` : "";
    return el("div", { class: cls, "data-kind": kind }, el("div", { class: "label", text: `model turn${tokens}${span} · loss` }), pre);
  }
  const labels = {
    search: "search query",
    answer: "answer",
    information: "retrieved information · masked (no loss)",
    observation: "inserted text · masked (no loss)",
  };
  return el("div", { class: cls, "data-kind": kind },
    el("div", { class: "label", text: (labels[kind] || kind) + tokens }), el("pre", { text: t.text }));
}

async function refresh() {
  try {
    const [run, series] = await Promise.all([getJSON("/api/run"), getJSON("/api/series")]);
    showRun(run);
    drawCharts(series);
  } catch (e) {
    document.getElementById("run-state").textContent = `cannot read the run: ${e.message}`;
  }
  await loadList();
}

function onFilter() {
  state.offset = 0;
  state.listKey = "";
  loadList();
}

document.addEventListener("DOMContentLoaded", () => {
  for (const id of ["f-kind", "f-reward", "f-step-min", "f-step-max"])
    document.getElementById(id).addEventListener("change", onFilter);
  document.getElementById("f-prev").addEventListener("click", () => {
    state.offset = Math.max(0, state.offset - PAGE); loadList();
  });
  document.getElementById("f-next").addEventListener("click", () => {
    if (state.offset + PAGE < state.total) { state.offset += PAGE; loadList(); }
  });
  document.getElementById("filters").addEventListener("submit", ev => ev.preventDefault());
  refresh();
  setInterval(refresh, REFRESH_MS);
});
