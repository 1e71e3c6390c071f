// The kvgate console's script. It promises: to read only /health, /v1/models, /v1/resources and
// POST /v1/chat/completions on this origin; to poll about once a second (the /v1 endpoints only while
// /health says ok, so a loading server's refusal counters are not pumped); to draw the memory bar so
// that its segments add up exactly to ledger.limit_bytes, each rect carrying its bytes in data-bytes;
// and to ask for the API key when a /v1 endpoint answers 401, sending it as "Authorization: Bearer".
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const SVG_TAGS = new Set(["rect", "title", "path", "circle"]);
const KNOWN_ROLES = new Set(["weights", "overhead", "workspace", "logprobs", "responses", "kv_cache", "cuda_graphs"]);
const KEY_STORE = "kvgate-api-key";
const state = { key: sessionStorage.getItem(KEY_STORE) || "", needKey: false, model: null, history: [], abort: null };

class Unauthorized extends Error {}

// ---- formatting ---------------------------------------------------------------------------------
function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let x = n;
  while (Math.abs(x) >= 1024 && i < units.length - 1) { x /= 1024; i += 1; }
  return (i === 0 ? String(x) : x.toFixed(1)) + " " + units[i];
}
const exact = (n) => Number(n).toLocaleString("en-US");
const fmtSeconds = (s) => (s == null ? "–" : s < 1 ? (s * 1000).toFixed(1) + " ms" : s.toFixed(2) + " s");
const fmtRate = (r) => (r == null ? "–" : r.toFixed(1) + " tok/s");

function el(tag, attrs = {}, text) {
  const node = SVG_TAGS.has(tag) ? document.createElementNS(SVG, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// ---- HTTP -----------------------------------------------------------------------------------------
async function api(path, init = {}) {
  const headers = { ...(init.headers || {}) };
  if (state.key) headers.Authorization = "Bearer " + state.key;
  const res = await fetch(path, { ...init, headers, cache: "no-store" });
  if (res.status === 401) {
    askForKey(path);
    throw new Unauthorized(path + " answered 401");
  }
  return res;
}

function askForKey(path) {
  state.needKey = true;
  $("key-where").textContent = path;
  $("key-error").textContent = state.key ? "the server refused that key; check it and try again" : "";
  $("key-form").hidden = false;
  $("api-key").focus();
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  state.key = $("api-key").value.trim();
  sessionStorage.setItem(KEY_STORE, state.key);
  state.needKey = false;
  state.model = null;
  $("key-form").hidden = true;
});

// ---- polling --------------------------------------------------------------------------------------
function showHealth(status, text) {
  const pill = $("health");
  pill.dataset.status = status;
  pill.textContent = text;
}

async function loadModel() {
  const res = await api("/v1/models");
  const card = (await res.json()).data[0];
  state.model = card.id;
  $("model").textContent = `model: ${card.id}` + (card.max_model_len ? ` · context ${exact(card.max_model_len)}` : "");
}

async function poll() {
  try {
    const h = await fetch("/health", { cache: "no-store" });
    const body = await h.json().catch(() => ({}));
    const status = body.status || String(h.status);
    showHealth(status, body.reason ? `${status}: ${body.reason}` : status);
    if (h.ok && !state.needKey) {
      if (!state.model) await loadModel();
      const res = await api("/v1/resources");
      if (res.ok) render(await res.json());
    }
  } catch (err) {
    if (!(err instanceof Unauthorized)) showHealth("unreachable", "unreachable: " + err.message);
  }
  setTimeout(poll, 1000);
}

function render(r) {
  renderBar(r);
  const s = r.scheduler;
  const kv = r.kv;
  $("running").textContent = `${s.running} / ${s.max_seqs}`;
  $("waiting").textContent = String(s.waiting);
  // held: referenced by a running request; the prefix cache's blocks are evictable, so they are not held
  const cached = kv.blocks_cached ?? 0;
  const held = kv.blocks_referenced ?? kv.blocks_total - kv.blocks_free - cached;
  if (kv.dtype) $("kv-held-label").textContent = `KV blocks held (${kv.dtype})`;
  $("kv-held").textContent = `${exact(held)} / ${exact(kv.blocks_total)} (peak ${exact(kv.blocks_peak)}; ` +
    `${exact(cached)} cached, evictable)`;
  if (r.live) {
    renderRefusals(r.live.refusals);
    renderTrends(r.live.series);
  }
}

// ---- the memory bar -------------------------------------------------------------------------------
function segments(r) {
  const roles = r.ledger.reserved_by_role;
  const kv = r.kv;
  const perBlock = kv.block_size * kv.bytes_per_token;
  const cached = kv.blocks_cached ?? 0;
  const referenced = kv.blocks_referenced ?? kv.blocks_total - kv.blocks_free;
  const free = kv.blocks_total - referenced - cached;
  const pool = roles.kv_cache ?? 0;
  const segs = [
    { key: "weights", label: "weights", bytes: roles.weights ?? 0 },
    { key: "overhead", label: "runtime overhead", bytes: roles.overhead ?? 0 },
    { key: "workspace", label: "step workspace", bytes: roles.workspace ?? 0 },
    // --logprobs-memory: what requests' log-probabilities may hold (host memory: a CPU's ledger only)
    ...(roles.logprobs ? [{ key: "logprobs", label: "logprobs memory", bytes: roles.logprobs }] : []),
    // --responses-store: responses kept for previous_response_id (host memory: a CPU's ledger only)
    ...(roles.responses ? [{ key: "responses", label: keptLabel(r.responses_store), bytes: roles.responses }] : []),
    // CUDA decode graphs (--cuda-graphs): their pool, static buffers and pad block; none on a CPU
    ...(roles.cuda_graphs ? [{ key: "cuda-graphs", label: "CUDA graphs", bytes: roles.cuda_graphs }] : []),
    { key: "kv-referenced", label: `KV referenced · ${exact(referenced)} blocks`, bytes: referenced * perBlock },
    { key: "kv-cached", label: `KV cached · ${exact(cached)} blocks`, bytes: cached * perBlock },
    // the rest of the pool's reservation: the free blocks (and any bytes the pool holds past whole blocks)
    { key: "kv-free", label: `KV free · ${exact(free)} blocks`, bytes: pool - (referenced + cached) * perBlock },
  ];
  for (const [role, bytes] of Object.entries(roles)) {
    if (!KNOWN_ROLES.has(role)) segs.push({ key: "other", role, label: role, bytes });
  }
  const unreserved = r.ledger.limit_bytes - r.ledger.reserved_bytes;
  if (unreserved > 0) segs.push({ key: "unreserved", label: "unreserved", bytes: unreserved });
  return segs;
}

function keptLabel(store) {
  return store ? `kept responses · ${exact(store.responses)} (${fmtBytes(store.bytes)} used)` : "kept responses";
}

function hoverText(seg) {
  return `${seg.label}: ${fmtBytes(seg.bytes)} (${exact(seg.bytes)} bytes)`;
}

function drawBar(svg, segs, total) {
  svg.replaceChildren();
  let x = 0;
  for (const seg of segs) {
    const w = total > 0 ? (seg.bytes / total) * 1000 : 0;
    const rect = el("rect", { x: x.toFixed(3), y: "0", width: w.toFixed(3), height: "32", class: "seg-" + seg.key,
                              "data-segment": seg.role || seg.key, "data-bytes": String(seg.bytes) });
    rect.append(el("title", {}, hoverText(seg)));
    svg.append(rect);
    x += w;
  }
}

function renderBar(r) {
  const limit = r.ledger.limit_bytes;
  const segs = segments(r);
  $("bar").dataset.limitBytes = String(limit);
  $("limit").textContent = `limit ${fmtBytes(limit)} (${exact(limit)} bytes)`;
  drawBar($("bar"), segs, limit);
  const kvSegs = segs.filter((s) => s.key.startsWith("kv-"));
  const pool = kvSegs.reduce((a, s) => a + s.bytes, 0);
  $("kv-pool").textContent = `${exact(r.kv.blocks_total)} blocks of ${r.kv.block_size} tokens, ${fmtBytes(pool)}`;
  drawBar($("kv-bar"), kvSegs, pool);
  $("legend").replaceChildren(...segs.map((seg) => {
    const item = el("li", { title: hoverText(seg), "data-segment": seg.role || seg.key });
    item.append(el("span", { class: "swatch seg-" + seg.key }), el("span", {}, `${seg.label} ${fmtBytes(seg.bytes)}`));
    return item;
  }));
}

// ---- refusals and trends --------------------------------------------------------------------------
function renderRefusals(ref) {
  const body = $("refusals").tBodies[0];
  body.replaceChildren();
  const rows = Object.entries(ref.by_reason);
  for (const [code, info] of rows) {
    const tr = el("tr", { "data-reason": code });
    const retry = info.retry_after_seconds == null ? "–" : `${info.retry_after_seconds} s`;
    tr.append(el("td", {}, code), el("td", { "data-count": String(info.count) }, String(info.count)), el("td", {}, retry));
    body.append(tr);
  }
  $("refusals").hidden = rows.length === 0;
  $("no-refusals").hidden = rows.length > 0;
}

function sparkline(id, label, values, fmt) {
  const box = $(id);
  const W = 300;
  const H = 40;
  const nums = values.filter((v) => v != null);
  const top = Math.max(...nums, 0) || 1;
  let d = "";
  let pen = false;
  let mark = null;
  values.forEach((v, i) => {
    if (v == null) { pen = false; return; }
    const px = ((i / Math.max(values.length - 1, 1)) * (W - 8) + 4).toFixed(1);
    const py = (H - 4 - (v / top) * (H - 8)).toFixed(1);
    d += pen ? `L${px} ${py}` : `M${px} ${py}l0 0`; // "l0 0": a lone point still shows as a round dot
    pen = true;
    mark = { cx: px, cy: py, r: "3" };
  });
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.append(el("path", { d }));
  if (mark) svg.append(el("circle", mark)); // the latest value
  const last = nums.length ? nums[nums.length - 1] : null;
  const now = el("span", { class: "now", title: `max ${fmt(nums.length ? top : null)}` }, fmt(last));
  box.replaceChildren(el("span", {}, label), svg, now);
}

function renderTrends(series) {
  sparkline("spark-tok", "output tok/s", series.output_tokens_per_second, fmtRate);
  sparkline("spark-ttft", "TTFT p50", series.ttft_p50_seconds, fmtSeconds);
  sparkline("spark-itl", "ITL p50", series.itl_p50_seconds, fmtSeconds);
}

// ---- chat ---------------------------------------------------------------------------------------------
function addMessage(role, text) {
  const node = el("div", { class: "msg " + role }, text);
  $("log").append(node);
  node.scrollIntoView({ block: "end" });
  return node;
}

async function* sseEvents(res) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

function showRefusal(status, headers, body) {
  const e = (body && body.error) || {};
  $("refusal").hidden = false;
  $("refusal").dataset.code = e.code || "";
  $("refusal-title").textContent = `${status} ${e.code || ""}`.trim();
  $("refusal-message").textContent = e.message || "the server sent no error body";
  const dl = $("refusal-numbers");
  dl.replaceChildren();
  const retry = e.retry_after_seconds ?? (headers && headers.get("Retry-After"));
  const numbers = [
    ["estimated_bytes", e.estimated_bytes, (v) => `${exact(v)} bytes (${fmtBytes(v)})`],
    ["limit_bytes", e.limit_bytes, (v) => `${exact(v)} bytes (${fmtBytes(v)})`],
    ["positions", e.positions, exact],
    ["positions_limit", e.positions_limit, exact],
    ["retry_after_seconds", retry, (v) => `${v} s`],
    ["param", e.param, String],
  ];
  for (const [name, value, fmt] of numbers) {
    if (value == null) continue;
    dl.append(el("dt", {}, name), el("dd", { "data-field": name, "data-value": String(value) }, fmt(value)));
  }
}

function showUsage(u, timing) {
  const usage = $("usage");
  usage.dataset.completionTokens = String(u.completion_tokens);
  usage.textContent = `usage: prompt ${u.prompt_tokens} + completion ${u.completion_tokens} = ${u.total_tokens} tokens` + timing;
  const cap = u.budget_cap;
  if (cap) {
    const c = $("budget-cap");
    c.hidden = false;
    c.dataset.admitted = String(cap.admitted_max_tokens);
    c.textContent = `budget cap: max_tokens ${cap.requested_max_tokens} requested, ${cap.admitted_max_tokens} admitted (${cap.reason})` +
      (c.dataset.header ? ` · X-KVGate-Budget-Cap: ${c.dataset.header}` : "");
  }
}

function resetChatStatus() {
  $("usage").textContent = "";
  $("budget-cap").hidden = true;
  delete $("budget-cap").dataset.header;
  $("refusal").hidden = true;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(ev) {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.abort) return;
  const messages = [...state.history, { role: "user", content: text }];
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (state.model) body.model = state.model;
  const maxTokens = $("max-tokens").value.trim();
  if (maxTokens) body.max_tokens = Number(maxTokens);
  const temperature = $("temperature").value.trim();
  if (temperature) body.temperature = Number(temperature);
  resetChatStatus();
  const mine = addMessage("user", text);
  const reply = addMessage("assistant", "");
  state.abort = new AbortController();
  setBusy(true);
  const t0 = performance.now();
  let tFirst = null;
  let answer = "";
  try {
    const res = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal: state.abort.signal,
    });
    if (!res.ok) {
      showRefusal(res.status, res.headers, await res.json().catch(() => null));
      reply.remove();
      mine.classList.add("unsent");
      return;
    }
    const capHeader = res.headers.get("X-KVGate-Budget-Cap");
    if (capHeader) $("budget-cap").dataset.header = capHeader;
    let finished = false;
    for await (const chunk of sseEvents(res)) {
      if (chunk.error) { showRefusal(500, null, chunk); break; }
      for (const choice of chunk.choices) {
        if (choice.delta && choice.delta.content) {
          tFirst ??= performance.now();
          answer += choice.delta.content;
          reply.textContent = answer;
        }
        if (choice.finish_reason) finished = true;
      }
      if (chunk.usage) {
        const secs = (performance.now() - t0) / 1000;
        const first = tFirst == null ? "" : ` · first token after ${fmtSeconds((tFirst - t0) / 1000)}`;
        showUsage(chunk.usage, `${first} · ${secs.toFixed(2)} s`);
      }
    }
    if (finished) {
      state.history = [...messages, { role: "assistant", content: answer }];
      $("prompt").value = "";
    }
  } catch (err) {
    if (err.name === "AbortError") {
      reply.classList.add("stopped");
    } else {
      reply.remove();
      mine.classList.add("unsent");
      if (!(err instanceof Unauthorized)) showRefusal("request failed", null, { error: { message: err.message } });
    }
  } finally {
    state.abort = null;
    setBusy(false);
  }
}

$("chat-form").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("chat-form").requestSubmit(); }
});
$("stop").addEventListener("click", () => state.abort && state.abort.abort());
$("clear").addEventListener("click", () => { state.history = []; $("log").replaceChildren(); resetChatStatus(); });

poll();
