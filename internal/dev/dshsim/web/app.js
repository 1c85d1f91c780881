"use strict";
// Every URL is relative to <base href="./"> so the page works under a path
// prefix such as /u/bob/ behind the gateway.

const $ = (id) => document.getElementById(id);

function append(log, cls, text) {
  const p = document.createElement("p");
  p.className = cls;
  p.textContent = text;
  log.append(p);
  log.scrollTop = log.scrollHeight;
  return p;
}

// Chat: POST api/chat answers with an SSE stream. EventSource cannot POST,
// so the stream is read with fetch and split into events here. Unnamed
// events carry one word each (the simulator's own reply); "delta" events a
// JSON string of the model's text as it arrives; "error" a provider's
// refusal, shown as its message; "done" ends the reply.
function parseEvent(block) {
  let name = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith("event: ")) name = line.slice(7);
    else if (line.startsWith("data: ")) data.push(line.slice(6));
  }
  return { name, data: data.join("\n") };
}

async function sendChat(message, model) {
  const log = $("chat-log");
  append(log, "user", message);
  const reply = append(log, "assistant", "");
  const failed = (text) => {
    append(log, "error", text).setAttribute("role", "alert");
    reply.classList.add("done");
  };
  const body = { message, session: "default" };
  if (model) body.model = model;
  let res;
  try {
    res = await fetch("api/chat", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
  } catch (err) {
    failed(`chat failed: ${err.message}`);
    return;
  }
  if (!res.ok) {
    failed(`error ${res.status}: ${(await res.text()).trim()}`);
    return;
  }
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (err) {
      failed(`the reply broke off: ${err.message}`);
      return;
    }
    if (chunk.done) break;
    buf += chunk.value;
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = parseEvent(buf.slice(0, end));
      buf = buf.slice(end + 2);
      switch (event.name) {
        case "done":
          reply.classList.add("done");
          break;
        case "delta":
          reply.textContent += JSON.parse(event.data);
          break;
        case "error":
          failed(JSON.parse(event.data).message);
          break;
        default:
          reply.textContent += (reply.textContent ? " " : "") + event.data;
      }
    }
  }
}

async function loadHistory() {
  const res = await fetch("api/chat?session=default");
  if (!res.ok) return;
  for (const m of await res.json()) append($("chat-log"), m.role, m.text);
}

$("chat-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const input = $("chat-input");
  if (!input.value) return;
  sendChat(input.value, $("chat-model").value.trim());
  input.value = "";
});

// WebSocket echo, reconnecting after a drop (for example a suspend/resume).
let ws;
function connectWS() {
  const url = new URL("api/ws", document.baseURI);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  ws = new WebSocket(url);
  ws.binaryType = "arraybuffer";
  ws.onopen = () => { $("ws-status").textContent = "connected"; };
  ws.onclose = () => {
    $("ws-status").textContent = "disconnected";
    setTimeout(connectWS, 1000);
  };
  ws.onmessage = (m) => {
    const text = typeof m.data === "string" ? m.data : `binary ${m.data.byteLength} bytes`;
    append($("ws-log"), "in", text);
  };
}

$("ws-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const input = $("ws-input");
  if (!input.value || ws.readyState !== WebSocket.OPEN) return;
  ws.send(input.value);
  append($("ws-log"), "out", input.value);
  input.value = "";
});

// Live events over SSE; only the newest 50 are kept on screen.
const events = new EventSource("api/events?interval=1000&count=1000000");
events.addEventListener("tick", (e) => {
  const { i, at } = JSON.parse(e.data);
  const li = document.createElement("li");
  li.value = i;
  li.textContent = at;
  $("events").prepend(li);
  while ($("events").children.length > 50) $("events").lastChild.remove();
});

async function loadFiles() {
  const res = await fetch("api/files");
  if (!res.ok) return;
  const items = (await res.json()).map((f) => {
    const li = document.createElement("li");
    if (f.dir) {
      li.textContent = `${f.name}/`;
    } else {
      const a = document.createElement("a");
      a.href = "api/files/" + encodeURIComponent(f.name);
      a.textContent = f.name;
      li.append(a, ` (${f.size} bytes)`);
    }
    return li;
  });
  $("files").replaceChildren(...items);
}

$("upload").addEventListener("change", async () => {
  for (const file of $("upload").files) {
    await fetch("api/files/" + encodeURIComponent(file.name), { method: "PUT", body: file });
  }
  $("upload").value = "";
  loadFiles();
});

loadHistory();
connectWS();
loadFiles();
