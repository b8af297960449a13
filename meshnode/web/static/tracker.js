// The tracker's page: the mesh map and charts (map.js), the nodes and peer trackers as tables.
// Polls /api/status every 2 s and /api/series every 5 s; everything a node advertised is set as text.
"use strict";

(() => {
  const {el, plural, short, layers, lied} = MeshMap;
  const $ = id => document.getElementById(id);
  function cut(s, n) { return s.length > n ? s.slice(0, n - 1) + "\u2026" : s; }
  function k(key, value, cls) { return el("span", {"data-k": key, class: cls || null}, String(value)); }
  const DASH = "\u2013";

  // the per-layer grid of a model, in a <details> kept across refreshes (its open state with it)
  function grid(m, tail, byId) {
    let details = tail.querySelector("details.grid");
    if (!details) {
      details = el("details", {class: "grid"}, el("summary", {}, "per-layer table"), el("div", {class: "scroll"}));
      tail.append(details);
    }
    const dead = new Set(m.dead), liars = new Set(m.misbehaving || []);
    const table = el("table", {class: "cov"});
    const head = el("tr", {}, el("th", {class: "node"}, "layer"));
    for (let i = 0; i < m.n_layer; i++) head.append(el("th", {}, String(i)));
    table.append(head);
    for (const id of m.nodes) {
      const gone = dead.has(id), liar = liars.has(id), node = byId[id];
      const tr = el("tr", {}, el("th", {class: "node", title: id}, short(id),
        gone ? " " : null, gone ? el("span", {class: "bad"}, "dead") : null,
        liar ? " " : null, liar ? el("span", {class: "bad"}, "misbehaving") : null));
      for (let i = 0; i < m.n_layer; i++) {
        const serves = node && node.range[0] <= i && i < node.range[1];
        tr.append(!serves ? el("td") : liar ? el("td", {class: "liar", title: "misbehaving: " + id}) :
          gone ? el("td", {class: "lost", title: "dead: " + id}) : el("td", {class: "on", title: id}));
      }
      table.append(tr);
    }
    const replicas = el("tr", {}, el("th", {class: "node"}, "live replicas"));
    m.replicas.forEach(n => replicas.append(el("td", {class: n ? null : "gap"}, String(n))));
    table.append(replicas);
    details.querySelector(".scroll").replaceChildren(table);
  }

  function node(n) {
    const dev = n.devices.map(d => d.type).join("+");
    const stepped = n.steps_total > 0;
    const cls = n.misbehaving ? "misbehaving" : (n.alive ? null : "dead");
    const liveness = el("td", {class: "wrap"},
      n.alive ? el("span", {class: "badge ok", "data-k": "liveness"}, "alive") :
                el("span", {class: "badge bad", "data-k": "liveness"}, "dead"),
      n.misbehaving ? " " : null,
      n.misbehaving ? el("span", {class: "badge liar", "data-k": "misbehaving", title: lied(n)}, "misbehaving") : null,
      " ", el("small", {"data-k": "liveness_reason"}, n.liveness_reason), el("br"),
      n.misbehaving ? el("small", {class: "bad", "data-k": "lied"}, lied(n)) : null, n.misbehaving ? el("br") : null,
      el("small", {}, "counters " + n.counters_age_seconds + " s old (" + n.counters_source + ")"));
    return el("tr", {"data-node": n.node_id, class: cls},
      el("td", {title: n.node_id}, el("code", {}, short(n.node_id))),
      el("td", {title: n.endpoints.join(", ")}, cut(n.endpoints[0] || "", 28)),
      el("td", {}, n.range[0] + ":" + n.range[1] + " ", el("small", {}, n.role),
         n.insecure ? " " : null, n.insecure ? el("span", {class: "badge bad", "data-k": "insecure",
           title: "--insecure: plaintext streams, not pinned to its node id"}, "plaintext") : null),
      el("td", {class: "num"}, String(n.decode_tokens_per_second)),
      el("td", {class: "num"}, String(n.prefill_tokens_per_second)),
      el("td", {}, k("live_sessions", n.live_sessions), " live / ", k("free_sessions", n.free_sessions), " free",
         el("br"), k("detached_sessions", n.detached_sessions, n.detached_sessions ? "bad" : ""), " detached",
         n.serving ? null : " ", n.serving ? null : el("span", {class: "bad"}, "draining")),
      el("td", {class: "num"}, k("tokens_total", n.tokens_total)),
      el("td", {class: "num"}, k("errors_total", n.errors_total, n.errors_total ? "bad" : "")),
      el("td", {class: "num"}, stepped ? k("step_ms_mean", n.step_ms_mean) : DASH),
      el("td", {class: "num"}, stepped ? k("mean_batch", n.mean_batch) : DASH),
      el("td", {class: "wrap"}, n.cpu + " \u00b7 " + plural(n.cores, "core") + " \u00b7 " +
         (n.memory_total_bytes / 2 ** 30).toFixed(1) + " GiB \u00b7 " + dev),
      liveness);
  }

  function peer(p) {
    return el("tr", {"data-peer": p.url}, el("td", {}, p.url),
      el("td", {}, p.ok ? el("span", {class: "badge ok", "data-k": "peer_state"}, "in sync") :
        el("span", {class: "badge bad", "data-k": "peer_state"}, "unreachable"), p.ok ? null : " ",
        p.ok ? null : el("small", {}, cut(p.error, 80))),
      el("td", {class: "num"}, p.last_sync_seconds_ago === null ? DASH : k("last_sync", p.last_sync_seconds_ago)),
      el("td", {class: "num"}, k("their_records", p.their_records)), el("td", {class: "num"}, String(p.records_in)),
      el("td", {class: "num"}, String(p.records_out)), el("td", {class: "num"}, String(p.bytes)));
  }

  const cards = new MeshMap.Cards($("models"), grid);
  let lastSeries = 0;

  async function series() {
    lastSeries = Date.now();
    try {
      const r = await fetch("/api/series", {cache: "no-store"});
      if (!r.ok) return;
      cards.charts(await r.json());
      document.body.dataset.series = String(Number(document.body.dataset.series || 0) + 1);
    } catch (e) {
      // the status poll says when the tracker is unreachable
    }
  }

  async function refresh() {
    try {
      const r = await fetch("/api/status", {cache: "no-store"});
      const s = await r.json();
      const dead = s.nodes.filter(n => !n.alive).length;
      $("models-count").textContent = "\u00b7 " + plural(s.models.length, "model");
      $("nodes-count").textContent = "\u00b7 " + plural(s.nodes.length, "node") +
        (dead ? " (" + dead + " dead)" : "") + (s.omitted.nodes ? " \u00b7 " + s.omitted.nodes + " more not shown" : "");
      cards.update(s);
      document.querySelector("#nodes tbody").replaceChildren(...s.nodes.map(node));
      const peers = s.peers || [];
      $("peers-count").textContent = "\u00b7 " + (peers.length ? plural(peers.length, "peer") +
        " \u00b7 " + plural(s.records || 0, "record") + " held here" : "none (--peer URL)");
      document.querySelector("#peers tbody").replaceChildren(...peers.map(peer));
      $("updated").textContent = "updated " + new Date().toLocaleTimeString();
      if (Date.now() - lastSeries >= 4900 || !cards.series) await series();
      else if (cards.series) cards.charts(cards.series);  // new cards get their chart at once
      document.body.dataset.ready = "1";
      document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
    } catch (e) {
      $("updated").textContent = "tracker unreachable: " + e;
    }
  }
  refresh();
  setInterval(refresh, 1000);  // a node the probes find dead shows within a second of it
})();
