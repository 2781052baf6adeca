// The API key (typed once, kept in this tab's sessionStorage) and fetch with it.
const KEY = "llm_engine_api_key";

export const apiKey = () => sessionStorage.getItem(KEY) || "";

export function setApiKey(k) {
  if (k) sessionStorage.setItem(KEY, k); else sessionStorage.removeItem(KEY);
  window.dispatchEvent(new CustomEvent("keychange"));
}

export function withKey(headers = {}) {
  const k = apiKey();
  return k ? { ...headers, Authorization: `Bearer ${k}` } : headers;
}

// fetch with the key; a 401 asks the user for one (the page itself is public, the API is not)
export async function api(path, opts = {}) {
  const r = await fetch(path, { ...opts, headers: withKey(opts.headers || {}) });
  if (r.status === 401) window.dispatchEvent(new CustomEvent("needkey"));
  return r;
}

// the error message of an OpenAI-style error body, or the status line
export async function errorText(r) {
  try { const b = await r.json(); return `${r.status}: ${b.error?.message ?? JSON.stringify(b)}`; }
  catch { return `${r.status} ${r.statusText}`; }
}
