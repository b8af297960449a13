// The API's map page: the mesh map (map.js) from /v1/mesh and /v1/mesh/series, with the API key if one
// is needed (kept in sessionStorage under "meshnode-api-key", as the chat page keeps it).
"use strict";

(() => {
  const {el, plural, short, state} = MeshMap;
  const KEY = "meshnode-api-key";
  const $ = id => document.getElementById(id);
  const cards = new MeshMap.Cards($("models"));
  let lastSeries = 0, waiting = false;

  function headers() {
    const key = sessionStorage.getItem(KEY);
    return key ? {Authorization: "Bearer " + key} : {};
  }
  function askKey(why) {
    waiting = true;
    $("keyform").hidden = false;
    $("key-note").textContent = why;
    $("updated").textContent = "waiting for the API key";
    if (document.activeElement === document.body) $("api-key").focus();
  }
  $("keyform").addEventListener("submit", e => {
    e.preventDefault();
    sessionStorage.setItem(KEY, $("api-key").value.trim());
    $("keyform").hidden = true;
    $("key-note").textContent = "";
    waiting = false;
    refresh();
  });

  async function get(path) {
    const r = await fetch(path, {cache: "no-store", headers: headers()});
    if (r.status === 401) {
      askKey(sessionStorage.getItem(KEY) ? "the API refused the key" : "this API needs its key");
      return null;
    }
    if (!r.ok) throw new Error(path + ": HTTP " + r.status);
    return r.json();
  }

  function node(n) {
    const st = state(n);
    return el("tr", {"data-node": n.node_id, class: n.alive ? null : "dead"},
      el("td", {title: n.node_id}, el("code", {}, short(n.node_id))),
      el("td", {}, n.endpoints[0] || ""),
      el("td", {}, n.range[0] + ":" + n.range[1] + " ", el("small", {}, n.role || "")),
      el("td", {}, el("span", {class: n.alive ? "ok" : "bad", "data-k": "liveness"}, st), " ",
         el("small", {}, n.liveness_reason)),
      el("td", {class: "num"}, String(n.live_sessions)), el("td", {class: "num"}, String(n.tokens_total)),
      el("td", {}, n.source || ""));
  }

  async function refresh() {
    if (waiting) return;
    try {
      const s = await get("/v1/mesh");
      if (!s) return;
      const dead = s.nodes.filter(n => !n.alive).length;
      $("models-count").textContent = "\u00b7 " + plural(s.models.length, "model");
      $("nodes-count").textContent = "\u00b7 " + plural(s.nodes.length, "node") + (dead ? " (" + dead + " dead)" : "");
      cards.update(s);
      document.querySelector("#nodes tbody").replaceChildren(...s.nodes.map(node));
      if (Date.now() - lastSeries >= 4900 || !cards.series) {
        lastSeries = Date.now();
        const doc = await get("/v1/mesh/series");
        if (doc) cards.charts(doc);
      } else {
        cards.charts(cards.series);
      }
      $("updated").textContent = "updated " + new Date().toLocaleTimeString();
      document.body.dataset.ready = "1";
      document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
    } catch (e) {
      $("updated").textContent = "API unreachable: " + e;
    }
  }
  refresh();
  setInterval(refresh, 2000);
})();
