// Landing page: signup that shows the token once, and the user's page
// live: the sandbox's state and when and why it will sleep. Every action
// is a plain form (recreate and delete confirmed on a page of their own).
document.documentElement.classList.add("js");

function showError(msg) {
  let el = document.querySelector(".error");
  if (!el) {
    el = document.createElement("p");
    el.className = "error";
    el.setAttribute("role", "alert");
    document.querySelector("main").insertBefore(el, document.querySelector("main section"));
  }
  el.textContent = msg;
}

async function problem(resp) {
  try { const j = await resp.json(); return j.error || resp.statusText; } catch { return resp.statusText; }
}

const signup = document.getElementById("signup");
if (signup) {
  signup.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const button = document.getElementById("signup-submit");
    button.disabled = true;
    button.textContent = "Creating…";
    try {
      const resp = await fetch("/users", { method: "POST", headers: { "Accept": "application/json" }, body: new URLSearchParams(new FormData(signup)) });
      if (resp.status !== 201 && resp.status !== 202) { showError(await problem(resp)); return; }
      const j = await resp.json();
      signup.hidden = true;
      document.getElementById("token").textContent = j.token;
      document.getElementById("continue").href = j.url;
      document.getElementById("token-box").hidden = false;
    } finally {
      button.disabled = false;
      button.textContent = "Sign up";
    }
  });
  document.getElementById("copy-token").addEventListener("click", () => navigator.clipboard && navigator.clipboard.writeText(document.getElementById("token").textContent));
}

if (document.getElementById("account")) followStatus(showSleep);

// The user's page follows when and why the sandbox will sleep, in the
// server's words.
function showSleep(s) {
  const when = (t) => t ? new Date(t).toUTCString().replace(" GMT", " UTC") : "";
  const set = (id, text) => { const el = document.getElementById(id); if (el) el.textContent = text; };
  const show = (id, on) => { const el = document.getElementById(id); if (el) el.hidden = !on; };
  set("last-active", when(s.last_active)); show("last-active-line", !!s.last_active);
  show("busy", !!s.busy);
  set("suspend-at", when(s.suspend_at)); set("suspend-why", s.suspend_why || ""); show("suspend-line", !!s.suspend_at);
  set("keep-awake-until", when(s.keep_awake_until)); show("keep-awake-line", !!s.keep_awake_until);
  set("slept", s.slept || ""); show("slept", !!s.slept);
}
