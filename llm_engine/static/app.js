// Wires the page: the API key box, the model's name, the chat and the engine view.
import { api, apiKey, setApiKey } from "./api.js";
import { initChat } from "./chat.js";
import { initEngine } from "./engine.js";

const $ = (id) => document.getElementById(id);

function initKey() {
  const input = $("api-key"), status = $("key-status");
  const show = (needed) => {
    status.textContent = needed ? (apiKey() ? "wrong API key" : "this server needs an API key") : (apiKey() ? "key set" : "");
    document.body.classList.toggle("need-key", needed);
    if (needed) input.focus();
  };
  const use = () => { setApiKey(input.value.trim()); input.value = ""; show(false); };
  $("key-use").addEventListener("click", use);
  input.addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); use(); } });
  window.addEventListener("needkey", () => show(true));
  show(false);
}

async function loadModel() {
  const r = await api("/v1/models");
  if (!r.ok) { $("model-name").textContent = ""; return; }
  const m = (await r.json()).data[0];
  $("model-name").textContent = `${m.id} · context ${m.max_model_len} tokens`;
}

initKey();
initChat();
initEngine();
loadModel();
window.addEventListener("keychange", loadModel);
