// The sign-in prompt: shown instead of any view while this tab has no (valid) token.

import { ApiError, setToken, tokenIsValid } from "../api.js";
import { fill, h } from "../dom.js";

/** Render the prompt into `main`; `onSignedIn()` runs once a token was accepted. */
export function loginView(main, { message = "", notice = "", onSignedIn }) {
  const input = h("input", {
    id: "token",
    name: "token",
    type: "password",
    autocomplete: "current-password",
    placeholder: "service token",
    required: true,
    spellcheck: "false",
  });
  const error = h("p", { class: "login-error", id: "login-error", role: "alert" }, message);
  error.hidden = !message;
  const button = h("button", { type: "submit", class: "btn btn-primary" }, "Sign in");

  const form = h(
    "form",
    { class: "login-form", id: "login-form", novalidate: true },
    h("label", { for: "token" }, "Token"),
    h("div", { class: "login-row" }, input, button),
    error,
    notice ? h("p", { class: "login-notice muted", id: "login-notice" }, notice) : null,
  );
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const token = input.value.trim();
    if (!token) {
      showError("Enter the token.");
      return;
    }
    form.querySelector("#login-notice")?.remove();
    button.disabled = true;
    button.textContent = "Checking…";
    try {
      if (await tokenIsValid(token)) {
        setToken(token);
        onSignedIn();
        return;
      }
      showError("The service refused this token.");
    } catch (err) {
      showError(err instanceof ApiError ? err.message : `Could not reach the service: ${err.message}`);
    } finally {
      button.disabled = false;
      button.textContent = "Sign in";
    }
  });

  function showError(text) {
    error.textContent = text;
    error.hidden = false;
    input.select();
  }

  fill(
    main,
    h(
      "section",
      { class: "card login-card", id: "login" },
      h("h1", {}, "Sign in"),
      h(
        "p",
        { class: "muted" },
        "The dashboard shows jobs of this dlrm-vrgd service once you enter its token: ",
        h("code", {}, "DLRM_VRGD_TOKEN"),
        ", or the one the service printed when it started (kept in ",
        h("code", {}, "DATA_DIR/token"),
        ").",
      ),
      form,
      h(
        "p",
        { class: "muted small" },
        "The token stays in this browser tab (session storage) until you sign out or close the tab. ",
        "It is sent only in the Authorization header, never in a URL.",
      ),
    ),
  );
  document.title = "Sign in — dlrm-vrgd";
  input.focus();
}
