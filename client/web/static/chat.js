// The chat page: a multi-turn conversation streamed from this server's /v1/chat/completions.
// Stop aborts the fetch; the server notices the closed connection and closes the session on every peer.
"use strict";
const $ = (id) => document.getElementById(id);
const history = [];  // {role, content} of the finished turns
let controller = null;

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function setMeta(div, text) {
  let meta = div.querySelector(".meta");
  if (!meta) { meta = document.createElement("span"); meta.className = "meta"; div.appendChild(meta); }
  meta.textContent = text;
}

function routeText(route) {
  return route.map((s) => `${s.name} (${s.layers[0]}:${s.layers[1]})`).join(" → ");
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

function numberOf(id, fallback) {
  const v = parseFloat($(id).value);
  return Number.isFinite(v) ? v : fallback;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error && body.error.message ? body.error.message : `HTTP ${response.status}`;
  } catch (e) {
    return `HTTP ${response.status}`;
  }
}

// Reads server-sent events from the response body; calls onData(json) per data line, onNotice(text) per notice.
async function readEvents(response, onData, onNotice) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith(": notice ")) onNotice(line.slice(9));
        else if (line.startsWith("data: ") && line !== "data: [DONE]") onData(JSON.parse(line.slice(6)));
      }
    }
  }
}

async function ask(question) {
  history.push({ role: "user", content: question });
  addMessage("user", question);
  const div = addMessage("assistant", "");
  const text = div.querySelector(".text");
  div.dataset.state = "waiting";
  setMeta(div, "waiting for the swarm…");
  $("notice").textContent = "";
  controller = new AbortController();
  busy(true);
  const started = performance.now();
  let answer = "";
  let tokens = 0;
  let swarm = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      signal: controller.signal,
      body: JSON.stringify({
        model: window.flowswarmModel || "default",
        messages: history,
        stream: true,
        stream_options: { include_usage: true },
        temperature: numberOf("temperature", 0.7),
        top_p: numberOf("top-p", 1),
        max_tokens: Math.round(numberOf("max-tokens", 256)),
      }),
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      if (chunk.swarm) swarm = chunk.swarm;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        answer += delta.content;
        text.textContent = answer;
        div.dataset.pieces = String(Number(div.dataset.pieces || 0) + 1);  // tests check the answer streamed
        div.dataset.state = "streaming";
        setMeta(div, "streaming…");
        $("notice").textContent = "";
        $("messages").scrollTop = $("messages").scrollHeight;
      }
    }, (notice) => { $("notice").textContent = notice; });
    div.dataset.state = "done";
    const seconds = (performance.now() - started) / 1000;
    const route = swarm && swarm.route.length ? "served by " + routeText(swarm.route) : "";
    const failovers = swarm && swarm.failovers ? ` · ${swarm.failovers} failover(s)` : "";
    setMeta(div, `${route} · ${tokens} tokens in ${seconds.toFixed(1)} s${failovers}`);
    history.push({ role: "assistant", content: answer });
  } catch (error) {
    if (error.name === "AbortError") {
      div.dataset.state = "stopped";
      setMeta(div, `${answer.length} characters; the generation was cancelled on the swarm`);
      if (answer) history.push({ role: "assistant", content: answer });
    } else {
      div.dataset.state = "error";
      const message = error instanceof TypeError ? "lost the connection to the server" : error.message;
      setMeta(div, message);
      history.pop();  // the question was not answered: let the user ask again
    }
  } finally {
    controller = null;
    busy(false);
  }
}

$("ask").addEventListener("submit", (event) => {
  event.preventDefault();
  const question = $("prompt").value.trim();
  if (!question || controller) return;
  $("prompt").value = "";
  ask(question);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("ask").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("clear").addEventListener("click", () => { if (!controller) { history.length = 0; $("messages").textContent = ""; } });

fetch("/v1/models").then((r) => r.json()).then((body) => {
  window.flowswarmModel = body.data[0].id;
  $("model").textContent = "model: " + body.data[0].id;
}).catch(() => {});
