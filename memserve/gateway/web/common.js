// Shared by the chat page and the dashboard: the optional API key (kept in
// sessionStorage, sent as "Authorization: Bearer"), and a server-sent-events reader over
// fetch() (EventSource cannot send that header). Nothing here writes HTML: every piece
// of text reaches the page through textContent.
"use strict";

const MS = (() => {
  const KEY = "memserve-api-key";

  function apiKey() {
    try { return sessionStorage.getItem(KEY) || ""; } catch (e) { return ""; }
  }

  function setApiKey(value) {
    try {
      if (value) sessionStorage.setItem(KEY, value); else sessionStorage.removeItem(KEY);
    } catch (e) { /* storage off: the key lives only in the field */ }
  }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const key = apiKey();
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  // Binds an <input> to the stored key.
  function bindKeyField(input) {
    if (!input) return;
    input.value = apiKey();
    input.addEventListener("change", () => setApiKey(input.value.trim()));
  }

  async function errorText(response) {
    let text = response.status + " " + response.statusText;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) text += ": " + body.error.message;
    } catch (e) { /* not JSON */ }
    if (response.status === 401) text += " (set the API key above)";
    return text;
  }

  // Reads a text/event-stream response; calls onData(string) for each event's data
  // (multi-line data joined with "\n"). Resolves when the stream ends.
  async function readSSE(response, onData) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let data = [];
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buffer.indexOf("\n")) >= 0) {
        let line = buffer.slice(0, nl);
        buffer = buffer.slice(nl + 1);
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") {
          if (data.length) onData(data.join("\n"));
          data = [];
        } else if (line.startsWith("data:")) {
          data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
        } // comments (":") and other fields are ignored
      }
    }
    if (data.length) onData(data.join("\n"));
  }

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v; else node.setAttribute(k, v);
    }
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  return { apiKey, setApiKey, headers, bindKeyField, errorText, readSSE, el };
})();
