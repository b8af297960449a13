"""The tracker's status page: static HTML that polls /api/status every 2 s."""

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>meshnode tracker</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1d232a; background: #f7f8fa; }
  h1 { font-size: 20px; margin: 0 0 4px; }
  h2 { font-size: 16px; margin: 24px 0 8px; }
  .muted { color: #6b7480; }
  .model { background: #fff; border: 1px solid #dde1e6; border-radius: 8px; padding: 12px 16px; margin: 12px 0; }
  table.cov { border-collapse: collapse; margin-top: 8px; }
  table.cov td, table.cov th { border: 1px solid #e3e6ea; width: 18px; height: 18px; padding: 0;
                               text-align: center; font-size: 10px; }
  table.cov th.node { width: auto; padding: 0 8px; text-align: left; font-family: monospace; font-size: 12px; }
  td.on { background: #2f8f5b; }
  td.gap { background: #f3c4c4; }
  table.nodes { border-collapse: collapse; width: 100%; background: #fff; }
  table.nodes th, table.nodes td { border-bottom: 1px solid #e3e6ea; padding: 6px 8px; text-align: left;
                                   white-space: nowrap; font-size: 13px; }
  table.nodes td.num { text-align: right; }
  table.nodes td.hw { white-space: normal; min-width: 180px; }
  .ok { color: #2f8f5b; font-weight: 600; } .bad { color: #b3261e; font-weight: 600; }
  code { font-size: 12px; }
</style>
</head>
<body>
<h1>meshnode tracker</h1>
<div class="muted">live view, refreshed every 2 s &middot; <span id="updated">loading&hellip;</span>
  &middot; <a href="/api/status">JSON</a></div>
<h2>Models</h2>
<div id="models"></div>
<h2>Nodes</h2>
<table class="nodes" id="nodes"><thead><tr>
  <th>node</th><th>endpoint</th><th>layers</th><th>role</th><th>decode tok/s</th><th>prefill tok/s</th>
  <th>sessions</th><th>tokens served</th><th>errors</th><th>mean step</th><th>mean batch</th>
  <th>hardware</th><th>liveness</th></tr></thead><tbody></tbody></table>
<script>
function esc(s) { return String(s).replace(/[&<>"]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c])); }
function model(m) {
  let rows = "<tr><th class='node'>layer</th>";
  for (let i = 0; i < m.n_layer; i++) rows += "<th>" + i + "</th>";
  rows += "</tr>";
  for (const id of m.nodes) {
    rows += "<tr><th class='node'>" + esc(id.slice(0, 12)) + "</th>";
    m.coverage.forEach(layer => {
      rows += layer.includes(id) ? "<td class='on' title='" + esc(id) + "'></td>" : "<td></td>";
    });
    rows += "</tr>";
  }
  rows += "<tr><th class='node'>replicas</th>";
  m.coverage.forEach(layer => { rows += "<td class='" + (layer.length ? "" : "gap") + "'>" + layer.length + "</td>"; });
  rows += "</tr>";
  return "<div class='model' data-model='" + esc(m.fingerprint) + "'><b>" + esc(m.name) + "</b> <code class='muted'>" +
    esc(m.fingerprint.slice(0, 16)) + "&hellip;</code> &middot; " + m.n_layer + " layers &middot; " +
    (m.covered ? "<span class='ok'>fully covered</span>" : "<span class='bad'>gaps</span>") +
    " &middot; " + m.active_sessions + " active sessions<table class='cov'>" + rows + "</table></div>";
}
function node(n) {
  const dev = n.devices.map(d => d.type).join("+");
  return "<tr data-node='" + esc(n.node_id) + "'><td><code>" + esc(n.node_id) + "</code></td><td>" +
    esc(n.endpoints.join(", ")) + "</td><td>" + n.range[0] + ":" + n.range[1] + "</td><td>" + esc(n.role) +
    "</td><td>" + n.decode_tokens_per_second + "</td><td>" + n.prefill_tokens_per_second + "</td><td>" +
    "<span data-k='live_sessions'>" + n.live_sessions + "</span> live / <span data-k='free_sessions'>" +
    n.free_sessions + "</span> free / <span data-k='detached_sessions'" + (n.detached_sessions ? " class='bad'" : "") +
    ">" + n.detached_sessions + "</span> detached" + (n.serving ? "" : " <span class='bad'>draining</span>") + "</td>" +
    "<td class='num' data-k='tokens_total'>" + n.tokens_total + "</td><td data-k='errors_total' class='num" +
    (n.errors_total ? " bad" : "") + "'" + ">" + n.errors_total + "</td><td class='num'><span data-k='step_ms_mean'>" +
    n.step_ms_mean + "</span> ms</td><td class='num' data-k='mean_batch'>" + n.mean_batch + "</td><td class='hw'>" +
    esc(n.cpu) + " &middot; " + n.cores +
    " cores &middot; " + (n.memory_total_bytes / 2**30).toFixed(1) + " GiB &middot; " + esc(dev) + "</td><td>" +
    (n.alive ? "<span class='ok'>alive</span>" : "<span class='bad'>stale</span>") + " (" +
    n.last_seen_seconds_ago + " s ago)</td></tr>";
}
async function refresh() {
  try {
    const r = await fetch("/api/status", {cache: "no-store"});
    const s = await r.json();
    document.getElementById("models").innerHTML = s.models.length ? s.models.map(model).join("") :
      "<p class='muted'>no nodes registered</p>";
    document.querySelector("#nodes tbody").innerHTML = s.nodes.map(node).join("");
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.ready = "1";
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
