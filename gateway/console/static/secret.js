// A new API key's secret on the tenant page (shown once): a Copy button, and an address bar that
// points at the tenant's page instead of the form's POST, so a reload shows the page rather than
// posting the form again (which would only say the key was already made). The button is hidden
// in the HTML and shown here: without this script there is no button that does nothing. Copying
// uses the asynchronous clipboard where the browser allows it (https or localhost), else it
// selects the secret for the operator's own Ctrl+C. No inline script: the CSP forbids it.
(function () {
  "use strict";

  function start() {
    var card = document.getElementById("new-key");
    var field = document.getElementById("new-key-secret");
    var button = document.getElementById("copy-secret");
    var status = document.getElementById("copy-status");
    if (!card || !field || !button || !status) { return; }

    function selectForCopy() {
      field.focus();
      field.select();
      field.setSelectionRange(0, field.value.length);
      status.textContent = "Selected: press Ctrl+C (⌘C on a Mac) to copy it.";
    }

    button.hidden = false;
    button.addEventListener("click", function () {
      if (navigator.clipboard && window.isSecureContext) {
        navigator.clipboard.writeText(field.value).then(function () {
          status.textContent = "Copied to the clipboard.";
        }, selectForCopy);
      } else {
        selectForCopy();
      }
    });

    var page = card.getAttribute("data-page");
    if (page && window.history && window.history.replaceState) {
      window.history.replaceState(null, "", page);
    }
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
