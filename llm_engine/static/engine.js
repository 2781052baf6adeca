// The engine, live: one SSE stream of frames (GET /v1/debug/state) drawn as a block map, queues and rates.
import { api, errorText } from "./api.js";
import { readEvents } from "./sse.js";

const $ = (id) => document.getElementById(id);
const HISTORY = 1200;           // frames kept for the sparklines: 5 minutes at 4 a second
const RECENT = 12;              // finished requests kept clickable
const history = { tok_s: [], ttft: [], tpot: [], kv: [] };
let frame = null, selected = null, recent = [], lastIds = new Set(), controller = null;

export function colorOf(requestId) {
  let h = 0;
  for (const ch of String(requestId)) h = (h * 31 + ch.charCodeAt(0)) >>> 0;
  return `hsl(${h % 360}, 62%, ${45 + (h >> 9) % 20}%)`;
}

function seqOwners(f) {
  const req = new Map();
  for (const q of Object.values(f.queues)) for (const s of q) req.set(String(s.seq_id), s.request_id);
  return req;
}

function drawBlocks(f) {
  const cv = $("blockmap"), n = f.num_cells;
  const width = cv.clientWidth || 600;
  const size = Math.max(4, Math.min(18, Math.floor(Math.sqrt((width * 240) / n))));
  const cols = Math.max(1, Math.floor(width / size)), rows = Math.ceil(n / cols);
  cv.width = width; cv.height = rows * size;
  const ctx = cv.getContext("2d");
  const owner = new Map(), reqOf = seqOwners(f);
  for (const [sid, cells] of Object.entries(f.tables)) for (const c of cells) if (!owner.has(c)) owner.set(c, reqOf.get(sid) ?? `seq ${sid}`);
  const shared = new Set(f.shared), cached = new Set(f.cached);
  let nsel = 0;
  for (let c = 0; c < n; c++) {
    const x = (c % cols) * size, y = Math.floor(c / cols) * size, who = owner.get(c);
    ctx.globalAlpha = selected && who !== selected ? 0.35 : 1;
    ctx.fillStyle = who ? colorOf(who) : cached.has(c) ? "#b9c3cf" : "#dedede";
    ctx.fillRect(x, y, size - 1, size - 1);
    if (shared.has(c)) {                  // shared prefix: a dark corner triangle
      ctx.fillStyle = "#222"; ctx.beginPath(); ctx.moveTo(x, y); ctx.lineTo(x + size / 2, y); ctx.lineTo(x, y + size / 2); ctx.fill();
    }
    if (selected && who === selected) {
      nsel++; ctx.globalAlpha = 1; ctx.strokeStyle = "#000"; ctx.lineWidth = 2; ctx.strokeRect(x + 1, y + 1, size - 3, size - 3);
    }
  }
  ctx.globalAlpha = 1;
  Object.assign(cv.dataset, { used: owner.size, shared: shared.size, selected: nsel, cells: n });
  $("blocks-caption").textContent = `${f.kv_used} of ${f.num_blocks} blocks used (${f.block_size} tokens each` +
    (f.scale > 1 ? `, ${f.scale} blocks a cell)` : ")");
}

function requestButton(id, label) {
  const b = document.createElement("button");
  b.type = "button"; b.className = "req"; b.title = id; b.dataset.requestId = id;
  const sw = document.createElement("span");
  sw.className = "swatch"; sw.style.backgroundColor = colorOf(id);
  b.append(sw, document.createTextNode(label));
  b.addEventListener("click", () => selectRequest(id));
  return b;
}

// Frames come several times a second: rebuilding the lists each time would swap a button out between a user's
// mousedown and mouseup and lose the click. So a request keeps its <li> while it stays in a list; only its words,
// its highlight and the order change in place.
function syncList(ol, rows, more = "") {
  const old = new Map([...ol.children].filter((li) => li.dataset.requestId).map((li) => [li.dataset.requestId, li]));
  const lis = rows.map(([id, label]) => {
    let li = old.get(id);
    if (!li) { li = document.createElement("li"); li.dataset.requestId = id; li.append(requestButton(id, label)); }
    const b = li.firstChild;
    if (b.lastChild.nodeValue !== label) b.lastChild.nodeValue = label;
    b.classList.toggle("selected", id === selected);
    return li;
  });
  if (more) {
    const li = [...ol.children].find((li) => !li.dataset.requestId) || document.createElement("li");
    if (li.textContent !== more) li.textContent = more;
    lis.push(li);
  }
  if (lis.length !== ol.children.length || lis.some((li, i) => ol.children[i] !== li)) ol.replaceChildren(...lis);
}

const short = (id) => (id.length > 14 ? id.slice(0, 12) + "…" : id);

function drawQueues(f) {
  for (const name of ["running", "waiting", "swapped"]) {
    const ol = $(`q-${name}`), items = f.queues[name];
    $(`count-${name}`).textContent = f.counts[name];
    syncList(ol, items.map((s) => {
      const tok = `${s.prompt_tokens}+${s.output_tokens} tok` + (name === "running" ? `, ${s.computed} in KV` : "") + (s.paused ? " (paused)" : "");
      return [s.request_id, ` ${short(s.request_id)} · ${tok}`];
    }), f.counts[name] > items.length ? `… ${f.counts[name] - items.length} more` : "");
  }
  if (f.finished) recent = f.finished.map(([id, step, why]) => [id, ` ${short(id)} · ${why}`]);   // from the trace
  else {                            // no trace on the server: the requests this page saw leave the queues
    const now = new Set(Object.values(f.queues).flat().map((s) => s.request_id));
    for (const id of lastIds) if (!now.has(id)) recent = [[id, ` ${short(id)}`], ...recent.filter((r) => r[0] !== id)].slice(0, RECENT);
    lastIds = now;
  }
  syncList($("q-recent"), recent);
}

function spark(id, xs) {
  const cv = $(id), ctx = cv.getContext("2d"), w = cv.width, h = cv.height;
  ctx.clearRect(0, 0, w, h);
  const ys = xs.filter((x) => x != null);
  if (ys.length < 2) return;
  const max = Math.max(...ys) || 1;
  ctx.strokeStyle = "#4a7fd1"; ctx.lineWidth = 1.5; ctx.beginPath();
  const span = Math.max(xs.length, 240) - 1;     // the first minute fills from the left, then the line scrolls
  xs.forEach((x, i) => { const px = (i / span) * w, py = h - 2 - ((x ?? 0) / max) * (h - 4); i ? ctx.lineTo(px, py) : ctx.moveTo(px, py); });
  ctx.stroke();
}

const fmt = (x, d = 1) => (x == null ? "–" : Number(x).toFixed(d));

function drawStats(f) {
  const push = (k, v) => { history[k].push(v); if (history[k].length > HISTORY) history[k].shift(); };
  push("tok_s", f.tok_s); push("ttft", f.ttft_ms.p50); push("tpot", f.tpot_ms.p50); push("kv", f.kv_usage * 100);
  $("stat-tok-s").textContent = fmt(f.tok_s);
  $("stat-ttft").textContent = fmt(f.ttft_ms.p50, 0);
  $("stat-tpot").textContent = fmt(f.tpot_ms.p50, 1);
  $("stat-kv").textContent = `${fmt(f.kv_usage * 100)}%`;
  $("stat-hit").textContent = `${fmt(f.prefix_hit_rate * 100)}%`;
  $("stat-step").textContent = `${f.finished_recently} finished in the last minute`;
  $("state-status").textContent = `live · step ${f.step} · ${f.tokens_generated} tokens generated · ${f.preemptions} preemptions · ` +
    `this frame held the step loop ${fmt(f.copy_ms, 2)} ms`;
  spark("spark-tok-s", history.tok_s); spark("spark-ttft", history.ttft); spark("spark-tpot", history.tpot); spark("spark-kv", history.kv);
}

function draw(f) {
  frame = f;
  drawStats(f); drawBlocks(f); drawQueues(f);
}

export async function selectRequest(id) {
  selected = id;
  if (frame) draw(frame);
  $("trace-title").textContent = id;
  $("trace-body").textContent = "…";
  const r = await api(`/v1/debug/trace?request_id=${encodeURIComponent(id)}`);
  if (selected !== id) return;
  if (!r.ok) { $("trace-body").textContent = await errorText(r); return; }
  const body = await r.json();
  $("trace-body").textContent = body.traces.flatMap((t) => t.explanation).join("\n");
}

async function watch() {
  controller?.abort();
  const mine = (controller = new AbortController());
  const status = $("state-status");
  let pause = 2000;
  while (controller === mine) {
    try {
      const r = await api("/v1/debug/state", { signal: mine.signal });
      if (r.status === 401) { status.textContent = "the engine view needs the API key"; return; }   // "keychange" restarts it
      if (!r.ok) throw new Error(await errorText(r));
      status.textContent = "live";   // the first frame adds the step and what the frame cost
      for await (const data of readEvents(r)) {
        const f = JSON.parse(data);
        if (f.error) { status.textContent = f.error; continue; }
        draw(f);
      }
      pause = 250;                  // the server ended the stream (it may be stopping): ask again soon
    } catch (e) {
      if (e.name === "AbortError") return;
      status.textContent = `engine view: ${e.message}; retrying`;
      pause = 2000;
    }
    await new Promise((ok) => setTimeout(ok, pause));
  }
}

export function initEngine() {
  window.addEventListener("keychange", watch);
  window.addEventListener("trace", (e) => selectRequest(e.detail));
  window.addEventListener("resize", () => frame && drawBlocks(frame));
  watch();
}
