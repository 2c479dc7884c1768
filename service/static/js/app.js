// Entry point: pick the view from the path, but only once this tab holds a token; without
// one (or after a 401) only the sign-in prompt is shown and no data is requested.
//
//   /ui/               job list            /ui/compare?ids=a,b  compare AUC curves
//   /ui/jobs/<id>      one job, live       /ui/studies          study jobs

import { clearToken, getToken, onUnauthorized } from "./api.js";
import { destroyAll } from "./charts.js";
import { fill, h } from "./dom.js";
import { compareView } from "./views/compare.js";
import { jobView } from "./views/job.js";
import { jobsView } from "./views/jobs.js";
import { loginView } from "./views/login.js";
import { studiesView } from "./views/studies.js";

window.dashboard ??= {};
window.dashboard.charts ??= {};

const main = document.getElementById("main");
const session = document.getElementById("session");
let current = null;

function route() {
  const path = location.pathname.replace(/\/+$/, "");
  const job = /^\/ui\/jobs\/([^/]+)$/.exec(path);
  if (job) return { nav: "jobs", render: () => jobView(main, decodeURIComponent(job[1])) };
  if (path === "/ui/compare") return { nav: "compare", render: () => compareView(main) };
  if (path === "/ui/studies") return { nav: "studies", render: () => studiesView(main) };
  if (path === "/ui" || path === "") return { nav: "jobs", render: () => jobsView(main) };
  return { nav: null, render: () => fill(main, h("section", { class: "card notice" }, h("h1", {}, "Not found"), h("a", { href: "/ui/" }, "← All jobs"))) };
}

function leave() {
  current?.stop?.();
  current = null;
  destroyAll();
}

function showLogin(message = "", notice = "") {
  leave();
  session.hidden = true;
  window.dashboard.view = "login";
  loginView(main, { message, notice, onSignedIn: show });
}

async function show() {
  if (!getToken()) {
    showLogin();
    return;
  }
  leave();
  session.hidden = false;
  const { nav, render } = route();
  for (const a of document.querySelectorAll("[data-nav]")) {
    a.classList.toggle("active", a.dataset.nav === nav);
  }
  window.dashboard.view = nav;
  try {
    current = await render();
    if (!getToken()) leave(); // a 401 while the view started: the prompt is up, stop the view
  } catch (err) {
    if (!getToken()) return; // a 401 already brought up the sign-in prompt
    console.error(err);
    fill(main, h("section", { class: "card notice error" }, h("h1", {}, "Something went wrong"), h("p", {}, err.message)));
  }
}

onUnauthorized((message) => showLogin(message));
document.getElementById("sign-out").addEventListener("click", () => {
  clearToken();
  showLogin("", "Signed out.");
});
window.addEventListener("pagehide", leave);
show();
