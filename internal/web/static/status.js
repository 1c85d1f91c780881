// Shared by the landing and starting pages: shows the sandbox's state live
// from the edge's status stream and hands each state to the page.
function followStatus(onState) {
  const es = new EventSource("/_/status/stream");
  es.addEventListener("state", (ev) => {
    const s = JSON.parse(ev.data);
    const phase = document.getElementById("phase");
    phase.textContent = s.phase;
    phase.className = "phase phase-" + s.phase;
    document.getElementById("reason").textContent = s.reason || "";
    if (onState) onState(s, es);
  });
  return es;
}
