// Landing page: signup that shows the token once, live sandbox state, and
// the confirmed delete/recreate actions. Everything else is plain forms.
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

const account = document.getElementById("account");
if (account) {
  const user = account.dataset.user;
  followStatus();
  for (const [id, method, url] of [["recreate", "POST", "/recreate"], ["delete", "DELETE", "/users/" + user]]) {
    const b = document.getElementById(id);
    b.addEventListener("click", async () => {
      if (!confirm(b.dataset.confirm)) return;
      b.disabled = true;
      const resp = await fetch(url, { method, headers: { "Accept": "application/json" } });
      if (!resp.ok) { b.disabled = false; showError(await problem(resp)); return; }
      location.href = "/";
    });
  }
}
