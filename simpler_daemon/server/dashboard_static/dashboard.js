// simpler-daemon dashboard: plain JavaScript, no framework, no build step.
// Every value from the daemon is written with textContent (never as HTML), so a label
// or an error text holding "<script>" shows as text. The view on screen polls its JSON
// about once a second, and nothing while the tab is hidden.
(function () {
  "use strict";
  var KEY = "simpler-dashboard-token";
  var PERIOD_MS = 1000;
  var app = document.getElementById("app");
  var timer = null;
  var generation = 0;
  var level = 0;
  var runFilter = { state: "", owner: "", before: [] };

  // -- DOM helpers ------------------------------------------------------------------
  function el(tag, attrs) {
    var node = document.createElement(tag);
    var key;
    for (key in attrs || {}) {
      if (key === "text") node.textContent = attrs[key];
      else if (key === "cls") node.className = attrs[key];
      else node.setAttribute(key, attrs[key]);
    }
    for (var i = 2; i < arguments.length; i++) {
      var child = arguments[i];
      if (child === null || child === undefined) continue;
      node.appendChild(typeof child === "object" ? child : document.createTextNode(String(child)));
    }
    return node;
  }
  function svg(tag, attrs, text) {
    var node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (var key in attrs) node.setAttribute(key, attrs[key]);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); return node; }
  function short(value, prefix) { return String(value || "").replace(prefix, "").toLowerCase(); }
  function badge(text) { return el("span", { cls: "badge " + text, text: text }); }
  function bytes(n) {
    n = Number(n || 0);
    var units = ["B", "KiB", "MiB", "GiB", "TiB"];
    var i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }
  function age(seconds) {
    seconds = Number(seconds || 0);
    if (seconds < 60) return seconds.toFixed(1) + " s";
    if (seconds < 3600) return Math.floor(seconds / 60) + " min " + Math.floor(seconds % 60) + " s";
    if (seconds < 86400) return Math.floor(seconds / 3600) + " h " + Math.floor((seconds % 3600) / 60) + " min";
    return Math.floor(seconds / 86400) + " d " + Math.floor((seconds % 86400) / 3600) + " h";
  }
  function table(headings, rows) {
    var head = el("tr");
    headings.forEach(function (h) { head.appendChild(el("th", { text: h })); });
    var body = el("tbody");
    rows.forEach(function (r) { body.appendChild(r); });
    return el("table", {}, el("thead", {}, head), body);
  }
  function cell(value, cls) { return el("td", cls ? { cls: cls } : {}, value); }
  function progress(counts) {
    var total = Number(counts.total || 0), done = Number(counts.done || 0);
    var failed = Number(counts.failed || 0);
    var bar = el("div", { cls: "progress", "data-done": done, "data-failed": failed, "data-total": total });
    var okPart = el("div", { cls: "done" });
    var badPart = el("div", { cls: "failed" });
    var scale = total > 0 ? 100 / total : 0;
    okPart.style.width = Math.min(100, done * scale) + "%";
    badPart.style.left = Math.min(100, done * scale) + "%";
    badPart.style.width = Math.min(100, failed * scale) + "%";
    bar.appendChild(okPart);
    bar.appendChild(badPart);
    var text = done + " done" + (failed ? ", " + failed + " failed" : "") + " / " + total;
    return el("div", {}, bar, el("span", { cls: "progress-text", text: text }));
  }
  function card(key, value, sub) {
    return el("div", { cls: "card" }, el("div", { cls: "k", text: key }),
      el("div", { cls: "v" }, value), sub ? el("div", { cls: "sub", text: sub }) : null);
  }

  // -- data -------------------------------------------------------------------------
  function headers() {
    var token = sessionStorage.getItem(KEY);
    return token ? { Authorization: "Bearer " + token } : {};
  }
  function api(path) {
    return fetch(path, { headers: headers(), cache: "no-store" }).then(function (answer) {
      if (answer.status === 401) {
        sessionStorage.removeItem(KEY);
        window.location.reload();
        throw new Error("the token was refused (401)");
      }
      return answer.json().then(function (data) {
        if (!answer.ok) throw new Error(data.error || ("HTTP " + answer.status));
        return data;
      });
    });
  }
  function status(text, failed) {
    var line = document.getElementById("status-line");
    line.textContent = text;
    line.className = failed ? "error" : "";
  }

  // -- views ------------------------------------------------------------------------
  function overview(main) {
    return api("/api/overview").then(function (o) {
      level = o.level;
      var serving = short(o.serving_state, "SERVING_STATE_");
      var heap = o.heap || {};
      var q = o.queues || {};
      var runs = o.runs_by_state || {};
      var restarts = o.restarts || {};
      clear(main).appendChild(el("h2", { text: "Overview: " + o.hostname }));
      var heapBar = progress({ total: heap.size_bytes, done: heap.used_bytes });
      heapBar.lastChild.textContent = bytes(heap.used_bytes) + " of " + bytes(heap.size_bytes);
      main.appendChild(el("div", { cls: "cards", id: "overview-cards" },
        card("serving", badge(serving), o.serving_reason || "admitting runs"),
        card("version", o.version, "level " + o.level + ", pid " + o.pid),
        card("uptime", age(o.uptime_seconds)),
        card("heap used", heapBar),
        card("queues", q.ready_tasks + " tasks ready", q.queued_runs + " runs queued, " + q.active_runs + " active"),
        card("admission", (o.limits || {}).admission || "", "max " + (o.limits || {}).max_concurrent_runs + " concurrent runs"),
        card("runs kept", Object.keys(runs).map(function (k) { return k + " " + runs[k]; }).join(", ")),
        card("worker restarts", Object.keys(restarts).map(function (k) { return k + " " + restarts[k]; }).join(", ") || "none"),
        card("you are", o.caller, o.caller_is_admin ? "an admin: you see every client's runs" : "you see your own runs")));
    });
  }

  function workerRow(w, child) {
    var kind = short(w.kind, "WORKER_KIND_");
    var remote = w.remote && w.remote.host ? w.remote : null;
    var where = remote ? remote.host + ":" + remote.port : (w.pid ? "pid " + w.pid : "");
    var health = remote ? "health " + age(remote.health_age_seconds) + ", round trip " +
      (Number(remote.round_trip_us || 0) / 1000).toFixed(2) + " ms, " + remote.reconnects + " reconnects" : "";
    var cause = w.message || (w.last_restart_cause ? "last restart: " + w.last_restart_cause : "");
    var row = el("tr", { cls: "worker-row" + (child ? " child" : ""), "data-worker-id": w.worker_id, "data-kind": kind },
      cell(String(w.worker_id)), cell(kind), cell(badge(short(w.state, "WORKER_STATE_"))), cell(where, "where"),
      cell(w.current_task || health, "text"), cell(String(w.tasks_completed), "num"),
      cell(String(w.restarts), "num restarts"), cell(cause, "text cause"));
    return row;
  }
  function workers(main) {
    return api("/api/workers").then(function (data) {
      level = data.level;
      var rows = [];
      data.workers.forEach(function (w) {
        rows.push(workerRow(w, false));
        (w.children || []).forEach(function (c) { rows.push(workerRow(c, true)); });
      });
      clear(main).appendChild(el("h2", { text: "Workers (" + data.workers.length + ")" }));
      main.appendChild(table(["id", "kind", "state", "pid or host", "current task", "tasks done", "restarts", "cause"], rows));
      if (data.truncated) main.appendChild(el("p", { cls: "note", text: "more workers than one answer holds" }));
    });
  }

  function runsQuery() {
    var parts = ["limit=50"];
    if (runFilter.state) parts.push("state=" + encodeURIComponent(runFilter.state));
    if (runFilter.owner) parts.push("owner=" + encodeURIComponent(runFilter.owner));
    var before = runFilter.before[runFilter.before.length - 1];
    if (before) parts.push("before=" + before);
    return "/api/runs?" + parts.join("&");
  }
  function runFilters(main, admin) {
    var select = el("select", { id: "state-filter" }, el("option", { value: "", text: "any state" }));
    ["queued", "building", "prepared", "executing", "completed", "failed", "cancelled", "lost"].forEach(function (s) {
      var option = el("option", { value: s, text: s });
      if (s === runFilter.state) option.selected = true;
      select.appendChild(option);
    });
    select.addEventListener("change", function () { runFilter.state = select.value; runFilter.before = []; refresh(); });
    var owner = el("input", { id: "owner-filter", placeholder: admin ? "owner, e.g. uid:1000" : "your runs only", size: "22" });
    owner.value = runFilter.owner;
    owner.disabled = !admin;
    owner.addEventListener("change", function () { runFilter.owner = owner.value.trim(); runFilter.before = []; refresh(); });
    main.appendChild(el("div", { cls: "filters" }, el("label", {}, "State ", select), el("label", {}, "Owner ", owner)));
  }
  function runs(main) {
    return api(runsQuery()).then(function (data) {
      // The filters are drawn once per visit: a refresh must not wipe what is being typed.
      var box = document.getElementById("runs-view");
      if (!box) {
        clear(main).appendChild(el("h2", { text: "Runs" }));
        runFilters(main, data.caller_is_admin);
        box = el("div", { id: "runs-view" });
        main.appendChild(box);
      }
      clear(box);
      var rows = data.runs.map(function (r) {
        var link = el("a", { href: "#/runs/" + Number(r.run_id), text: String(r.run_id) });
        return el("tr", { cls: "run-row", "data-run-id": r.run_id },
          cell(link), cell(badge(r.state)), cell(r.label, "text label"), cell(r.client),
          cell(progress(r.counts)), cell(age(r.age_seconds), "num"),
          cell(r.error.length > 240 ? r.error.slice(0, 240) + "… (the run's page has all of it)" : r.error, "text error-text"));
      });
      box.appendChild(table(["run", "state", "label", "owner", "progress", "age", "error"], rows));
      if (!rows.length) box.appendChild(el("p", { cls: "note", text: "no runs to show" }));
      var pager = el("div", { cls: "filters" });
      if (runFilter.before.length) {
        var newer = el("button", { text: "newest" });
        newer.addEventListener("click", function () { runFilter.before = []; refresh(); });
        pager.appendChild(newer);
      }
      if (data.next_before) {
        var older = el("button", { id: "older", text: "older runs" });
        older.addEventListener("click", function () { runFilter.before.push(data.next_before); refresh(); });
        pager.appendChild(older);
      }
      box.appendChild(pager);
    });
  }

  function gantt(trace) {
    var events = trace.traceEvents || [];
    var lanes = {}, spans = [], t0 = Infinity, t1 = -Infinity;
    events.forEach(function (e) {
      if (e.ph === "M" && e.name === "thread_name") lanes[e.tid] = e.args.name;
      if (e.ph === "X") { spans.push(e); t0 = Math.min(t0, e.ts); t1 = Math.max(t1, e.ts + e.dur); }
    });
    var ids = Object.keys(lanes).map(Number).sort(function (a, b) { return a - b; });
    var box = el("div", { cls: "gantt", id: "gantt" });
    if (!spans.length) return box;
    var labelWidth = 130, width = 900, laneHeight = 22, top = 20;
    var span = Math.max(t1 - t0, 1);
    var picture = svg("svg", { width: labelWidth + width + 10, height: top + ids.length * laneHeight + 4, role: "img" });
    picture.appendChild(svg("text", { x: labelWidth, y: 13 }, "0 ms"));
    picture.appendChild(svg("text", { x: labelWidth + width - 70, y: 13 }, (span / 1000).toFixed(2) + " ms"));
    ids.forEach(function (tid, i) {
      var y = top + i * laneHeight;
      picture.appendChild(svg("rect", { x: labelWidth, y: y, width: width, height: laneHeight - 4, "class": "lane-bg" }));
      picture.appendChild(svg("text", { x: 4, y: y + 13 }, lanes[tid]));
    });
    spans.forEach(function (e) {
      var y = top + ids.indexOf(e.tid) * laneHeight;
      var x = labelWidth + ((e.ts - t0) / span) * width;
      var args = e.args || {};
      var isTask = e.cat === "task";
      var failed = isTask && args.outcome !== "SUCCESS";
      var rect = svg("rect", { x: x.toFixed(1), y: y, height: laneHeight - 4,
        width: Math.max(1, (e.dur / span) * width).toFixed(1),
        "class": (isTask ? "span" : "run-span") + (failed ? " failed" : "") });
      var what = isTask ? e.name + " (task " + args.task + (args.attempt > 1 ? ", attempt " + args.attempt : "") + ")" : e.name;
      rect.appendChild(svg("title", {}, what + ": " + (e.dur / 1000).toFixed(3) + " ms" +
        (isTask ? ", " + args.outcome : "")));
      picture.appendChild(rect);
    });
    box.appendChild(picture);
    return box;
  }
  function download(runId) {
    fetch("/api/runs/" + runId + "/trace?download=1", { headers: headers(), cache: "no-store" })
      .then(function (answer) { return answer.blob(); })
      .then(function (blob) {
        var link = el("a", { href: URL.createObjectURL(blob), download: "run-" + runId + "-trace.json" });
        document.body.appendChild(link);
        link.click();
        link.remove();
      }).catch(function (err) { status("cannot download the trace: " + err.message, true); });
  }
  var finishedTrace = { id: null, trace: null };  // a finished run's trace does not change
  var TERMINAL = { completed: 1, failed: 1, cancelled: 1, lost: 1 };
  function traceOf(runId) {
    if (finishedTrace.id === runId) return Promise.resolve(finishedTrace.trace);
    return api("/api/runs/" + runId + "/trace").catch(function (err) {
      return { traceEvents: [], otherData: { note: err.message } };
    });
  }
  function run(main, runId) {
    return Promise.all([api("/api/runs/" + runId), traceOf(runId)]).then(function (got) {
      var r = got[0], trace = got[1];
      if (r.state in TERMINAL && !(trace.otherData || {}).note) finishedTrace = { id: runId, trace: trace };
      clear(main).appendChild(el("h2", {}, "Run " + r.run_id + " ", badge(r.state)));
      var error = r.error && r.error.message ? r.error.message : "";
      main.appendChild(el("div", { cls: "cards" },
        card("label", el("span", { id: "run-label", text: r.label || "(none)" })),
        card("owner", r.client, "priority " + r.priority),
        card("progress", progress(r.counts), (r.counts.running || 0) + " running"),
        card("age", age(r.age_seconds))));
      if (error) main.appendChild(el("p", { cls: "error-text", id: "run-error", text: error }));
      main.appendChild(el("h3", { text: "Task stream per lane" }));
      main.appendChild(gantt(trace));
      var other = trace.otherData || {};
      if (other.note) main.appendChild(el("p", { cls: "note", text: other.note }));
      if (other.not_drawn) main.appendChild(el("p", { cls: "note", text: other.not_drawn + " more tasks are in the downloaded trace" }));
      var link = el("a", { href: "#/runs/" + r.run_id, id: "trace-download", text: "Download the trace (Chrome trace JSON: chrome://tracing, Perfetto)" });
      link.addEventListener("click", function (event) { event.preventDefault(); download(r.run_id); });
      main.appendChild(el("p", {}, link));
    });
  }

  function remote(main) {
    return api("/api/workers").then(function (data) {
      level = data.level;
      clear(main).appendChild(el("h2", { text: "Remote hosts" }));
      if (data.level !== 4) {
        main.appendChild(el("p", { cls: "note", text: "Remote L3 hosts exist at level 4 only; this daemon is level " + data.level + "." }));
        return;
      }
      var rows = data.workers.filter(function (w) { return short(w.kind, "WORKER_KIND_") === "remote_l3"; }).map(function (w) {
        var r = w.remote || {};
        return el("tr", { cls: "remote-row", "data-worker-id": w.worker_id },
          cell(String(w.worker_id)), cell(r.host + ":" + r.port), cell(badge(short(r.state, "REMOTE_SESSION_STATE_"))),
          cell(String(r.runner_pid || "")), cell(age(r.health_age_seconds), "num"),
          cell((Number(r.round_trip_us || 0) / 1000).toFixed(2) + " ms", "num"), cell(String(r.failures), "num"),
          cell(String(r.reconnects), "num"), cell(w.message, "text"));
      });
      main.appendChild(table(["id", "host", "session", "runner pid", "health age", "round trip", "failures", "reconnects", "cause"], rows));
      if (!rows.length) main.appendChild(el("p", { cls: "note", text: "no remote workers" }));
    });
  }

  // -- routing and polling ----------------------------------------------------------
  function route() {
    var hash = window.location.hash || "#/overview";
    var match = /^#\/runs\/([0-9]+)$/.exec(hash);
    if (match) return { name: "runs", draw: function (main) { return run(main, match[1]); } };
    var views = { "#/overview": overview, "#/workers": workers, "#/runs": runs, "#/remote": remote };
    var name = hash.slice(2);
    return { name: name in { overview: 1, workers: 1, runs: 1, remote: 1 } ? name : "overview",
      draw: views[hash] || overview };
  }
  function refresh() {
    clearTimeout(timer);
    var mine = ++generation;
    var view = route();
    document.querySelectorAll("header nav a").forEach(function (a) {
      a.className = a.getAttribute("data-view") === view.name ? "active" : "";
      if (a.getAttribute("data-view") === "remote") a.hidden = level === 3;
    });
    if (document.hidden) return;
    view.draw(document.getElementById("main")).then(function () {
      if (mine === generation) status("updated " + new Date().toLocaleTimeString(), false);
    }, function (err) {
      if (mine === generation) status(err.message, true);
    }).then(function () {
      if (mine === generation) timer = setTimeout(refresh, PERIOD_MS);
    });
  }
  function start() {
    clear(app);
    var nav = el("nav");
    [["overview", "Overview"], ["workers", "Workers"], ["runs", "Runs"], ["remote", "Remote hosts"]].forEach(function (v) {
      nav.appendChild(el("a", { href: "#/" + v[0], "data-view": v[0], text: v[1] }));
    });
    app.appendChild(el("header", {}, el("h1", { text: "simpler-daemon" }), nav, el("span", { id: "status-line" })));
    app.appendChild(el("main", { id: "main" }));
    window.addEventListener("hashchange", refresh);
    document.addEventListener("visibilitychange", refresh);
    refresh();
  }
  start();
})();
