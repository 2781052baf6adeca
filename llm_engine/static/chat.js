// The chat: the conversation lives in this page only; answers stream in over SSE; Stop aborts the request.
import { api, errorText } from "./api.js";
import { readEvents } from "./sse.js";
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
let conversation = [];          // {role, content[, tool_calls]}: never sent anywhere but to this server
let controller = null;

function bubble(role, text) {
  const m = document.createElement("div");
  m.className = `msg ${role}`;
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = text;      // user text is text
  const meta = document.createElement("div");
  meta.className = "meta";
  m.append(body, meta);
  $("messages").append(m);
  $("messages").scrollTop = $("messages").scrollHeight;
  return m;
}

function parseBox(id, what) {
  const t = $(id).value.trim();
  if (!t) return undefined;
  try { return JSON.parse(t); } catch (e) { throw new Error(`${what} is not valid JSON: ${e.message}`); }
}

function requestBody() {
  const system = $("system").value.trim();
  const body = {
    messages: [...(system ? [{ role: "system", content: system }] : []), ...conversation],
    stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), top_p: Number($("top-p").value), max_tokens: Number($("max-tokens").value),
  };
  const schema = parseBox("schema", "the JSON schema");
  if (schema !== undefined) body.response_format = { type: "json_schema", json_schema: { name: "answer", schema, strict: true } };
  const tools = parseBox("tools", "the tools");
  if (tools !== undefined) {
    if (!Array.isArray(tools)) throw new Error("the tools must be a JSON array");
    body.tools = tools;
  }
  return body;
}

// the streamed answer so far: text, tool calls (merged by index), finish reason, usage, response id
function merge(state, chunk) {
  state.id = chunk.id || state.id;
  if (chunk.usage) state.usage = chunk.usage;
  for (const c of chunk.choices || []) {
    const d = c.delta || {};
    if (d.content) state.text += d.content;
    for (const tc of d.tool_calls || []) {
      const t = (state.tools[tc.index ?? 0] ||= { id: tc.id, type: "function", function: { name: "", arguments: "" } });
      if (tc.function?.name) t.function.name += tc.function.name;
      if (tc.function?.arguments) t.function.arguments += tc.function.arguments;
    }
    if (c.finish_reason) state.finish = c.finish_reason;
  }
}

function show(m, state, note) {
  const body = m.querySelector(".body");
  renderMarkdown(state.text, body);
  for (const t of state.tools.filter(Boolean)) {
    const pre = document.createElement("pre");
    pre.className = "tool-call";
    pre.textContent = `${t.function.name}(${t.function.arguments})`;
    body.append(pre);
  }
  const meta = m.querySelector(".meta");
  meta.replaceChildren();
  const words = [note || state.finish || "streaming…"];
  if (state.usage) words.push(`${state.usage.completion_tokens} tokens`);
  meta.append(words.join(" · "));
  if (state.id) {
    const b = document.createElement("button");
    b.type = "button"; b.className = "link trace-link"; b.textContent = "trace"; b.dataset.requestId = state.id;
    b.addEventListener("click", () => window.dispatchEvent(new CustomEvent("trace", { detail: state.id })));
    meta.append(" ", b);
  }
  m.dataset.state = note || (state.finish ? "done" : "streaming");
  $("messages").scrollTop = $("messages").scrollHeight;
}

async function stream(m, r, state) {
  let drawn = 0;
  for await (const data of readEvents(r)) {
    if (data === "[DONE]") break;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message);
    merge(state, chunk);
    const now = performance.now();
    if (now - drawn > 50) { show(m, state); drawn = now; }   // at most 20 redraws a second
  }
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  let body;
  conversation.push({ role: "user", content: text });
  bubble("user", text);
  $("prompt").value = "";
  const m = bubble("assistant", "");
  const state = { id: null, text: "", tools: [], finish: null, usage: null };
  try { body = requestBody(); } catch (e) { conversation.pop(); show(m, state, e.message); m.classList.add("error"); return; }
  controller = new AbortController();
  $("stop").disabled = false; $("send").disabled = true;
  try {
    const r = await api("/v1/chat/completions", { method: "POST", headers: { "Content-Type": "application/json" },
                                                  body: JSON.stringify(body), signal: controller.signal });
    if (!r.ok) throw new Error(await errorText(r));
    await stream(m, r, state);
    show(m, state);
  } catch (e) {
    const stopped = e.name === "AbortError";
    show(m, state, stopped ? "stopped" : e.message);
    if (!stopped) m.classList.add("error");
  } finally {
    controller = null;
    $("stop").disabled = true; $("send").disabled = false;
    if (state.text || state.tools.length) {
      const reply = { role: "assistant", content: state.text };
      if (state.tools.length) reply.tool_calls = state.tools.filter(Boolean);
      conversation.push(reply);
    } else conversation.pop();     // nothing came back: the question can be asked again
  }
}

export function initChat() {
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", () => controller?.abort());
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $("clear").addEventListener("click", () => { conversation = []; $("messages").replaceChildren(); });
}
