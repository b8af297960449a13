"""The tracker's status page: static HTML that polls /api/status every 2 s.

Layout: fits a 1280 px wide window with every column visible (long node ids
are cut to 12 hex digits, the full id is the cell's title; hardware and
liveness wrap). A dead node's row and its coverage cells are marked dead,
and its layers count as uncovered; a node caught lying (a verified report) is marked misbehaving the
same way, with the position it lied at, and covers nothing either. Everything a node advertised is escaped.
The peer trackers it syncs with (``--peer``) are listed with their state, last sync and record counts.
"""

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>meshnode tracker</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 20px; color: #1d232a; background: #f7f8fa; }
  h1 { font-size: 20px; margin: 0 0 4px; }
  h2 { font-size: 16px; margin: 20px 0 8px; }
  h2 .muted { font-size: 13px; font-weight: normal; }
  .muted { color: #6b7480; }
  small { font-size: 11px; color: #6b7480; font-weight: normal; }
  .model { overflow-wrap: anywhere; }
  .model { background: #fff; border: 1px solid #dde1e6; border-radius: 8px; padding: 12px 16px; margin: 12px 0; }
  .model.lost { border-color: #e0a3a3; }
  .model .scroll { overflow-x: auto; }
  table.cov { border-collapse: collapse; margin-top: 8px; }
  table.cov td, table.cov th { border: 1px solid #e3e6ea; width: 18px; height: 18px; padding: 0;
                               text-align: center; font-size: 10px; }
  table.cov th.node { width: auto; padding: 0 8px; text-align: left; font-family: monospace; font-size: 12px; }
  td.on { background: #2f8f5b; }
  td.lost { background: repeating-linear-gradient(45deg, #f3c4c4, #f3c4c4 3px, #fff 3px, #fff 6px); }
  td.gap { background: #f3c4c4; color: #b3261e; font-weight: 600; }
  table.nodes { border-collapse: collapse; width: 100%; background: #fff; }
  table.nodes th, table.nodes td { border-bottom: 1px solid #e3e6ea; padding: 5px 6px; text-align: left;
                                   font-size: 13px; vertical-align: top; }
  table.nodes th { white-space: normal; line-height: 1.2; }
  table.nodes td { white-space: nowrap; }
  table.nodes td.num, table.nodes th.num { text-align: right; }
  table.nodes td.wrap { white-space: normal; min-width: 120px; max-width: 220px; overflow-wrap: anywhere; }
  tr.dead td { background: #fbeaea; color: #7a4444; }
  tr.misbehaving td { background: #f6e3f7; color: #6a2d6e; }
  .badge.liar { background: #6a2d6e; color: #fff; }
  td.liar { background: repeating-linear-gradient(-45deg, #e2b6e5, #e2b6e5 3px, #fff 3px, #fff 6px); }
  .ok { color: #2f8f5b; font-weight: 600; } .bad { color: #b3261e; font-weight: 600; }
  .badge { display: inline-block; padding: 0 6px; border-radius: 4px; font-weight: 700; font-size: 12px; }
  .badge.ok { background: #e3f3ea; } .badge.bad { background: #b3261e; color: #fff; }
  code { font-size: 12px; }
</style>
</head>
<body>
<h1>meshnode tracker</h1>
<div class="muted">live view, refreshed every 2 s &middot; <span id="updated">loading&hellip;</span>
  &middot; <a href="/api/status">JSON</a></div>
<h2>Peer trackers <span class="muted" id="peers-count"></span></h2>
<table class="nodes" id="peers"><thead><tr><th>tracker</th><th>state</th><th class="num">last sync<br>
  <small>seconds ago</small></th><th class="num">its records</th><th class="num">records in</th>
  <th class="num">records out</th><th class="num">bytes</th></tr></thead><tbody></tbody></table>
<h2>Models <span class="muted" id="models-count"></span></h2>
<div id="models"></div>
<h2>Nodes <span class="muted" id="nodes-count"></span></h2>
<table class="nodes" id="nodes"><thead><tr>
  <th>node</th><th>endpoint</th><th>layers</th>
  <th class="num" title="single-session decode steps per second, measured by the node at start (warm, median)">decode
    tok/s<br><small>measured at start, 1 session</small></th>
  <th class="num" title="tokens per second of a 32-token prefill, measured by the node at start (warm,
    median of 3)">prefill tok/s<br><small>at start, 32-token prompt</small></th>
  <th>sessions<br><small>now</small></th><th class="num">tokens<br><small>served</small></th>
  <th class="num">errors</th><th class="num">mean step<br><small>ms, receive&rarr;result</small></th>
  <th class="num">mean batch<br><small>steps / decode</small></th>
  <th>hardware</th><th>liveness<br><small>probe every 2 s</small></th></tr></thead><tbody></tbody></table>
<script>
const ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
function esc(s) { return String(s).replace(/[&<>"']/g, c => ENTITIES[c]); }
function plural(n, word) { return n + " " + word + (n === 1 ? "" : "s"); }
function span(k, v, cls) {
  return "<span data-k='" + k + "'" + (cls ? " class='" + cls + "'" : "") + ">" + esc(v) + "</span>";
}
function cut(s, n) { return s.length > n ? s.slice(0, n - 1) + "\u2026" : s; }
function layers(a, b) { return b - a === 1 ? "layer " + a : "layers " + a + "&ndash;" + (b - 1); }
function lied(n) {
  const r = n && n.misbehaving_report;
  return r ? "lied at position " + r.pos_start + " (layers " + r.range[0] + ":" + r.range[1] + "), reported by " +
    r.reporter.slice(0, 12) + ", verified " + new Date(r.at_unix * 1000).toLocaleString() : "lied";
}
function model(m) {
  const dead = new Set(m.dead), liars = new Set(m.misbehaving || []);
  let rows = "<tr><th class='node'>layer</th>";
  for (let i = 0; i < m.n_layer; i++) rows += "<th>" + i + "</th>";
  rows += "</tr>";
  for (const id of m.nodes) {
    const gone = dead.has(id), liar = liars.has(id);
    rows += "<tr><th class='node' title='" + esc(id) + "'>" + esc(id.slice(0, 12)) +
      (gone ? " <span class='bad'>dead</span>" : "") + (liar ? " <span class='bad'>misbehaving</span>" : "") + "</th>";
    const node = nodesById[id];
    for (let i = 0; i < m.n_layer; i++) {
      const serves = node && node.range[0] <= i && i < node.range[1];
      rows += serves ? (liar ? "<td class='liar' title='misbehaving: " + esc(id) + "'></td>" :
                        gone ? "<td class='lost' title='dead: " + esc(id) + "'></td>" :
                                "<td class='on' title='" + esc(id) + "'></td>") : "<td></td>";
    }
    rows += "</tr>";
  }
  rows += "<tr><th class='node'>live replicas</th>";
  m.replicas.forEach(n => { rows += "<td class='" + (n ? "" : "gap") + "'>" + n + "</td>"; });
  rows += "</tr>";
  const state = m.covered ? "<span class='ok' data-k='coverage'>fully covered</span>" :
    "<span class='bad' data-k='coverage'>not covered</span>: " +
    m.gaps.map(g => layers(g[0], g[1])).join(", ") + " served by no live node";
  const alive = m.node_count - m.dead_count;
  const caught = (m.misbehaving || []).map(id => "<div class='bad' data-k='misbehaving'>misbehaving: <code>" +
    esc(id.slice(0, 12)) + "</code> " + esc(lied(nodesById[id])) + "; it covers nothing</div>").join("");
  return "<div class='model" + (m.covered ? "" : " lost") + "' data-model='" + esc(m.fingerprint) + "'><b>" +
    esc(m.name) + "</b> <code class='muted'>" + esc(m.fingerprint.slice(0, 16)) + "&hellip;</code> &middot; " +
    plural(m.n_layer, "layer") + " &middot; " + plural(alive, "live node") +
    (m.dead_count ? " (+" + m.dead_count + " dead)" : "") + " &middot; " + state + " &middot; " +
    "<span data-k='active_sessions'>" + plural(m.active_sessions, "active session") + "</span>" + caught +
    "<div class='scroll'><table class='cov'>" + rows + "</table></div></div>";
}
function node(n) {
  const dev = n.devices.map(d => d.type).join("+");
  const stepped = n.steps_total > 0;
  const live = (n.alive ? "<span class='badge ok' data-k='liveness'>alive</span>" :
    "<span class='badge bad' data-k='liveness'>dead</span>") + (n.misbehaving ? " <span class='badge liar' " +
    "data-k='misbehaving' title='" + esc(lied(n)) + "'>misbehaving</span>" : "");
  const cls = n.misbehaving ? " class='misbehaving'" : (n.alive ? "" : " class='dead'");
  return "<tr data-node='" + esc(n.node_id) + "'" + cls + ">" +
    "<td title='" + esc(n.node_id) + "'><code>" + esc(n.node_id.slice(0, 12)) + "</code></td>" +
    "<td title='" + esc(n.endpoints.join(", ")) + "'>" + esc(cut(n.endpoints[0] || "", 28)) + "</td>" +
    "<td>" + n.range[0] + ":" + n.range[1] + " <small>" + esc(n.role) + "</small>" +
    (n.insecure ? " <span class='badge bad' data-k='insecure' title='--insecure: plaintext streams, not pinned " +
      "to its node id'>plaintext</span>" : "") + "</td>" +
    "<td class='num'>" + n.decode_tokens_per_second + "</td><td class='num'>" + n.prefill_tokens_per_second + "</td>" +
    "<td>" + span("live_sessions", n.live_sessions) + " live / " + span("free_sessions", n.free_sessions) +
    " free<br>" + span("detached_sessions", n.detached_sessions, n.detached_sessions ? "bad" : "") + " detached" +
    (n.serving ? "" : " <span class='bad'>draining</span>") + "</td>" +
    "<td class='num'>" + span("tokens_total", n.tokens_total) + "</td>" +
    "<td class='num'>" + span("errors_total", n.errors_total, n.errors_total ? "bad" : "") + "</td>" +
    "<td class='num'>" + (stepped ? span("step_ms_mean", n.step_ms_mean) : "&ndash;") + "</td>" +
    "<td class='num'>" + (stepped ? span("mean_batch", n.mean_batch) : "&ndash;") + "</td>" +
    "<td class='wrap'>" + esc(n.cpu) + " &middot; " + plural(n.cores, "core") + " &middot; " +
    (n.memory_total_bytes / 2**30).toFixed(1) + " GiB &middot; " + esc(dev) + "</td>" +
    "<td class='wrap'>" + live + " <small data-k='liveness_reason'>" + esc(n.liveness_reason) + "</small><br>" +
    (n.misbehaving ? "<small class='bad' data-k='lied'>" + esc(lied(n)) + "</small><br>" : "") +
    "<small>counters " + n.counters_age_seconds + " s old (" + esc(n.counters_source) + ")</small></td></tr>";
}
function peer(p) {
  return "<tr data-peer='" + esc(p.url) + "'><td>" + esc(p.url) + "</td><td>" +
    (p.ok ? "<span class='badge ok' data-k='peer_state'>in sync</span>" :
            "<span class='badge bad' data-k='peer_state'>unreachable</span> <small>" + esc(cut(p.error, 80)) +
            "</small>") + "</td><td class='num'>" + (p.last_sync_seconds_ago === null ? "&ndash;" :
    span("last_sync", p.last_sync_seconds_ago)) + "</td><td class='num'>" + span("their_records", p.their_records) +
    "</td><td class='num'>" + p.records_in + "</td><td class='num'>" + p.records_out + "</td><td class='num'>" +
    p.bytes + "</td></tr>";
}
let nodesById = {};
async function refresh() {
  try {
    const r = await fetch("/api/status", {cache: "no-store"});
    const s = await r.json();
    nodesById = Object.fromEntries(s.nodes.map(n => [n.node_id, n]));
    const dead = s.nodes.filter(n => !n.alive).length;
    document.getElementById("models-count").textContent = "· " + plural(s.models.length, "model");
    document.getElementById("nodes-count").textContent = "· " + plural(s.nodes.length, "node") +
      (dead ? " (" + dead + " dead)" : "") + (s.omitted.nodes ? " · " + s.omitted.nodes + " more not shown" : "");
    document.getElementById("models").innerHTML = s.models.length ? s.models.map(model).join("") :
      "<p class='muted'>no nodes registered</p>";
    document.querySelector("#nodes tbody").innerHTML = s.nodes.map(node).join("");
    const peers = s.peers || [];
    document.getElementById("peers-count").textContent = "· " + (peers.length ? plural(peers.length, "peer") +
      " · " + plural(s.records || 0, "record") + " held here" : "none (--peer URL)");
    document.querySelector("#peers tbody").innerHTML = peers.map(peer).join("");
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.ready = "1";
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
  } catch (e) {
    document.getElementById("updated").textContent = "tracker unreachable: " + e;
  }
}
refresh();
setInterval(refresh, 2000);
</script>
</body>
</html>
"""
