// Follows the sandbox's state and reloads once it is Ready.
const es = new EventSource("/_/status/stream");
es.addEventListener("state", (ev) => {
  const s = JSON.parse(ev.data);
  const phase = document.getElementById("phase");
  phase.textContent = s.phase;
  phase.className = "phase phase-" + s.phase;
  document.getElementById("reason").textContent = s.reason || "";
  if (s.phase === "Ready") { es.close(); location.reload(); }
});
es.onerror = () => setTimeout(() => location.reload(), 3000);
