/* Compatibility matrix: render, filter and sort the rows embedded as JSON in #matrix-data.
 * Vanilla JS, no network: the data is in the page because file:// forbids fetch().
 * Only textContent is ever assigned, so model-supplied strings cannot inject markup. */
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("matrix-data").textContent);
  var rows = data.rows;
  var configs = data.configs;
  var severity = {};
  data.outcomes.forEach(function (o, i) { severity[o] = i; });

  var columns = [
    { key: "model", label: "model", type: "text" },
    { key: "arch", label: "arch", type: "text" },
    { key: "task", label: "task", type: "text" },
    { key: "modality", label: "modality", type: "text" }
  ];
  configs.forEach(function (c, i) {
    columns.push({ key: "o" + i, index: i, label: configs.length === 1 ? "outcome" : c, title: c, type: "outcome" });
  });
  columns.push({ key: "rmse_ratio", label: "rmse_ratio", type: "num" });
  columns.push({ key: "op", label: "unsupported op", type: "text" });
  columns.push({ key: "error", label: "error", type: "text" });
  columns.push({ key: "wall", label: "wall (s)", type: "num" });

  function value(row, col) {
    if (col.type === "outcome") { return row.outcomes[col.index]; }
    return row[col.key];
  }
  function num(v) {
    if (v === null || v === undefined || v === "") { return null; }
    var n = Number(v);
    return isNaN(n) ? null : n;
  }
  function fmt(v) {
    var n = num(v);
    if (n === null) { return ""; }
    if (!isFinite(n)) { return n > 0 ? "inf" : "-inf"; }
    if (n === 0) { return "0"; }
    var a = Math.abs(n);
    return (a >= 1e4 || a < 1e-3) ? n.toExponential(2) : String(Number(n.toPrecision(3)));
  }

  var $ = function (id) { return document.getElementById(id); };
  var text = $("filter-text"), outcome = $("filter-outcome"), arch = $("filter-arch");
  var task = $("filter-task"), modality = $("filter-modality");
  var head = $("matrix-head"), body = $("matrix-body"), count = $("row-count"), empty = $("matrix-empty");
  var sortKey = null, sortDir = 1;

  function fillSelect(sel, values) {
    values.forEach(function (v) {
      var opt = document.createElement("option");
      opt.value = v;
      opt.textContent = v === "" ? "(unknown)" : v;
      sel.appendChild(opt);
    });
  }
  function uniq(key) {
    var seen = {};
    rows.forEach(function (r) { seen[r[key]] = true; });
    return Object.keys(seen).sort();
  }
  var present = {};
  rows.forEach(function (r) { r.outcomes.forEach(function (o) { if (o) { present[o] = true; } }); });
  fillSelect(outcome, data.outcomes.filter(function (o) { return present[o]; }));
  fillSelect(arch, uniq("arch"));
  fillSelect(task, uniq("task"));
  fillSelect(modality, uniq("modality"));

  columns.forEach(function (col) {
    var th = document.createElement("th");
    th.textContent = col.label;
    th.title = (col.title || col.label) + " (click to sort)";
    th.dataset.key = col.key;
    th.tabIndex = 0;
    if (col.type === "num") { th.className = "num"; }
    th.addEventListener("click", function () { sortBy(col.key); });
    th.addEventListener("keydown", function (e) { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); sortBy(col.key); } });
    head.appendChild(th);
  });

  function sortBy(key) {
    if (sortKey === key) { sortDir = -sortDir; } else { sortKey = key; sortDir = 1; }
    render();
  }

  function compare(col) {
    return function (a, b) {
      var va = value(a, col), vb = value(b, col);
      if (col.type === "num") {
        va = num(va); vb = num(vb);
        if (va === null && vb === null) { return 0; }
        if (va === null) { return 1; }   /* missing values last in both directions */
        if (vb === null) { return -1; }
        return (va - vb) * sortDir;
      }
      if (col.type === "outcome") {
        va = va ? severity[va] : 99; vb = vb ? severity[vb] : 99;
        return (va - vb) * sortDir;
      }
      return String(va).localeCompare(String(vb)) * sortDir;
    };
  }

  function matches(r, q) {
    if (outcome.value && r.outcomes.indexOf(outcome.value) < 0) { return false; }
    if (arch.value && r.arch !== arch.value) { return false; }
    if (task.value && r.task !== task.value) { return false; }
    if (modality.value && r.modality !== modality.value) { return false; }
    if (q) {
      var hay = (r.model + " " + r.arch + " " + r.task + " " + r.modality + " " + r.op + " " + r.error).toLowerCase();
      if (hay.indexOf(q) < 0) { return false; }
    }
    return true;
  }

  function cell(tr, col, r) {
    var td = document.createElement("td");
    var v = value(r, col);
    if (col.key === "model") {
      var a = document.createElement("a");
      a.href = r.href;
      a.className = "model";
      a.textContent = r.model;
      td.appendChild(a);
    } else if (col.type === "outcome") {
      var s = document.createElement("span");
      var fb = (r.fallback || [])[col.index];
      s.className = "chip o-" + (v || "none") + (fb ? " fallback" : "");
      s.textContent = (v || "-") + (fb ? " +cpu" : "");
      if (fb) { s.title = "ran with CPU fallback: " + fb; }
      td.appendChild(s);
    } else if (col.type === "num") {
      td.className = "num";
      td.textContent = fmt(v);
    } else {
      td.textContent = v === "" ? "" : v;
    }
    tr.appendChild(td);
  }

  function render() {
    var q = text.value.trim().toLowerCase();
    var shown = rows.filter(function (r) { return matches(r, q); });
    if (sortKey) {
      var col = columns.filter(function (c) { return c.key === sortKey; })[0];
      shown.sort(compare(col));
    }
    var frag = document.createDocumentFragment();
    shown.forEach(function (r) {
      var tr = document.createElement("tr");
      tr.dataset.model = r.model;
      columns.forEach(function (col) { cell(tr, col, r); });
      frag.appendChild(tr);
    });
    body.replaceChildren(frag);
    Array.prototype.forEach.call(head.children, function (th) {
      th.removeAttribute("aria-sort");
      th.classList.remove("sorted-asc", "sorted-desc");
      if (th.dataset.key === sortKey) {
        th.setAttribute("aria-sort", sortDir > 0 ? "ascending" : "descending");
        th.classList.add(sortDir > 0 ? "sorted-asc" : "sorted-desc");
      }
    });
    count.textContent = shown.length + " of " + rows.length + " models";
    empty.hidden = shown.length > 0;
    saveHash();
  }

  /* Filters live in the URL hash so links like matrix.html#outcome=drift work (also on file://). */
  var fields = { q: text, outcome: outcome, arch: arch, task: task, modality: modality };
  function saveHash() {
    var parts = [];
    Object.keys(fields).forEach(function (k) {
      if (fields[k].value) { parts.push(k + "=" + encodeURIComponent(fields[k].value)); }
    });
    var h = parts.length ? "#" + parts.join("&") : " ";
    try { history.replaceState(null, "", h === " " ? location.pathname + location.search : h); } catch (e) { /* ignore */ }
  }
  function loadHash() {
    location.hash.replace(/^#/, "").split("&").forEach(function (kv) {
      var i = kv.indexOf("=");
      if (i < 0) { return; }
      var k = kv.slice(0, i), v = decodeURIComponent(kv.slice(i + 1));
      if (fields[k]) { fields[k].value = v; }
    });
  }

  loadHash();
  text.addEventListener("input", render);
  [outcome, arch, task, modality].forEach(function (s) { s.addEventListener("change", render); });
  $("filters").addEventListener("reset", function () { setTimeout(render, 0); });
  $("filters").addEventListener("submit", function (e) { e.preventDefault(); });
  render();
})();
