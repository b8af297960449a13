// meshnode's chat page: talks to this API's own /v1 endpoints, streams answers as server-sent events.
//
// Safety: the user's text and everything the API reports reach the DOM as text (textContent); the
// model's answer is markdown turned into HTML by marked and sanitized by DOMPurify into a DOM
// fragment (no script, no event handlers, no javascript: URLs) before it is inserted. The page's
// Content-Security-Policy (meshnode/web/assets.py) forbids inline script and other origins besides.
"use strict";

const KEY = "meshnode-api-key";      // sessionStorage: the API key, for this tab only
const SAVED = "meshnode-chat";       // localStorage: the conversation, kept across reloads
const $ = id => document.getElementById(id);

const state = {
  messages: [],   // {role, content, served?} in order; what the next request sends (without `served`)
  busy: null,     // the AbortController of the answer streaming now
};
window.meshnodeChat = state;  // read by the browser tests

function authHeaders() {
  const h = {"Content-Type": "application/json"};
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function render(markdown) {
  const html = marked.parse(markdown, {gfm: true, breaks: true});
  return DOMPurify.sanitize(html, {USE_PROFILES: {html: true}, RETURN_DOM_FRAGMENT: true,
                                   FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select"]});
}
state.render = render;

function status(text, bad) {
  const el = $("status");
  el.textContent = text;
  el.classList.toggle("bad", !!bad);
}

function errorText(statusCode, doc) {
  const message = doc && doc.error && doc.error.message;
  return "HTTP " + statusCode + (message ? ": " + message : "");
}

// ---------------------------------------------------------------- models and the key

async function loadModels() {
  let r;
  try {
    r = await fetch("/v1/models", {headers: authHeaders(), cache: "no-store"});
  } catch (e) {
    status("the API is unreachable: " + e, true);
    setTimeout(loadModels, 3000);
    return;
  }
  if (r.status === 401) {
    askKey(sessionStorage.getItem(KEY) ? "the key was refused" : "this API needs its key");
    return;
  }
  if (!r.ok) {
    status(errorText(r.status, await r.json().catch(() => null)), true);
    return;
  }
  $("keyform").hidden = true;
  const models = (await r.json()).data || [];
  const select = $("model"), chosen = select.value;
  select.replaceChildren(...models.map(m => {
    const o = document.createElement("option");
    o.value = m.id;
    o.textContent = (m.name && m.name !== m.id ? m.name + " \u00b7 " + m.id : m.id) + " (" + m.n_layer +
      " layers, " + m.nodes + (m.nodes === 1 ? " node)" : " nodes)");
    return o;
  }));
  if (models.some(m => m.id === chosen)) select.value = chosen;
  if (!models.length) {
    const o = document.createElement("option");
    o.value = "";
    o.textContent = "no model is fully covered yet";
    select.replaceChildren(o);
    status("waiting for the mesh to cover a model\u2026");
    setTimeout(loadModels, 3000);
    return;
  }
  document.body.dataset.models = String(models.length);
  if (!state.busy) status("");
}

function askKey(note) {
  $("keyform").hidden = false;
  $("key-note").textContent = note;
  status(note, true);
  $("api-key").focus();
}

// ---------------------------------------------------------------- the conversation on the page

function messageView(role) {
  const box = document.createElement("article");
  box.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Assistant";
  const body = document.createElement("div");
  body.className = "body";
  const meta = document.createElement("div");
  meta.className = "meta";
  box.append(who, body, meta);
  $("log").append(box);
  return {box, body, meta};
}

function showUser(text) {
  const v = messageView("user");
  v.body.textContent = text;
  return v;
}

function showServed(meta, served, tokens) {
  meta.replaceChildren();
  if (!served) return;
  meta.append("served by ");
  (served.route || []).forEach((hop, i) => {
    if (i) meta.append(" \u2192 ");
    const s = document.createElement("span");
    s.className = "hop";
    s.title = String(hop.node_id) + " at " + String(hop.endpoint);
    const layers = hop.layers || [];
    s.textContent = String(hop.node_id).slice(0, 8) + " [layers " + layers[0] + "\u2013" + (layers[1] - 1) + "]";
    meta.append(s);
  });
  const rate = served.decode_tokens_per_second;
  const parts = [];
  if (rate !== null && rate !== undefined) parts.push(rate.toFixed(1) + " tok/s");
  if (tokens) parts.push(tokens + " tokens");
  if (served.failovers) parts.push(served.failovers + " failover" + (served.failovers === 1 ? "" : "s"));
  if (parts.length) meta.append(" \u00b7 " + parts.join(" \u00b7 "));
}

function showAssistant(text, served, tokens) {
  const v = messageView("assistant");
  v.body.replaceChildren(render(text));
  showServed(v.meta, served, tokens);
  v.box.dataset.state = "done";
  return v;
}

function scrollDown() {
  const log = $("log");
  log.scrollTop = log.scrollHeight;
}

function save() {
  try {
    localStorage.setItem(SAVED, JSON.stringify(state.messages));
  } catch (e) { /* storage full or disabled: the page still works */ }
}

function restore() {
  let saved = [];
  try {
    saved = JSON.parse(localStorage.getItem(SAVED) || "[]");
  } catch (e) { saved = []; }
  if (!Array.isArray(saved)) return;
  for (const m of saved) {
    if (!m || typeof m.content !== "string" || (m.role !== "user" && m.role !== "assistant")) continue;
    state.messages.push({role: m.role, content: m.content, served: m.served || null, tokens: m.tokens || 0});
    if (m.role === "user") showUser(m.content); else showAssistant(m.content, m.served, m.tokens);
  }
  scrollDown();
}

// ---------------------------------------------------------------- one answer

function setBusy(ctl) {
  state.busy = ctl;
  $("send").disabled = !!ctl;
  $("stop").disabled = !ctl;
  document.body.dataset.busy = ctl ? "1" : "";
}

async function* events(response) {
  // server-sent events: "data: {json}" blocks separated by a blank line, ended by "data: [DONE]"
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data: ") && line !== "data: [DONE]") yield JSON.parse(line.slice(6));
      }
    }
  }
}

async function send(text) {
  if (state.busy || !text.trim()) return;
  const model = $("model").value;
  if (!model) {
    status("no model to send to yet", true);
    return;
  }
  $("message").value = "";
  state.messages.push({role: "user", content: text});
  showUser(text);
  const view = messageView("assistant");
  view.box.dataset.state = "streaming";
  scrollDown();
  const body = {model, stream: true, messages: state.messages.map(m => ({role: m.role, content: m.content}))};
  const temperature = Number($("temperature").value), maxTokens = Number($("max-tokens").value);
  if ($("temperature").value !== "" && Number.isFinite(temperature)) body.temperature = temperature;
  if ($("max-tokens").value !== "" && Number.isInteger(maxTokens) && maxTokens > 0) body.max_tokens = maxTokens;
  const ctl = new AbortController();
  setBusy(ctl);
  status("answering\u2026");
  let answer = "", served = null, error = null, stopped = false, chunks = 0, pending = false;
  const paint = () => {
    pending = false;
    view.body.replaceChildren(render(answer));
    scrollDown();
  };
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: authHeaders(),
                                                   body: JSON.stringify(body), signal: ctl.signal});
    if (r.status === 401) askKey("the API refused the key");
    if (!r.ok) throw new Error(errorText(r.status, await r.json().catch(() => null)));
    for await (const doc of events(r)) {
      if (doc.error) {
        error = doc.error.message || "the answer failed";
        continue;
      }
      const delta = doc.choices && doc.choices[0] && doc.choices[0].delta;
      if (delta && delta.content) {
        answer += delta.content;
        chunks += 1;
        view.box.dataset.chunks = String(chunks);
        if (!pending) {
          pending = true;
          requestAnimationFrame(paint);
        }
      }
      if (doc.meshnode) served = doc.meshnode;
    }
  } catch (e) {
    if (e.name === "AbortError") stopped = true;
    else error = String(e.message || e);
  } finally {
    setBusy(null);
  }
  paint();
  const tokens = served ? served.tokens : 0;
  if (answer) {
    state.messages.push({role: "assistant", content: answer, served, tokens});
  } else {
    state.messages.pop();  // nothing came back: the question is not part of the conversation
  }
  showServed(view.meta, served, tokens);
  if (stopped) view.box.classList.add("stopped");
  if (error) {
    const e = document.createElement("div");
    e.className = "error";
    e.textContent = error;
    view.body.append(e);
  }
  view.box.dataset.state = error ? "error" : stopped ? "stopped" : "done";
  status(error ? "the answer failed" : stopped ? "stopped" : "", !!error);
  save();
  $("message").focus();
}

// ---------------------------------------------------------------- wiring

function wire() {
  $("composer").addEventListener("submit", e => {
    e.preventDefault();
    send($("message").value);
  });
  $("message").addEventListener("keydown", e => {
    if (e.key === "Enter" && !e.shiftKey && !e.ctrlKey && !e.altKey && !e.metaKey && !e.isComposing) {
      e.preventDefault();
      send($("message").value);
    } else if (e.key === "Escape" && state.busy) {
      state.busy.abort();
    }
  });
  $("stop").addEventListener("click", () => state.busy && state.busy.abort());
  $("new-chat").addEventListener("click", () => {
    if (state.busy) state.busy.abort();
    state.messages.length = 0;
    $("log").replaceChildren();
    save();
    $("message").focus();
  });
  $("settings").addEventListener("submit", e => e.preventDefault());
  $("keyform").addEventListener("submit", e => {
    e.preventDefault();
    sessionStorage.setItem(KEY, $("api-key").value.trim());
    $("api-key").value = "";
    loadModels();
  });
}

document.addEventListener("DOMContentLoaded", () => {
  wire();
  restore();
  loadModels();
  document.body.dataset.ready = "1";
  $("message").focus();
});
