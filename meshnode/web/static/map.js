// The mesh map: per model, each node a bar over the layers it serves, the layers no live node serves,
// the routes in use, and a chart of tokens/s (uPlot). Drawn from a status document (the tracker's
// /api/status, the API's /v1/mesh: meshnode/web/mapdoc.py) and a series document (/api/series,
// /v1/mesh/series: meshnode/web/mapseries.py). Used by tracker.js and mappage.js.
//
// Everything a node advertised reaches the DOM as text (textContent, setAttribute of plain attributes):
// no innerHTML anywhere, no inline style (the CSP forbids it; uPlot sizes through the CSSOM).
"use strict";

const MeshMap = (() => {
  const SVG_NS = "http://www.w3.org/2000/svg";
  //: lines drawn per model chart besides the model's own (the busiest nodes)
  const MAX_NODE_LINES = 8;
  const PALETTE = ["#1f77b4", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#a6761d", "#1b9e77", "#666666"];

  function fill(e, attrs, children) {
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "style" || k.startsWith("on")) throw new Error("no inline style or handler: " + k);
      e.setAttribute(k, String(v));
    }
    for (const c of children) {
      if (c === null || c === undefined || c === false) continue;
      e.append(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
    }
    return e;
  }
  // an HTML element; strings among the children become text nodes
  function el(tag, attrs, ...children) { return fill(document.createElement(tag), attrs, children); }
  function svg(tag, attrs, ...children) { return fill(document.createElementNS(SVG_NS, tag), attrs, children); }

  function plural(n, word) { return n + " " + word + (n === 1 ? "" : "s"); }
  function short(id, n) { return String(id).slice(0, n || 12); }
  // layers [a, b) in words: "layer 3" or "layers 3–9"
  function layers(a, b) { return b - a === 1 ? "layer " + a : "layers " + a + "\u2013" + (b - 1); }
  function state(n) { return !n ? "unknown" : n.misbehaving ? "misbehaving" : n.alive ? "live" : "dead"; }
  function lied(n) {
    const r = n && n.misbehaving_report;
    return r ? "lied at position " + r.pos_start + " (layers " + r.range[0] + ":" + r.range[1] + "), reported by " +
      short(r.reporter) + ", verified " + new Date(r.at_unix * 1000).toLocaleString() : "lied";
  }

  // a tick spacing of 1, 2 or 5 x 10^k giving at most ``most`` ticks over n layers
  function tickStep(n, most) {
    for (let p = 1; ; p *= 10) for (const f of [1, 2, 5]) if (n / (f * p) <= most) return f * p;
  }

  // The SVG of one model: a row per node (its bar over its range), a row of uncovered layers, the routes.
  function drawMap(m, byId, routes, width) {
    const W = Math.max(260, Math.floor(width)), narrow = W < 520;
    const LABEL = narrow ? 92 : 140, RIGHT = 10, TOP = 20, ROW = 28, BAR = 14;
    const n = Math.max(1, m.n_layer), span = W - LABEL - RIGHT;
    const x = l => LABEL + (l / n) * span;
    const rows = m.nodes.length + 1;
    const H = TOP + rows * ROW + 4;
    const root = svg("svg", {class: "meshmap", width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img",
                             "aria-label": "layers of " + m.name + " served by each node"});
    root.append(svg("title", {}, "Layers 0\u2013" + (n - 1) + " of " + m.name + ": one bar per node"));
    const step = tickStep(n, Math.max(2, Math.floor(span / 36)));
    const axis = svg("g", {class: "axis"});
    // the word first: a page's text never reads "25 layer"
    axis.append(svg("text", {x: LABEL - 6, y: TOP - 8, "text-anchor": "end"}, "layer"),
                svg("line", {x1: x(n), x2: x(n), y1: TOP - 4, y2: H - 4, class: "grid"}));
    for (let l = 0; l < n; l += step) {
      axis.append(svg("line", {x1: x(l), x2: x(l), y1: TOP - 4, y2: H - 4, class: "grid"}),
                  svg("text", {x: x(l) + 2, y: TOP - 8}, String(l)));
    }
    root.append(axis);
    const rowOf = {};
    m.nodes.forEach((id, i) => {
      const node = byId[id], st = state(node), y = TOP + i * ROW;
      rowOf[id] = i;
      const g = svg("g", {class: "row " + st, "data-node": id, "data-state": st});
      g.append(svg("text", {x: 4, y: y + 11, class: "node-id"}, short(id, narrow ? 10 : 12)),
               svg("text", {x: 4, y: y + 23, class: "state " + st}, st));
      if (node) {
        const a = Math.max(0, Math.min(n, node.range[0])), b = Math.max(a, Math.min(n, node.range[1]));
        const bar = svg("rect", {x: x(a), y: y + (ROW - BAR) / 2, width: Math.max(1, x(b) - x(a)), height: BAR,
                                 rx: 3, class: "bar " + st, "data-range": a + ":" + b});
        bar.append(svg("title", {}, id + " \u00b7 " + layers(a, b) + " \u00b7 " + st +
                       (node.liveness_reason ? " (" + node.liveness_reason + ")" : "")));
        g.append(bar);
        if (x(b) - x(a) > 44) {
          g.append(svg("text", {x: (x(a) + x(b)) / 2, y: y + ROW / 2 + 4, class: "range " + st,
                                "text-anchor": "middle"}, a + ":" + b));
        }
      }
      root.append(g);
    });
    const gy = TOP + m.nodes.length * ROW;
    const gapRow = svg("g", {class: "gaps"});
    gapRow.append(svg("text", {x: 4, y: gy + 17, class: "gap-label"}, "uncovered"));
    for (const [a, b] of m.gaps) {
      const r = svg("rect", {x: x(a), y: gy + (ROW - BAR) / 2, width: Math.max(2, x(b) - x(a)), height: BAR,
                             class: "gap", "data-gap": a + ":" + b});
      r.append(svg("title", {}, layers(a, b) + ": served by no live node"));
      gapRow.append(r);
    }
    if (!m.gaps.length) gapRow.append(svg("text", {x: LABEL + 4, y: gy + 17, class: "none"}, "none: every layer served"));
    root.append(gapRow);
    // the routes in use: along each hop's bar, then down (or up) to the next hop's
    routes.forEach((r, k) => {
      if (!r.hops.every(h => h in rowOf && byId[h])) return;
      const off = BAR / 2 + 3 + (k % 3) * 2;  // just under the bars: their range labels stay readable
      const pts = [];
      for (const h of r.hops) {
        const y = TOP + rowOf[h] * ROW + ROW / 2 + off, rg = byId[h].range;
        pts.push([x(rg[0]), y], [x(rg[1]), y]);
      }
      const broken = r.hops.some(h => state(byId[h]) !== "live");
      const path = svg("path", {d: "M" + pts.map(p => p[0].toFixed(1) + " " + p[1].toFixed(1)).join(" L"),
                                class: "route" + (broken ? " broken" : ""), "data-route": r.hops.join(" "),
                                "data-sessions": r.sessions});
      path.append(svg("title", {}, "route " + (k + 1) + ": " + r.hops.map(h => short(h)).join(" \u2192 ") +
                      " \u00b7 " + plural(r.sessions, "session")));
      root.append(path);
      const [ex, ey] = pts[pts.length - 1];
      root.append(svg("circle", {cx: pts[0][0], cy: pts[0][1], r: 3.5, class: "route-end"}),
                  svg("circle", {cx: ex, cy: ey, r: 3.5, class: "route-end"}));
    });
    return root;
  }

  function routeList(routes) {
    const ul = el("ul", {class: "routes", "aria-label": "routes in use"});
    routes.forEach((r, k) => ul.append(el("li", {"data-route": r.hops.join(" ")}, "route " + (k + 1) + ": ",
      ...r.hops.flatMap((h, i) => [i ? " \u2192 " : "", el("code", {title: h}, short(h))]),
      " \u00b7 " + plural(r.sessions, "session"))));
    if (!routes.length) ul.append(el("li", {class: "muted"}, "no route in use"));
    return ul;
  }

  // The model's headline: name, layers, live nodes, coverage, sessions (the tracker tests read its words).
  function headline(m) {
    const alive = m.node_count - m.dead_count;
    const cover = m.covered ? [el("span", {class: "ok", "data-k": "coverage"}, "fully covered")] :
      [el("span", {class: "bad", "data-k": "coverage"}, "not covered"),
       ": " + m.gaps.map(g => layers(g[0], g[1])).join(", ") + " served by no live node"];
    return el("div", {class: "head"}, el("b", {}, m.name), " ",
      el("code", {class: "muted", title: m.fingerprint}, short(m.fingerprint, 16) + "\u2026"),
      " \u00b7 " + plural(m.n_layer, "layer") + " \u00b7 " + plural(alive, "live node") +
      (m.dead_count ? " (+" + m.dead_count + " dead)" : "") + " \u00b7 ", ...cover, " \u00b7 ",
      el("span", {"data-k": "active_sessions"}, plural(m.active_sessions || 0, "active session")));
  }

  // A chart of tokens/s: the model's (its last layer's nodes) and its busiest nodes'.
  class Chart {
    constructor(box) { this.box = box; this.plot = null; this.key = ""; }
    update(fp, doc, name) {
      const m = doc.models[fp];
      if (!m || typeof uPlot === "undefined") return;
      const mean = id => { const v = (doc.nodes[id] || []).filter(x => x !== null); return v.length ?
        v.reduce((a, b) => a + b, 0) / v.length : -1; };
      const drawn = m.nodes.slice().sort((a, b) => mean(b) - mean(a) || (a < b ? -1 : 1)).slice(0, MAX_NODE_LINES);
      drawn.sort();
      const key = drawn.join(",");
      const data = [doc.t, m.tokens_per_second, ...drawn.map(id => doc.nodes[id])];
      const width = Math.max(240, this.box.clientWidth);
      if (this.plot && this.key === key) {
        this.plot.setData(data);
        if (Math.abs(this.plot.width - width) > 1) this.plot.setSize({width, height: 200});
      } else {
        if (this.plot) this.plot.destroy();
        this.key = key;
        const series = [{}, {label: "whole model", stroke: "#1d232a", width: 2, value: fmt}]
          .concat(drawn.map((id, i) => ({label: short(id), stroke: PALETTE[i % PALETTE.length], width: 1.2,
                                         value: fmt})));
        this.plot = new uPlot({width, height: 200, series, scales: {x: {time: true}},
                               axes: [{}, {label: "tokens/s", size: 56}], legend: {live: true}},
                              data, this.box);
      }
      const points = m.tokens_per_second.filter(v => v !== null).length;
      this.box.dataset.points = String(points);
      this.box.dataset.lines = String(drawn.length + 1);
      this.box.dataset.latest = String(lastValue(m.tokens_per_second));
      this.box.dataset.peak = String(Math.max(0, ...m.tokens_per_second.filter(v => v !== null)));
      this.box.setAttribute("aria-label", "tokens per second of " + name + " over the last " +
                            Math.round(doc.window_seconds / 60) + " minutes");
      const more = m.nodes.length - drawn.length;
      this.note.textContent = more > 0 ? plural(more, "more node") + " not drawn (the " + drawn.length +
        " busiest are)" : "";
    }
    destroy() { if (this.plot) this.plot.destroy(); this.plot = null; }
  }
  function fmt(u, v) { return v === null || v === undefined ? "\u2013" : v.toFixed(1); }
  function lastValue(s) { for (let i = s.length - 1; i >= 0; i--) if (s[i] !== null) return s[i]; return ""; }

  // The model cards in ``container``, kept across refreshes (a chart and an open <details> survive);
  // ``extra(m, card, byId)`` adds what a page shows besides the map.
  class Cards {
    constructor(container, extra) {
      this.container = container; this.extra = extra || null; this.cards = new Map();
      this.status = null; this.series = null;
      let pending = 0;
      window.addEventListener("resize", () => {
        clearTimeout(pending);
        pending = setTimeout(() => { if (this.status) this.update(this.status); if (this.series) this.charts(this.series); },
                             150);
      });
    }
    update(status) {
      this.status = status;
      const byId = Object.fromEntries(status.nodes.map(n => [n.node_id, n]));
      const routes = status.routes || [];
      const seen = new Set();
      if (!status.models.length) {
        this.container.replaceChildren(el("p", {class: "muted"}, "no nodes registered"));
        for (const c of this.cards.values()) c.chart.destroy();
        this.cards.clear();
        return;
      }
      const order = [];
      for (const m of status.models) {
        seen.add(m.fingerprint);
        let c = this.cards.get(m.fingerprint);
        if (!c) {
          const box = el("div", {class: "chart", "data-k": "chart", role: "img"});
          const note = el("div", {class: "muted chart-note"});
          c = {root: el("section", {class: "model", "data-model": m.fingerprint}),
               head: el("div"), caught: el("div"), map: el("div", {class: "mapbox"}), routes: el("div"),
               chartbox: box, chart: new Chart(box), note, tail: el("div")};
          c.chart.note = note;
          c.root.append(c.head, c.caught, c.map, c.routes,
                        el("h3", {}, "tokens/s, last 15 minutes"), box, note, c.tail);
          this.cards.set(m.fingerprint, c);
        }
        order.push(c);
      }
      for (const [fp, c] of this.cards) if (!seen.has(fp)) { c.chart.destroy(); this.cards.delete(fp); }
      // in the status's order, moving only what is out of place (a focused element keeps its focus); in the
      // document before they are drawn: the map takes the width of its box
      order.forEach((c, i) => { if (this.container.children[i] !== c.root) this.container.insertBefore(c.root,
        this.container.children[i] || null); });
      while (this.container.children.length > order.length) this.container.lastChild.remove();
      status.models.forEach((m, i) => {
        const c = order[i];
        c.root.className = "model" + (m.covered ? "" : " lost");
        c.head.replaceWith(c.head = headline(m));
        c.caught.replaceChildren(...(m.misbehaving || []).map(id => el("div", {class: "bad", "data-k": "misbehaving"},
          "misbehaving: ", el("code", {}, short(id)), " " + lied(byId[id]) + "; it covers nothing")));
        const mine = routes.filter(r => r.model === m.fingerprint);
        c.map.replaceChildren(drawMap(m, byId, mine, c.map.clientWidth));
        c.routes.replaceChildren(routeList(mine));
        if (this.extra) this.extra(m, c.tail, byId);
      });
    }
    charts(doc) {
      this.series = doc;
      for (const [fp, c] of this.cards) c.chart.update(fp, doc, (this.status && this.status.models.find(
        m => m.fingerprint === fp) || {name: fp}).name);
    }
  }

  return {el, svg, plural, short, layers, lied, state, drawMap, Cards};
})();
