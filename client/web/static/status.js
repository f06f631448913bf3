// The status page: polls /api/status and redraws; the flow graph is inline SVG drawn here (no library).
"use strict";
const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const REFRESH_MS = 2000;

function cell(row, text) { const td = document.createElement("td"); td.textContent = text; row.appendChild(td); }
function fmt(x, digits = 0) { return x === null || x === undefined ? "–" : Number(x).toFixed(digits); }
function svg(tag, attrs, parent) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

function drawPeers(peers) {
  const body = $("peers");
  body.textContent = "";
  for (const p of peers) {
    const row = document.createElement("tr");
    row.className = "peer";
    row.dataset.peerId = p.peer_id;
    cell(row, p.name); cell(row, "…" + p.peer_id.slice(-10)); cell(row, p.state);
    cell(row, `${p.range[0]}:${p.range[1]}`); cell(row, fmt(p.decode_tokens_s)); cell(row, fmt(p.prefill_tokens_s));
    cell(row, `${p.free_cache_tokens} / ${p.cache_tokens_total}`);
    const kv = p.kv_cache;
    cell(row, kv ? `${kv.used_blocks} / ${kv.shared_blocks} / ${kv.free_blocks}` : "–");
    cell(row, kv && kv.prefix_tokens_looked_up ? `${(100 * kv.prefix_hit_rate).toFixed(0)}%` : "–");
    cell(row, p.active_sessions + (p.live ? "" : " (record)"));
    body.appendChild(row);
  }
}

function drawCoverage(coverage, missing) {
  const box = $("coverage");
  box.textContent = "";
  const top = Math.max(1, ...coverage);
  coverage.forEach((n, layer) => {
    const s = document.createElement("span");
    s.title = `layer ${layer}: ${n} peer(s)`;
    s.style.background = n === 0 ? "#c62828" : `rgba(47, 111, 237, ${0.35 + 0.65 * n / top})`;
    box.appendChild(s);
  });
  $("missing").textContent = missing.length ? `missing layers: ${missing.join(", ")}` : `all ${coverage.length} layers covered`;
}

// Nodes in columns by the first layer they hold; the client is drawn twice, as source (left) and sink (right).
function drawFlows(data) {
  const box = $("flow-graph");
  box.textContent = "";
  const plan = data.plan;
  if (!plan) { box.textContent = "no plan published yet (the elected planner publishes one shortly after peers join)"; return; }
  const names = Object.fromEntries(data.peers.map((p) => [p.peer_id, p.name]));
  const placement = plan.placement || {};
  const starts = [...new Set(Object.values(placement).map((r) => r[0]))].sort((a, b) => a - b);
  const W = 960, colW = 120, nodeH = 44, gapY = 34;
  const columns = starts.length + 2;
  const xOf = (col) => 20 + col * ((W - 40 - colW) / (columns - 1));
  const byColumn = starts.map((s) => Object.keys(placement).filter((id) => placement[id][0] === s));
  const tallest = Math.max(1, ...byColumn.map((c) => c.length));
  const H = Math.max(140, tallest * (nodeH + gapY) + 40);
  const pos = { source: { x: xOf(0), y: H / 2 - nodeH / 2 }, sink: { x: xOf(columns - 1), y: H / 2 - nodeH / 2 } };
  byColumn.forEach((ids, i) => {
    const top = H / 2 - (ids.length * (nodeH + gapY) - gapY) / 2;
    ids.forEach((id, j) => { pos[id] = { x: xOf(i + 1), y: top + j * (nodeH + gapY) }; });
  });
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "plan flow graph" }, box);
  const biggest = Math.max(1e-9, ...plan.flows.map((f) => f.tokens_s));
  const labels = [];  // drawn last, over the nodes and edges
  for (const f of plan.flows) {
    const a = pos[f.src], b = pos[f.dst];
    if (!a || !b) continue;
    const x1 = a.x + colW, y1 = a.y + nodeH / 2, x2 = b.x, y2 = b.y + nodeH / 2, mx = (x1 + x2) / 2;
    const path = svg("path", { class: "flow", d: `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2},${y2}`,
      "stroke-width": (2 + 16 * f.tokens_s / biggest).toFixed(1) }, root);
    path.dataset.src = f.src; path.dataset.dst = f.dst;
    svg("title", {}, path).textContent = `${f.src_name} → ${f.dst_name}: ${fmt(f.tokens_s, 1)} tokens/s`;
    labels.push([mx, (y1 + y2) / 2 - 12, `${fmt(f.tokens_s, 1)} tok/s`]);
  }
  const drawNode = (id, title, sub, client) => {
    const p = pos[id];
    const g = svg("g", { class: "node" + (client ? " client" : ""), transform: `translate(${p.x},${p.y})` }, root);
    g.dataset.node = id;
    svg("rect", { width: colW, height: nodeH }, g);
    svg("text", { x: colW / 2, y: 18, "text-anchor": "middle" }, g).textContent = title;
    svg("text", { x: colW / 2, y: 34, "text-anchor": "middle" }, g).textContent = sub;
  };
  drawNode("source", "client", "embeddings", true);
  drawNode("sink", "client", "LM head", true);
  for (const [id, r] of Object.entries(placement)) drawNode(id, names[id] || id.slice(-8), `layers ${r[0]}:${r[1]}`, false);
  for (const [x, y, text] of labels) {
    svg("text", { class: "flow-label", x, y, "text-anchor": "middle" }, root).textContent = text;
  }
}

function drawRecent(recent) {
  const body = $("recent");
  body.textContent = "";
  for (const r of recent.slice().reverse()) {
    const row = document.createElement("tr");
    cell(row, new Date(r.at * 1000).toLocaleTimeString()); cell(row, r.kind);
    cell(row, r.route.map((s) => `${s.name} ${s.layers[0]}:${s.layers[1]}`).join(" → ") + (r.failovers ? ` (${r.failovers} failovers)` : ""));
    cell(row, r.completion_tokens); cell(row, r.ttft_s === null ? "–" : fmt(r.ttft_s, 2) + " s"); cell(row, r.finish_reason);
    body.appendChild(row);
  }
}

async function refresh() {
  try {
    const response = await fetch("/api/status", { cache: "no-store" });
    const data = await response.json();
    if (!response.ok) throw new Error(data.error ? data.error.message : `HTTP ${response.status}`);
    $("model").textContent = data.model;
    $("serving").textContent = data.peers.filter((p) => p.state === "serving").length + " / " + data.peers.length;
    $("planner").textContent = data.planner ? data.planner.name : "none elected";
    $("epoch").textContent = data.plan ? `${data.plan.epoch} (${data.plan.method})` : "–";
    $("max-flow").textContent = data.plan ? fmt(data.plan.max_flow_tokens_s, 1) + " tok/s" : "–";
    $("generations").textContent = `${data.server.active_generations} / ${data.server.queued_generations}`;
    drawCoverage(data.coverage, data.missing_layers);
    drawPeers(data.peers);
    drawFlows(data);
    drawRecent(data.recent_requests);
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (error) {
    $("updated").textContent = "status unavailable: " + error.message;
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}
refresh();
