// The chat page: streams answers from /v1/chat/completions (stream_options.include_usage
// gives the last chunk's usage, with prompt_tokens_details.cached_tokens). Model text is
// put on the page only through textContent: a small markdown subset (code blocks, inline
// code, bold, paragraphs) is built from elements, never from HTML strings.
"use strict";

const Chat = (() => {
  const $ = (id) => document.getElementById(id);
  const history = [];  // {role, content} of the finished turns
  let controller = null;

  // Inline markdown of one paragraph: `code` and **bold**, the rest text nodes.
  function renderInline(parent, text) {
    const pattern = /`([^`\n]+)`|\*\*([^*\n]+)\*\*/g;
    let last = 0;
    let m;
    while ((m = pattern.exec(text)) !== null) {
      if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
      parent.appendChild(MS.el(m[1] !== undefined ? "code" : "strong", {}, m[1] !== undefined ? m[1] : m[2]));
      last = pattern.lastIndex;
    }
    if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
  }

  // Replaces container's children with text rendered as the safe markdown subset.
  function renderMarkdown(container, text) {
    container.replaceChildren();
    const parts = text.split(/^```/m);  // even: prose, odd: a fenced code block (open until closed)
    parts.forEach((part, i) => {
      if (i % 2 === 1) {
        const nl = part.indexOf("\n");
        const lang = nl >= 0 ? part.slice(0, nl).trim() : "";
        const code = MS.el("code", lang ? { "data-lang": lang } : {}, nl >= 0 ? part.slice(nl + 1).replace(/\n$/, "") : "");
        const pre = MS.el("pre");
        pre.appendChild(code);
        container.appendChild(pre);
        return;
      }
      for (const para of part.split(/\n{2,}/)) {
        if (!para.trim()) continue;
        const p = MS.el("p");
        renderInline(p, para.replace(/^\n+|\n+$/g, ""));
        container.appendChild(p);
      }
    });
  }

  // Adds a message bubble; returns its body element and its stats line.
  function addMessage(role, text) {
    const box = MS.el("div", { class: "msg " + role, "data-role": role });
    box.appendChild(MS.el("div", { class: "role" }, role));
    const body = MS.el("div", { class: "body" });
    box.appendChild(body);
    const stats = MS.el("div", { class: "turn-stats" });
    box.appendChild(stats);
    $("conversation").appendChild(box);
    if (role === "user" || role === "error") body.textContent = text;
    else renderMarkdown(body, text);
    box.scrollIntoView({ block: "end" });
    return { box, body, stats };
  }

  async function loadModels() {
    const select = $("model");
    try {
      const r = await fetch("/v1/models", { headers: MS.headers() });
      if (!r.ok) throw new Error(await MS.errorText(r));
      const body = await r.json();
      select.replaceChildren();
      for (const m of body.data || []) select.appendChild(MS.el("option", { value: m.id }, m.id));
    } catch (e) {
      addMessage("error", "could not list models: " + e.message);
    }
  }

  function statsText(t) {
    const parts = [];
    if (t.ttft !== null) parts.push("TTFT " + Math.round(t.ttft) + " ms");
    if (t.rate !== null) parts.push(t.rate.toFixed(1) + " tokens/s");
    if (t.usage) {
      const cached = (t.usage.prompt_tokens_details || {}).cached_tokens || 0;
      parts.push("cached " + cached + " / " + t.usage.prompt_tokens + " prompt tokens");
      parts.push(t.usage.completion_tokens + " output tokens");
    }
    return parts.join(" · ");
  }

  async function send(text) {
    const system = $("system").value.trim();
    const messages = (system ? [{ role: "system", content: system }] : []).concat(history,
      [{ role: "user", content: text }]);
    addMessage("user", text);
    const answer = addMessage("assistant", "");
    answer.box.classList.add("streaming");
    const body = {
      model: $("model").value || undefined,
      messages,
      stream: true,
      stream_options: { include_usage: true },
      temperature: parseFloat($("temperature").value),
      max_tokens: parseInt($("max-tokens").value, 10),
    };
    const turn = { ttft: null, rate: null, usage: null };
    let content = "";
    let firstAt = null;
    let pending = false;
    const start = performance.now();
    controller = new AbortController();
    setBusy(true);
    const redraw = () => {
      pending = false;
      renderMarkdown(answer.body, content);
      answer.stats.textContent = statsText(turn);
    };
    try {
      const r = await fetch("/v1/chat/completions", {
        method: "POST", headers: MS.headers({ "Content-Type": "application/json" }),
        body: JSON.stringify(body), signal: controller.signal,
      });
      if (!r.ok) throw new Error(await MS.errorText(r));
      await MS.readSSE(r, (data) => {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "stream error");
        if (chunk.usage) turn.usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = (choice.delta && choice.delta.content) || "";
          if (delta) {
            if (firstAt === null) { firstAt = performance.now(); turn.ttft = firstAt - start; }
            content += delta;
          }
        }
        if (!pending) { pending = true; requestAnimationFrame(redraw); }
      });
      const end = performance.now();
      if (turn.usage && firstAt !== null && turn.usage.completion_tokens > 1 && end > firstAt) {
        turn.rate = (turn.usage.completion_tokens - 1) / ((end - firstAt) / 1000);
      }
      history.push({ role: "user", content: text }, { role: "assistant", content });
    } catch (e) {
      if (e.name !== "AbortError") addMessage("error", e.message);
      else if (content) history.push({ role: "user", content: text }, { role: "assistant", content });
    } finally {
      controller = null;
      setBusy(false);
      redraw();
      answer.box.classList.remove("streaming");
      answer.box.setAttribute("data-done", "1");
      if (turn.usage) {
        answer.box.setAttribute("data-cached-tokens",
          String((turn.usage.prompt_tokens_details || {}).cached_tokens || 0));
      }
    }
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
  }

  function init() {
    MS.bindKeyField($("api-key"));
    $("api-key").addEventListener("change", loadModels);
    $("composer").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const text = $("input").value;
      if (!text.trim() || controller) return;
      $("input").value = "";
      send(text);
    });
    $("input").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
    });
    $("stop").addEventListener("click", () => controller && controller.abort());
    $("clear").addEventListener("click", () => {
      if (controller) controller.abort();
      history.length = 0;
      $("conversation").replaceChildren();
    });
    loadModels();
  }

  document.addEventListener("DOMContentLoaded", init);
  return { addMessage, renderMarkdown, history };
})();
window.memserveChat = Chat;
