// Progressive enhancement only: every page works without it. Copy buttons (hidden until this runs) and focus
// on the first problem a page reports.
"use strict";
document.addEventListener("DOMContentLoaded", function () {
  document.querySelectorAll("button.copy[data-copy]").forEach(function (button) {
    var source = document.getElementById(button.getAttribute("data-copy"));
    var status = button.parentElement.querySelector(".copied");
    if (!source || !navigator.clipboard) { return; }
    button.hidden = false;
    button.addEventListener("click", function () {
      navigator.clipboard.writeText(source.textContent.trim()).then(function () {
        if (status) { status.textContent = "Copied."; }
      }, function () {
        if (status) { status.textContent = "Copy failed: select the text and copy it."; }
      });
    });
  });
  var problem = document.querySelector("[data-autofocus]");
  if (problem) { problem.focus(); }
});
