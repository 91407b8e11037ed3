// The live cache dashboard: reads /v1/stats/stream (one snapshot a second) with fetch(),
// so an API key can travel in a header, keeps the last few minutes of each instance's
// per-tier block counts and prefix-hit ratio, and draws them with plain SVG. Counters
// are turned into per-second rates from consecutive snapshots. Reconnects on its own.
"use strict";

const Dashboard = (() => {
  const $ = (id) => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";
  const KEEP = 180;  // points per series (3 minutes)
  const COLORS = { device: "#2f6fde", host: "#c4320a", disk: "#6941c6", cached: "#98a2b3", hit: "#067647" };
  const series = new Map();  // instance id -> {points: [{t, tiers: {tier: {used, cached, total}}, hit}]}
  let previous = null;
  let snapshots = 0;

  function fmt(n, digits) {
    if (n === null || n === undefined || Number.isNaN(n)) return "-";
    if (typeof n !== "number") return String(n);
    return digits === undefined ? String(Math.round(n)) : n.toFixed(digits);
  }

  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return n.toFixed(i ? 1 : 0) + " " + units[i];
  }

  function rate(now, before, dt) {
    if (before === undefined || before === null || !(dt > 0)) return null;
    return Math.max(now - before, 0) / dt;
  }

  function setState(node, text, cls) {
    node.textContent = text;
    node.className = "state-" + (cls || text);
  }

  function row(table, cells, header) {
    const tr = MS.el("tr");
    for (const c of cells) tr.appendChild(MS.el(header ? "th" : "td", {}, c));
    table.appendChild(tr);
    return tr;
  }

  // A line chart of several series in an SVG; values: {name: [numbers]}, max: y range.
  function chart(svg, values, max) {
    svg.replaceChildren();
    const w = 400, h = 120;
    svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
    svg.setAttribute("preserveAspectRatio", "none");
    for (const frac of [0.25, 0.5, 0.75]) {
      const line = document.createElementNS(SVG, "line");
      line.setAttribute("x1", 0); line.setAttribute("x2", w);
      line.setAttribute("y1", h * frac); line.setAttribute("y2", h * frac);
      line.setAttribute("stroke", "#eaecf0");
      svg.appendChild(line);
    }
    const top = max > 0 ? max : 1;
    for (const [name, ys] of Object.entries(values)) {
      if (!ys.length) continue;
      const step = w / Math.max(KEEP - 1, 1);
      const x0 = w - (ys.length - 1) * step;
      const pts = ys.map((y, i) => `${(x0 + i * step).toFixed(1)},${(h - 2 - (h - 4) * Math.min(y / top, 1)).toFixed(1)}`);
      const path = document.createElementNS(SVG, "polyline");
      path.setAttribute("points", pts.join(" "));
      path.setAttribute("fill", "none");
      path.setAttribute("stroke", COLORS[name.split(" ")[0]] || "#333");
      path.setAttribute("stroke-width", "1.5");
      if (name.endsWith("cached")) path.setAttribute("stroke-dasharray", "4 3");
      path.setAttribute("data-series", name);
      svg.appendChild(path);
    }
  }

  function legend(names) {
    const div = MS.el("div", { class: "legend" });
    for (const name of names) {
      const span = MS.el("span");
      const swatch = MS.el("i");
      swatch.style.background = COLORS[name.split(" ")[0]] || "#333";
      span.appendChild(swatch);
      span.appendChild(document.createTextNode(name));
      div.appendChild(span);
    }
    return div;
  }

  function instanceCard(inst, before, dt) {
    const card = MS.el("div", { class: "card", id: "inst-" + inst.id, "data-state": inst.state });
    const title = MS.el("h2");
    title.appendChild(document.createTextNode(`instance ${inst.id} · ${inst.role} · ${inst.node} · `));
    const state = MS.el("span");
    setState(state, inst.state);
    title.appendChild(state);
    if (inst.restarts) title.appendChild(document.createTextNode(` · ${inst.restarts} restart(s)`));
    card.appendChild(title);

    const table = MS.el("table");
    row(table, ["tier", "used", "cached", "free", "total"], true);
    for (const [tier, b] of Object.entries(inst.blocks)) {
      const tr = row(table, [tier, fmt(b.used), fmt(b.cached), fmt(b.free), fmt(b.total)]);
      tr.setAttribute("data-tier", tier);
      tr.children[1].id = `blocks-${inst.id}-${tier}-used`;
      tr.children[2].id = `blocks-${inst.id}-${tier}-cached`;
    }
    card.appendChild(table);

    const evictions = before ? rate(inst.evictions_total, before.evictions_total, dt) : null;
    const saves = before ? rate(inst.saves_total, before.saves_total, dt) : null;
    const dPrompt = before ? inst.prompt_tokens_total - before.prompt_tokens_total : 0;
    const dCached = before ? inst.cached_tokens_total - before.cached_tokens_total : 0;
    const facts = MS.el("table");
    row(facts, ["running", fmt(inst.running), "waiting", fmt(inst.waiting)]);
    row(facts, ["prefix-hit ratio", fmt(inst.prefix_hit_ratio, 3),
                "last second", dPrompt > 0 ? fmt(dCached / dPrompt, 3) : "-"]);
    row(facts, ["evictions/s", fmt(evictions, 1), "saves/s", fmt(saves, 1)]);
    row(facts, ["dropped unsaved", fmt(inst.dropped_unsaved_total), "save queue", fmt(inst.save_queue)]);
    if (inst.pd.handoffs || inst.role === "prefill") {
      row(facts, ["PD handoffs", fmt(inst.pd.handoffs), "sent", bytes(inst.pd.bytes_sent)]);
    }
    card.appendChild(facts);

    const points = (series.get(inst.id) || { points: [] }).points;
    const tiers = Object.keys(inst.blocks);
    const blockSeries = {};
    let max = 1;
    for (const tier of tiers) {
      blockSeries[tier + " used"] = points.map((p) => (p.tiers[tier] || {}).used || 0);
      blockSeries[tier + " cached"] = points.map((p) => (p.tiers[tier] || {}).cached || 0);
      max = Math.max(max, inst.blocks[tier].total || 0);
    }
    card.appendChild(MS.el("div", { class: "muted" }, "blocks per tier (solid: used, dashed: cached; y: up to the largest tier)"));
    const svgBlocks = document.createElementNS(SVG, "svg");
    svgBlocks.setAttribute("class", "chart");
    svgBlocks.setAttribute("id", `chart-blocks-${inst.id}`);
    chart(svgBlocks, blockSeries, max);
    card.appendChild(svgBlocks);
    card.appendChild(legend(Object.keys(blockSeries)));
    card.appendChild(MS.el("div", { class: "muted" }, "prefix-hit ratio (0..1)"));
    const svgHit = document.createElementNS(SVG, "svg");
    svgHit.setAttribute("class", "chart");
    svgHit.setAttribute("id", `chart-hit-${inst.id}`);
    chart(svgHit, { "hit ratio": points.map((p) => p.hit) }, 1);
    card.appendChild(svgHit);
    return card;
  }

  function histogramRows(table, name, hist) {
    const mean = hist.count ? (hist.sum / hist.count) * 1000 : null;
    row(table, [name, `${hist.count} requests`, "mean " + fmt(mean, 1) + " ms"]);
    let prev = 0;
    let prevBound = 0;
    for (const [le, cum] of hist.buckets) {
      const n = cum - prev;
      if (n > 0) row(table, ["", `${le === "+Inf" ? ">" + prevBound : "≤ " + le} s`, String(n)]);
      prev = cum;
      if (le !== "+Inf") prevBound = le;
    }
  }

  function render(snap) {
    const dt = previous ? snap.time - previous.time : 0;
    const before = new Map(((previous && previous.instances) || []).map((i) => [i.id, i]));
    setState($("status"), snap.status);
    $("updated").textContent = "at " + new Date(snap.time * 1000).toLocaleTimeString() +
      ` · ${snap.requests_in_flight} request(s) in flight`;

    for (const inst of snap.instances) {
      const s = series.get(inst.id) || { points: [] };
      const tiers = {};
      for (const [tier, b] of Object.entries(inst.blocks)) tiers[tier] = { used: b.used, cached: b.cached };
      s.points.push({ t: snap.time, tiers, hit: inst.prefix_hit_ratio });
      if (s.points.length > KEEP) s.points.shift();
      series.set(inst.id, s);
    }
    const box = $("instances");
    box.replaceChildren(...snap.instances.map((inst) => instanceCard(inst, before.get(inst.id), dt)));

    const router = $("router");
    router.replaceChildren();
    row(router, ["reason", "total", "per second"], true);
    const prevDecisions = (previous && previous.router.decisions) || {};
    for (const [reason, n] of Object.entries(snap.router.decisions || {})) {
      row(router, [reason, String(n), fmt(rate(n, prevDecisions[reason], dt), 2)]);
    }
    router.appendChild(MS.el("caption", { class: "muted" }, "policy: " + (snap.router.policy || "-")));

    const pd = $("pd");
    pd.replaceChildren();
    row(pd, ["transfers", String(snap.pd.transfers)]);
    row(pd, ["blocks", String(snap.pd.blocks)]);
    row(pd, ["bytes", bytes(snap.pd.bytes)]);
    row(pd, ["bytes/s", previous ? bytes(rate(snap.pd.bytes, previous.pd.bytes, dt) || 0) : "-"]);

    const latency = $("latency");
    latency.replaceChildren();
    histogramRows(latency, "TTFT", snap.latency.ttft_seconds);
    histogramRows(latency, "TBT", snap.latency.tbt_seconds);

    const slo = $("slo");
    slo.replaceChildren();
    for (const [name, s] of Object.entries(snap.slo)) {
      row(slo, [name.toUpperCase() + " SLO", `${s.met} met, ${s.missed} missed`,
                s.attainment === null ? "-" : (100 * s.attainment).toFixed(1) + " %"]);
    }
    row(slo, ["admission", snap.admission.mode || "-", `${snap.admission.held} held`]);
    for (const [reason, n] of Object.entries(snap.admission.rejections || {})) row(slo, ["rejected", reason, String(n)]);
    previous = snap;
    snapshots += 1;
    document.body.setAttribute("data-snapshots", String(snapshots));
  }

  async function connect() {
    for (;;) {
      try {
        const r = await fetch("/v1/stats/stream", { headers: MS.headers(), cache: "no-store" });
        if (!r.ok) throw new Error(await MS.errorText(r));
        setState($("conn"), "live");
        await MS.readSSE(r, (data) => render(JSON.parse(data)));
        throw new Error("stream ended");
      } catch (e) {
        setState($("conn"), "reconnecting", "reconnecting");
        $("conn").title = e.message;
        await new Promise((res) => setTimeout(res, 1000));
      }
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    MS.bindKeyField($("api-key"));
    connect();
  });
  return { render };
})();
window.memserveDashboard = Dashboard;
