/* Click-to-sort for every <table class="sortable"> (numbers by value, or by a cell's data-sort). */
(function () {
  "use strict";
  function key(td) {
    var raw = td.hasAttribute("data-sort") ? td.getAttribute("data-sort") : td.textContent.trim();
    var n = Number(raw);
    return raw !== "" && !isNaN(n) ? { n: n } : { s: raw.toLowerCase() };
  }
  function cmp(a, b) {
    if (a.n !== undefined && b.n !== undefined) { return a.n - b.n; }
    if (a.n !== undefined) { return -1; }
    if (b.n !== undefined) { return 1; }
    return a.s.localeCompare(b.s);
  }
  Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), function (table) {
    var ths = table.tHead ? table.tHead.rows[0].cells : [];
    Array.prototype.forEach.call(ths, function (th, col) {
      th.tabIndex = 0;
      th.title = "click to sort";
      var dir = 1;
      function sort() {
        var body = table.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        rows.sort(function (x, y) { return cmp(key(x.cells[col]), key(y.cells[col])) * dir; });
        rows.forEach(function (r) { body.appendChild(r); });
        Array.prototype.forEach.call(ths, function (h) { h.classList.remove("sorted-asc", "sorted-desc"); });
        th.classList.add(dir > 0 ? "sorted-asc" : "sorted-desc");
        dir = -dir;
      }
      th.addEventListener("click", sort);
      th.addEventListener("keydown", function (e) { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); sort(); } });
    });
  });
})();
