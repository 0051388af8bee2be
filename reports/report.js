(function () {
  "use strict";
  function cellValue(td) {
    var v = td.getAttribute("data-v");
    if (v !== null) { var x = parseFloat(v); return isNaN(x) ? (v === "nan" ? -Infinity : v) : x; }
    return td.textContent.trim();
  }
  function sortBy(table, col, th) {
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var asc = !th.classList.contains("sorted-asc");
    rows.sort(function (a, b) {
      var x = cellValue(a.cells[col]), y = cellValue(b.cells[col]);
      if (typeof x === "number" && typeof y === "number") { return asc ? x - y : y - x; }
      return asc ? String(x).localeCompare(String(y)) : String(y).localeCompare(String(x));
    });
    Array.prototype.forEach.call(th.parentNode.children, function (h) { h.classList.remove("sorted-asc", "sorted-desc"); });
    th.classList.add(asc ? "sorted-asc" : "sorted-desc");
    rows.forEach(function (r) { body.appendChild(r); });
  }
  Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), function (table) {
    if (!table.tHead || !table.tBodies.length) { return; }
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, i) {
      th.title = "click to sort";
      th.addEventListener("click", function () { sortBy(table, i, th); });
    });
  });
  Array.prototype.forEach.call(document.querySelectorAll("input[data-filter]"), function (input) {
    var table = document.getElementById(input.getAttribute("data-filter"));
    if (!table || !table.tBodies.length) { return; }
    input.addEventListener("input", function () {
      var q = input.value.trim().toLowerCase();
      Array.prototype.forEach.call(table.tBodies[0].rows, function (row) {
        row.style.display = !q || row.cells[0].textContent.toLowerCase().indexOf(q) >= 0 ? "" : "none";
      });
    });
  });
  document.body.setAttribute("data-js-ok", "1");
})();
