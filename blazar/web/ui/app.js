// Blazar's dashboard: one page, no framework, no build step. Every request carries the
// API key from sessionStorage as a bearer token (no cookies), through the same door,
// scopes and metrics as any client's. Nothing here is inline: the page's CSP allows
// scripts and styles from 'self' only.
"use strict";

const KEY = "blazar.key";
const state = { me: null, page: null, timers: [], abort: null, logSeq: 0, chat: null, models: [] };

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

let sticky = 0;

function status(text, bad, keep) {
  if (!keep && Date.now() < sticky) return;  // an action's outcome stays readable for a while
  const s = $("status");
  s.textContent = text || "";
  s.className = bad ? "error" : "";
  if (keep) sticky = Date.now() + 8000;
}

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = sessionStorage.getItem(KEY);
  if (key) h.authorization = "Bearer " + key;
  return h;
}

class HTTPError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

// An error body's message: Ollama's {"error": "..."}, or OpenAI's {"error": {"message": "..."}}.
function errorText(body, fallback) {
  const err = body && body.error;
  return typeof err === "string" ? err : (err && err.message) || fallback;
}

async function api(path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = headers(opts.headers);
  if (opts.json !== undefined) {
    opts.body = JSON.stringify(opts.json);
    opts.headers["content-type"] = "application/json";
    delete opts.json;
  }
  const response = await fetch(path, opts);
  const text = await response.text();
  let body = null;
  try { body = text ? JSON.parse(text) : null; } catch (e) { body = { text }; }
  if (!response.ok) throw new HTTPError(response.status, errorText(body, response.statusText));
  return body;
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

function fmtSecs(s) {
  if (s === null || s === undefined) return "forever";
  s = Math.round(s);  // whole seconds first: 1799.6 is 30 min 0 s, not 29 min 60 s
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
  return (s / 3600).toFixed(1) + " h";
}

function pill(text, cls) { return el("span", { class: "pill " + (cls || text) }, text); }

// GGUF general.file_type, as llama.cpp names them
const FILE_TYPES = { 0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
  11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
  19: "IQ2_XXS", 20: "IQ2_XS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 28: "IQ4_XS", 30: "IQ1_M", 32: "BF16" };

// -- sign-in ------------------------------------------------------------------

async function whoami() {
  try {
    const door = await api("/ui/api/door");
    if (door.keys_active && !sessionStorage.getItem(KEY)) {
      showSignin("");
      return false;
    }
    state.me = await api("/ui/api/me");
  } catch (e) {
    state.me = null;
    if (e.status === 401 || e.status === 403) {
      const had = sessionStorage.getItem(KEY);
      sessionStorage.removeItem(KEY);
      showSignin(e.status === 403 ? e.message : (had ? "that key was refused" : ""));
      return false;
    }
    showSignin("the gateway did not answer: " + e.message);
    return false;
  }
  $("signin").hidden = true;
  $("nav").hidden = false;
  $("signout").hidden = !state.me.keys_active;
  $("who").textContent = state.me.key ? `${state.me.key}${state.me.admin ? " (admin)" : ""}` : "no keys: this machine";
  for (const a of document.querySelectorAll("#nav a[data-admin]")) a.hidden = !state.me.admin;
  for (const node of document.querySelectorAll(".admin-only")) node.hidden = !state.me.admin;
  return true;
}

function showSignin(message) {
  stopPage();
  for (const p of document.querySelectorAll(".page")) p.hidden = true;
  $("nav").hidden = true;
  $("signout").hidden = true;
  $("who").textContent = "";
  $("signin").hidden = false;
  $("signin-error").textContent = message || "";
  $("key").focus();
}

$("signin-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("key").value.trim());
  $("key").value = "";
  if (await whoami()) route();
});

$("signout").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  $("activity-filter").reset();
  $("chat-log").replaceChildren();
  state.chat = [];
  showSignin("");
});

// -- pages ----------------------------------------------------------------------

const PAGES = {
  models: { start: () => every(2000, loadModels) },
  queue: { start: () => every(1000, loadQueue) },
  nodes: { start: () => every(3000, loadNodes) },
  activity: { start: () => every(2000, loadActivity) },
  logs: { start: startLogs },
  performance: { start: () => every(10000, loadPerformance), admin: true },
  playground: { start: startPlayground },
  sessions: { start: () => every(3000, loadSessions) },
  keys: { start: loadKeys, admin: true },
  engines: { start: loadEngines, admin: true },
};

function every(ms, fn) {
  const run = async () => {
    try { await fn(); status("updated " + new Date().toLocaleTimeString()); }
    catch (e) { status(e.message, true); if (e.status === 401) showSignin("signed out: the key was refused"); }
  };
  run();
  state.timers.push(setInterval(run, ms));
}

function stopPage() {
  for (const t of state.timers) clearInterval(t);
  state.timers = [];
  if (state.abort) { state.abort.abort(); state.abort = null; }
}

function route() {
  if (!state.me) return;
  let page = (location.hash || "#models").slice(1);
  if (!PAGES[page] || (PAGES[page].admin && !state.me.admin)) page = "models";
  stopPage();
  state.page = page;
  for (const p of document.querySelectorAll(".page")) p.hidden = p.id !== "page-" + page;
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.dataset.page === page);
  PAGES[page].start();
}

window.addEventListener("hashchange", route);

// -- Models ------------------------------------------------------------------------

async function action(path, label) {
  status(label + "...", false, true);
  try {
    await api(path, { method: "POST" });
    status(label + ": done", false, true);
  } catch (e) {
    status(label + ": " + e.message, true, true);
  }
  await loadModels().catch((e) => status(e.message, true));
}

// One GPU's share of a loaded model: NVML's figure once measured, the planner's before (both when known).
function fmtGPU(g) {
  const parts = [];
  if (g.measured !== null && g.measured !== undefined) parts.push(fmtBytes(g.measured) + " measured");
  if (g.planned !== null && g.planned !== undefined) parts.push(fmtBytes(g.planned) + " planned");
  return parts.join(", ");
}

// Where a loaded model's memory is: "GPU 0: 4.1 GiB measured, 3.9 GiB planned", or CPU.
function fmtPlacement(r, gpus) {
  if (r.gpus && r.gpus.length) return r.gpus.map((g) => `GPU ${g.gpu}: ${fmtGPU(g)}`).join("; ");
  return gpus === null || gpus === undefined ? "-" : "CPU";
}

function showGPUs(data) {
  const gpus = data.gpus;
  $("gpus-title").hidden = gpus === null || gpus === undefined;
  $("gpus-none").hidden = !gpus || gpus.length !== 0;
  $("gpus-none").textContent = "No GPU: models run on the CPU" + (data.gpu_note ? ` (${data.gpu_note})` : "") + ".";
  $("gpus").hidden = !gpus || gpus.length === 0;
  $("gpus").tBodies[0].replaceChildren(...(gpus || []).map((g) => {
    const bar = el("span");
    bar.style.width = Math.min(100, 100 * g.memory_used / Math.max(1, g.memory_total)) + "%";
    const models = data.loaded.filter((r) => (r.gpus || []).some((x) => x.gpu === g.index));
    return el("tr", { "data-gpu": g.index },
      el("td", {}, String(g.index)), el("td", {}, g.name),
      el("td", {}, `${fmtBytes(g.memory_used)} / ${fmtBytes(g.memory_total)}`, el("div", { class: "bar" }, bar)),
      el("td", {}, models.length ? models.map((r) => `${r.model}: ${fmtGPU(r.gpus.find((x) => x.gpu === g.index))}`)
        .join("; ") : "-"));
  }));
}

// speculative decoding: the mode, and once the engine drafted, acceptance and accepted tokens per draft
function fmtSpeculative(r) {
  if (!r.speculative || r.speculative === "off") return "off";
  if (r.draft_acceptance === null || r.draft_acceptance === undefined) return r.speculative;
  const per = r.accepted_per_draft === null || r.accepted_per_draft === undefined ? "" : ` · ${r.accepted_per_draft.toFixed(1)}/draft`;
  return `${r.speculative}: ${Math.round(r.draft_acceptance * 100)}%${per}`;
}

async function loadModels() {
  const data = await api("/ui/api/models");
  state.models = data.files;
  const admin = state.me && state.me.admin;
  showGPUs(data);
  const loaded = $("loaded").tBodies[0];
  loaded.replaceChildren(...data.loaded.map((r) => el("tr", { "data-model": r.model },
    el("td", {}, r.model), el("td", {}, r.kind || "-"), el("td", {}, pill(r.state)),
    el("td", { class: "num" }, `${r.busy} / ${r.slots}`), el("td", { class: "num" }, r.ctx || "-"),
    el("td", { class: "num", "data-expires": "1" }, fmtSecs(r.expires_in)),
    el("td", { class: "num" }, fmtBytes(r.rss)),
    el("td", { "data-gpus": "1" }, fmtPlacement(r, data.gpus)),
    el("td", { class: "num" }, r.cache_hit === null || r.cache_hit === undefined ? "-" : Math.round(r.cache_hit * 100) + "%"),
    el("td", { "data-speculative": "1" }, fmtSpeculative(r)),
    el("td", {}, pill(r.breaker)),
    admin ? el("td", {},
      el("button", { type: "button", class: "unload", onclick: () => action(`/ui/api/models/${encodeURIComponent(r.model)}/unload`, "unload " + r.model) }, "Unload"), " ",
      el("button", { type: "button", onclick: () => action(`/ui/api/models/${encodeURIComponent(r.model)}/evict`, "evict " + r.model) }, "Evict"))
      : null)));
  $("loaded").hidden = data.loaded.length === 0;
  $("loaded-empty").hidden = data.loaded.length !== 0;
  const files = $("files").tBodies[0];
  files.replaceChildren(...data.files.map((f) => el("tr", { "data-model": f.name },
    el("td", {}, f.name), el("td", {}, f.kind), el("td", {}, f.format),
    el("td", { class: "num" }, fmtBytes(f.size)),
    el("td", {}, f.file_type === null || f.file_type === undefined ? "-" : (FILE_TYPES[f.file_type] || String(f.file_type))),
    el("td", { class: "num" }, f.trained_ctx || "-"), el("td", {}, f.architecture || "-"),
    el("td", {}, (f.capabilities || []).join(", ") || "-"),
    admin ? el("td", {}, el("button", { type: "button", class: "load",
      onclick: () => action(`/ui/api/models/${encodeURIComponent(f.name)}/load`, "load " + f.name) }, "Load")) : null)));
}

$("reset-breakers").addEventListener("click", () => action("/ui/api/breakers/reset", "reset breakers"));

// NDJSON over fetch (Ollama's streamed answers): each line's object, in order, a last line
// without its newline included.
async function ndjsonLines(response, onLine) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    buffered += done ? decoder.decode() : decoder.decode(value, { stream: true });
    const lines = buffered.split("\n");
    buffered = done ? "" : lines.pop();
    for (const line of lines) if (line.trim()) onLine(JSON.parse(line));
    if (done) return;
  }
}

// One of Ollama's pull progress lines in words: "pulling 1a2b3c4d5e6f: 42% (1.2 MiB / 2.9 MiB)"
// for a blob's, else its status ("pulling manifest", "verifying sha256 digest", "success").
function fmtPull(line) {
  if (String(line.status || "").startsWith("pulling ") && line.total) {
    const done = line.completed || 0;
    return `${line.status}: ${Math.floor(100 * done / line.total)}% (${fmtBytes(done)} / ${fmtBytes(line.total)})`;
  }
  return line.status || "";
}

// Pull (admin): Ollama's /api/pull, streamed, its progress under the form; the list refreshed on success.
$("pull-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const name = $("pull-name").value.trim();
  if (!name) return;
  const shown = $("pull-status");
  const say = (text, bad) => { shown.textContent = text; shown.className = bad ? "error" : "muted"; };
  $("pull-send").disabled = true;
  say(`pull ${name}: starting`);
  let last = null, error = null;
  try {
    const response = await fetch("/api/pull", {
      method: "POST", headers: headers({ "content-type": "application/json" }),
      body: JSON.stringify({ model: name, stream: true }),
    });
    if (!response.ok) {  // refused before the first line: a plain error answer
      const body = await response.json().catch(() => null);
      throw new Error(errorText(body, response.statusText));
    }
    await ndjsonLines(response, (line) => {
      if (line.error !== undefined) { error = errorText(line, "the pull failed"); return; }
      last = line.status;
      say(`pull ${name}: ${fmtPull(line)}`);
    });
    if (error === null && last !== "success") error = "the stream ended before success";
    if (error !== null) throw new Error(error);
    $("pull-name").value = "";
    status(`pull ${name}: done`, false, true);
    await loadModels().catch((e) => status(e.message, true));
  } catch (e) {
    say(`pull ${name}: ${e.message}`, true);
    status(`pull ${name}: ${e.message}`, true, true);
  } finally {
    $("pull-send").disabled = false;
  }
});

// -- Queue -------------------------------------------------------------------------

async function loadQueue() {
  const data = await api("/api/queue");
  const models = (data.models || []).filter((m) => m.slots.busy || m.waiting.total || (m.running || []).length);
  $("queue-empty").hidden = models.length !== 0;
  $("queue").replaceChildren(...models.map((m) => {
    const bar = el("span");
    bar.style.width = Math.min(100, 100 * m.slots.busy / Math.max(1, m.slots.total)) + "%";
    const rows = [];
    for (const r of m.running || []) {
      rows.push(el("tr", { class: "running" }, el("td", {}, pill("running", "ready")), el("td", {}, r.trace_id),
        el("td", {}, r.key || "-"), el("td", {}, r.priority), el("td", {}, r.class),
        el("td", { class: "num" }, (r.elapsed_ms / 1000).toFixed(1) + " s elapsed"), el("td", {}, "-")));
    }
    for (const r of m.requests || []) {
      rows.push(el("tr", { class: "waiting" }, el("td", {}, pill("#" + r.position, "starting")), el("td", {}, r.trace_id),
        el("td", {}, r.key || "-"), el("td", {}, r.priority), el("td", {}, r.class),
        el("td", { class: "num" }, (r.waited_ms / 1000).toFixed(1) + " s waiting"),
        el("td", { class: "num" }, r.estimated_start_ms === null ? "-" : "in " + (r.estimated_start_ms / 1000).toFixed(1) + " s")));
    }
    return el("div", { class: "queue-model", "data-model": m.model },
      el("h3", {}, m.model),
      el("div", { class: "muted" }, `slots ${m.slots.busy} / ${m.slots.total} busy, ${m.waiting.total} waiting, ` +
        `oldest ${(m.oldest_wait_ms / 1000).toFixed(1)} s`),
      el("div", { class: "bar" }, bar),
      rows.length ? el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "Position"), el("th", {}, "Trace id"),
        el("th", {}, "Key"), el("th", {}, "Priority"), el("th", {}, "Class"), el("th", {}, "Time"), el("th", {}, "ETA"))),
        el("tbody", {}, ...rows)) : null);
  }));
}

// -- Activity ----------------------------------------------------------------------

// -- Nodes ------------------------------------------------------------------------

// The cluster's nodes (GET /ui/api/nodes, as `blazar cluster` lists them): each with its state, when its
// heartbeat was last seen, its address and version (an admin's: "-" to a scoped key), and per model it runs the
// child's state, slots and queue.
async function loadNodes() {
  const data = await api("/ui/api/nodes");
  $("nodes-hint").hidden = !data.hint;
  $("nodes-hint").textContent = data.hint || "";
  $("nodes-empty").hidden = data.nodes.length !== 0;
  $("nodes").hidden = data.nodes.length === 0;
  $("nodes").tBodies[0].replaceChildren(...data.nodes.map((n) => el("tr", { "data-node": n.name, "data-state": n.state },
    el("td", {}, n.name, n.this ? el("span", { class: "muted" }, " (this node)") : null),
    el("td", {}, pill(n.state, { up: "ready", stopped: "stopping", unreachable: "open" }[n.state])),
    el("td", { class: "num" }, fmtSecs(n.seen_ago) + " ago"),
    el("td", {}, n.url || "-"), el("td", {}, n.version || "-"),
    el("td", {}, n.models.length ? el("table", { class: "inner" }, el("tbody", {}, ...n.models.map((m) =>
      el("tr", { "data-model": m.model },
        el("td", {}, m.model), el("td", {}, m.state ? pill(m.state) : "-"),
        el("td", { class: "num" }, `${m.busy} / ${m.slots}`),
        el("td", { class: "num" }, `${m.waiting} waiting`), el("td", { class: "num" }, `${m.running} running`)))))
      : (n.state === "up" ? "nothing loaded" : "-")))));
}

async function loadActivity() {
  const q = new URLSearchParams({ limit: "200" });
  if ($("f-model").value.trim()) q.set("model", $("f-model").value.trim());
  if ($("f-status").value) q.set("status", $("f-status").value);
  const data = await api("/ui/api/activity?" + q);
  const ms = (s) => (s === null || s === undefined ? "-" : (s * 1000).toFixed(1));
  $("activity").tBodies[0].replaceChildren(...data.requests.map((r) => el("tr", {},
    el("td", {}, new Date(r.at * 1000).toLocaleTimeString()), el("td", {}, r.surface), el("td", {}, r.path),
    el("td", {}, r.model), el("td", {}, r.key || "-"), el("td", {}, pill(r.status === "gone" ? "gone" : String(r.code), "s" + r.status)),
    el("td", { class: "num" }, r.ms.toFixed(1)),
    el("td", { class: "num" }, r.prompt_tokens === null ? "-" : `${r.prompt_tokens} / ${r.completion_tokens}`),
    el("td", { class: "num" }, ms(r.ttft)), el("td", { class: "num" }, ms(r.tpot)),
    el("td", { class: "muted" }, r.trace))));
}

$("activity-filter").addEventListener("change", () => loadActivity().catch((e) => status(e.message, true)));
$("activity-filter").addEventListener("submit", (e) => e.preventDefault());

// -- Logs (Server-Sent Events over fetch: EventSource cannot send the key) -----------

// Server-Sent Events over fetch (EventSource cannot send the key): each event's data, in order.
async function sseEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffered += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffered.indexOf("\n\n")) >= 0) {
      const event = buffered.slice(0, cut);
      buffered = buffered.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data) onData(data);
    }
  }
}

const ANSI = /\x1b\[([0-9;]*)m/g;

function ansiLine(text) {
  const line = el("div");
  let classes = [];
  let last = 0;
  for (const match of text.matchAll(ANSI)) {
    if (match.index > last) line.append(el("span", { class: classes.join(" ") || null }, text.slice(last, match.index)));
    for (const code of (match[1] || "0").split(";")) {
      if (code === "0" || code === "") classes = [];
      else classes.push("ansi-" + code);
    }
    last = match.index + match[0].length;
  }
  if (last < text.length) line.append(el("span", { class: classes.join(" ") || null }, text.slice(last)));
  return line;
}

async function startLogs() {
  const source = $("log-source");
  const chosen = source.value;
  const models = state.models.length ? state.models : (await api("/ui/api/models")).files;
  const options = (state.me.admin ? [el("option", { value: "" }, "the daemon")] : [])
    .concat(models.map((m) => el("option", { value: m.name }, m.name)));
  source.replaceChildren(...options);
  if (chosen && [...source.options].some((o) => o.value === chosen)) source.value = chosen;
  $("log").replaceChildren();
  followLogs();
}

async function followLogs() {
  if (state.abort) state.abort.abort();
  const controller = new AbortController();
  state.abort = controller;
  const model = $("log-source").value;
  const q = new URLSearchParams();
  if (model) q.set("model", model);
  const log = $("log");
  log.replaceChildren();
  if (!$("log-follow").checked) {
    try {
      const data = await api("/api/logs?" + q);
      for (const line of data.lines) log.append(ansiLine(line.text));
    } catch (e) { status(e.message, true); }
    return;
  }
  q.set("follow", "1");
  try {
    const response = await fetch("/api/logs?" + q, { headers: headers(), signal: controller.signal });
    if (!response.ok) { status("logs: " + response.status, true); return; }
    status("following " + (model || "the daemon"));
    await sseEvents(response, (data) => {
      const line = JSON.parse(data);
      const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 8;
      log.append(ansiLine(line.text));
      while (log.childNodes.length > 3000) log.firstChild.remove();
      if (atBottom) log.scrollTop = log.scrollHeight;
    });
  } catch (e) {
    if (e.name !== "AbortError") status("logs: " + e.message, true);
  }
}

$("log-source").addEventListener("change", followLogs);
$("log-follow").addEventListener("change", followLogs);

// -- Performance ---------------------------------------------------------------------

function chart(svg, points, series, unit) {
  // one group of bars per minute of the last hour (series side by side), the scale's top on the left
  const NS = "http://www.w3.org/2000/svg";
  const W = 600, H = 160, left = 40, bottom = 18, slots = 60;
  const svgEl = (tag, attrs) => {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    return node;
  };
  svg.replaceChildren();
  const max = Math.max(1e-9, ...points.flatMap((p) => series.map((s) => p[s])));
  const now = Date.now() / 1000;
  const width = (W - left - 4) / slots;
  svg.append(svgEl("path", { class: "axis", d: `M${left} 4V${H - bottom}H${W - 4}` }));
  const top = svgEl("text", { x: 2, y: 12 });
  top.textContent = (max >= 100 ? Math.round(max) : max.toFixed(2)) + (unit || "");
  svg.append(top);
  for (const [x, label] of [[left, "-60 min"], [W - 40, "now"]]) {
    const t = svgEl("text", { x, y: H - 4 });
    t.textContent = label;
    svg.append(t);
  }
  for (const point of points) {
    const slot = slots - 1 - Math.floor((now - point.minute) / 60);
    if (slot < 0) continue;
    series.forEach((s, n) => {
      const h = (point[s] / max) * (H - bottom - 10);
      const w = width / series.length;
      svg.append(svgEl("rect", { class: "bar" + (n + 1), x: (left + 1 + slot * width + n * w).toFixed(1),
        y: (H - bottom - h).toFixed(1), width: Math.max(1, w - 1).toFixed(1), height: Math.max(0, h).toFixed(1) }));
    });
  }
}

async function loadPerformance() {
  const data = await api("/ui/api/performance");
  $("perf-empty").hidden = data.minutes.length !== 0;
  chart($("chart-tokens"), data.minutes, ["tokens_per_sec"], " tok/s");
  chart($("chart-requests"), data.minutes, ["requests_per_sec"], " req/s");
  chart($("chart-latency"), data.minutes, ["p50_ms", "p95_ms"], " ms");
  showBench(await api("/ui/api/bench"));
}

// `blazar bench` runs, per model, newest first: each level's figures, and the latest run against the one before
function fmtRate(v, unit) { return v === null || v === undefined ? "-" : (unit === " ms" ? Math.round(v) : v.toFixed(1)) + (unit || ""); }

function fmtDelta(d) { return d === null || d === undefined ? "" : ` (${d > 0 ? "+" : ""}${d.toFixed(1)} %)`; }

function showBench(data) {
  $("bench-empty").hidden = data.runs.length !== 0;
  const models = [...new Set(data.runs.map((r) => r.model))];
  $("bench").replaceChildren(...models.map((model) => {
    const runs = data.runs.filter((r) => r.model === model);
    const rows = runs.flatMap((run) => run.levels.map((lv, n) => el("tr", { "data-run": run.id },
      el("td", { class: "num" }, n ? "" : String(run.id)),
      el("td", {}, n ? "" : new Date(run.created * 1000).toLocaleString()),
      el("td", {}, n ? "" : run.engine),
      el("td", { class: "num" }, String(lv.concurrency)),
      el("td", { class: "num" }, fmtRate(lv.gen_tps)), el("td", { class: "num" }, fmtRate(lv.gen_tps_total)),
      el("td", { class: "num" }, fmtRate(lv.pp_tps)), el("td", { class: "num" }, fmtRate(lv.ttft_ms, " ms")),
      el("td", { class: "num" }, lv.errors ? `${lv.errors}/${lv.requests}` : String(lv.requests)))));
    const cmp = data.comparisons[model];
    const latest = runs[0];
    const args = (latest.profile.argv || []).slice(1);
    return el("div", { class: "bench-model", "data-model": model },
      el("h3", {}, model),
      el("p", { class: "muted" }, `latest profile: ${args.join(" ") || latest.profile.remote || "-"}`),
      cmp ? el("p", { class: "bench-compare" }, `run ${cmp.after} against run ${cmp.before}: ` +
        [...cmp.changes, ...cmp.levels.map((lv) => `c${lv.concurrency} generation ${fmtRate(lv.gen_tps.after)} tok/s` +
          fmtDelta(lv.gen_tps.delta_percent) + `, TTFT ${fmtRate(lv.ttft_ms.after, " ms")}` +
          fmtDelta(lv.ttft_ms.delta_percent))].join("; ")) : null,
      el("table", {}, el("thead", {}, el("tr", {}, ...["Run", "When", "Engine", "Streams", "Gen tok/s per stream",
        "Gen tok/s all", "Prompt tok/s", "TTFT p50", "Requests"].map((h) => el("th", {}, h)))),
      el("tbody", {}, ...rows)));
  }));
}

// -- Playground ------------------------------------------------------------------------

async function startPlayground() {
  const data = await api("/ui/api/models");
  const models = data.files.filter((m) => m.kind === "chat");
  const select = $("chat-model");
  const chosen = select.value;
  select.replaceChildren(...models.map((m) => el("option", { value: m.name }, m.name)));
  const loaded = data.loaded.find((r) => models.some((m) => m.name === r.model));
  if (chosen && models.some((m) => m.name === chosen)) select.value = chosen;
  else if (loaded) select.value = loaded.model;
  if (!state.chat) state.chat = [];
}

$("chat-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = $("chat-input").value;
  if (!text.trim()) return;
  $("chat-input").value = "";
  const messages = [];
  if ($("chat-system").value.trim()) messages.push({ role: "system", content: $("chat-system").value });
  state.chat.push({ role: "user", content: text });
  messages.push(...state.chat);
  const log = $("chat-log");
  log.append(el("div", { class: "msg user" }, text));
  const out = el("div", { class: "msg assistant" });
  log.append(out);
  const controller = new AbortController();
  state.abort = controller;
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  const started = performance.now();
  let first = null, chunks = 0, answer = "", usage = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: headers({ "content-type": "application/json" }),
      body: JSON.stringify({ model: $("chat-model").value, messages, stream: true,
        stream_options: { include_usage: true }, temperature: Number($("chat-temperature").value),
        top_p: Number($("chat-top-p").value), max_tokens: Number($("chat-max").value) }),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || response.statusText);
    }
    await sseEvents(response, (data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      const piece = delta && (delta.content || delta.reasoning_content);
      if (piece) {
        if (first === null) first = performance.now();
        chunks++;
        answer += piece;
        out.textContent = answer;
      }
    });
    state.chat.push({ role: "assistant", content: answer });
    const secs = (performance.now() - (first || started)) / 1000;
    const tokens = usage ? usage.completion_tokens : chunks;
    $("chat-stats").textContent = `TTFT ${first === null ? "-" : Math.round(first - started) + " ms"}, ` +
      `${tokens} tokens, ${secs > 0 ? (tokens / secs).toFixed(1) : "-"} tokens/s after the first`;
  } catch (e) {
    if (e.name !== "AbortError") { out.classList.add("error"); out.textContent = answer + "\n[" + e.message + "]"; }
  } finally {
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
    state.abort = null;
  }
});

$("chat-stop").addEventListener("click", () => { if (state.abort) state.abort.abort(); });

// -- Sessions, Keys, Engines ----------------------------------------------------------------

async function loadSessions() {
  const data = await api("/api/session");
  const rows = data.sessions || [];
  $("sessions-empty").hidden = rows.length !== 0;
  $("sessions").tBodies[0].replaceChildren(...rows.map((s) => el("tr", {},
    el("td", {}, s.session), el("td", {}, s.model), el("td", { class: "num" }, s.slot === null ? "-" : s.slot),
    el("td", {}, s.last_used), el("td", { class: "num" }, s.tokens_cached), el("td", {}, s.saved ? "yes" : "no"))));
}

async function keyAction(path, method, label) {
  try {
    const result = await api(path, { method });
    if (result.secret && state.me && result.name === state.me.key) sessionStorage.setItem(KEY, result.secret);
    showSecret(result.secret ? `${label}: the new secret of ${result.name} is shown once: ${result.secret}` : "");
    status(label + ": done", false, true);
  } catch (e) { status(label + ": " + e.message, true, true); }
  await loadKeys().catch((e) => status(e.message, true));
}

function showSecret(text) {
  $("key-secret").hidden = !text;
  $("key-secret").textContent = text;
}

async function loadKeys() {
  const data = await api("/ui/api/keys");
  $("keys").tBodies[0].replaceChildren(...data.keys.map((k) => el("tr", { "data-key": k.name },
    el("td", {}, k.name, k.shared ? " " : null, k.shared ? pill("shared", "ready") : null), el("td", { class: "muted" }, k.secret),
    el("td", {}, k.models.length ? k.models.join(", ") : "every model (admin)"),
    el("td", { class: "muted" }, [k.rpm && `${k.rpm} rpm`, k.tpm && `${k.tpm} tpm`, k.daily_tokens && `${k.daily_tokens}/day`]
      .filter(Boolean).join(", ") || "-"),
    el("td", {},
      el("button", { type: "button", onclick: () => keyAction(`/ui/api/keys/${encodeURIComponent(k.name)}/rotate`, "POST", "rotate " + k.name) }, "Rotate"), " ",
      el("button", { type: "button", onclick: () => { if (confirm(`Remove the key ${k.name}?`)) keyAction(`/ui/api/keys/${encodeURIComponent(k.name)}`, "DELETE", "remove " + k.name); } }, "Remove")))));
}

$("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const models = $("key-models").value.split(",").map((m) => m.trim()).filter(Boolean);
  try {
    const result = await api("/ui/api/keys", { method: "POST", json: { name: $("key-name").value.trim(), models } });
    showSecret(`The secret of ${result.name} is shown once; copy it now: ${result.secret}`);
    $("key-name").value = "";
    $("key-models").value = "";
  } catch (e) { status("add key: " + e.message, true); }
  await loadKeys();
});

async function loadEngines() {
  const data = await api("/ui/api/engines");
  $("engines-empty").hidden = data.engines.length !== 0;
  $("engines").tBodies[0].replaceChildren(...data.engines.map((e) => el("tr", {},
    el("td", {}, e.kind), el("td", {}, e.tag), el("td", {}, e.active ? pill("active", "ready") : ""),
    el("td", { class: "muted" }, e.source), el("td", { class: "muted" }, e.path))));
}

// -- start ----------------------------------------------------------------------------------

whoami().then((ok) => { if (ok) route(); });
