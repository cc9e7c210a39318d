// The gpumesh dashboard page: listens to /api/stream and draws what the mesh says.
// Everything that comes from the mesh (hostnames, job names, errors) goes in with textContent
// or as an SVG attribute value, never as markup.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
let csrf = "";
let history = [];
let snapshot = null;
let openJob = null;      // the job whose tasks are listed
let openTask = null;     // the task whose error is shown
let lastTraffic = {};    // worker id -> [time, up+down bytes], for the edge rates
const IDLE_TRAFFIC = 4096;  // B/s: more than heartbeats and load samples make on their own
let received = 0;        // Date.now() when the last snapshot came
const SILENCE_MS = 6000; // snapshots come about every second while the mesh answers

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(typeof child === "string" || typeof child === "number" ? String(child) : child);
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

function bytes(n) {
  if (n === null || n === undefined) return "?";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(n < 10 && i ? 1 : 0)} ${units[i]}`;
}

function seconds(s) {
  if (s === null || s === undefined) return "";
  if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  if (s < 7200) return `${(s / 60).toFixed(0)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function workerState(w) {
  if (w.state === "alive" && w.running > 0) return "busy";
  return w.state;
}

// A worker that went on purpose (drained, stopped, removed) departed; only "lost" is a failure.
function departed(w) {
  return w.state === "left" || w.state === "removed";
}

function stateText(w) {
  const state = workerState(w);
  return departed(w) && w.reason && w.reason !== w.state ? `${state} (${w.reason})` : state;
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString();
}

// Several workers of one machine share its hostname: the short worker id tells them apart.
function workerName(w, always) {
  const host = w.hostname || w.id.slice(0, 8);
  const twins = (snapshot && snapshot.workers || []).filter((o) => o.hostname === w.hostname).length;
  return always || twins > 1 ? `${host} (${w.id.slice(0, 6)})` : host;
}

function workerById(id) {
  return (snapshot && snapshot.workers || []).find((w) => w.id === id);
}

function notice(text) {
  const box = document.getElementById("notice");
  box.textContent = text || "";
  box.hidden = !text;
}

async function post(path, body) {
  const response = await fetch(path, {
    method: "POST", credentials: "same-origin",
    headers: {"Content-Type": "application/json", "X-CSRF-Token": csrf},
    body: JSON.stringify(body),
  });
  const answer = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(answer.error || `HTTP ${response.status}`);
  return answer;
}

// ------------------------------------------------------------------ the mesh picture

function drawMesh(workers, now) {
  const picture = document.getElementById("mesh");
  picture.replaceChildren();
  const cx = 450, cy = 190;
  const shown = workers.slice(0, 24);
  shown.forEach((w, i) => {
    // On an ellipse around the coordinator, the first on the left: two workers sit side by side.
    const angle = Math.PI + (2 * Math.PI * i) / Math.max(shown.length, 1);
    const x = cx + 330 * Math.cos(angle), y = cy + 130 * Math.sin(angle);
    const moved = (w.traffic ? w.traffic.up_bytes + w.traffic.down_bytes : 0);
    const before = lastTraffic[w.id];
    const rate = before && now > before[0] ? (moved - before[1]) / (now - before[0]) : 0;
    lastTraffic[w.id] = [now, moved];
    const width = 1 + Math.min(Math.log10(1 + Math.max(rate, 0)) , 6);
    picture.append(svg("line", {x1: cx, y1: cy, x2: x, y2: y, "stroke-width": width.toFixed(1)}));
    // Only work is labelled: an idle worker's heartbeats alone move a few hundred B/s.
    if (w.alive && (w.running > 0 || rate >= IDLE_TRAFFIC)) {
      picture.append(svg("text", {x: cx + (x - cx) * 0.35, y: cy + (y - cy) * 0.35 - 4, class: "edge-label"},
        `${bytes(rate)}/s`));
    }
    const state = workerState(w);
    const node = svg("g", {class: "node", "data-worker": w.id});
    node.append(svg("circle", {cx: x, cy: y, r: 26, class: `state-${state}`}));
    node.append(svg("text", {x: x, y: y + 4}, `${Math.min(w.running, w.slots)}/${w.slots}`));
    // Labels of the nodes at the far left and right grow inwards, not off the picture.
    const [lx, side] = x < 200 ? [x - 30, "start"] : x > 700 ? [x + 30, "end"] : [x, ""];
    node.append(svg("text", {x: lx, y: y + 42, class: side}, workerName(w)));
    node.append(svg("text", {x: lx, y: y + 56, class: `sub ${side}`},
      `${w.device_name || w.device} · score ${Number(w.score).toFixed(1)} · ${stateText(w)}`));
    picture.append(node);
  });
  picture.append(svg("circle", {cx: cx, cy: cy, r: 34, class: "coordinator"}));
  picture.append(svg("text", {x: cx, y: cy + 4}, "coordinator"));
  if (workers.length > shown.length) {
    picture.append(svg("text", {x: cx, y: 410, class: "sub"}, `and ${workers.length - shown.length} more`));
  }
}

// ------------------------------------------------------------------ workers

function meter(label, fraction, text) {
  const fill = el("div");
  fill.style.width = `${Math.round(Math.min(Math.max(fraction || 0, 0), 1) * 100)}%`;
  return el("div", {class: "bar"}, el("span", {}, label), el("div", {class: "meter"}, fill),
            el("span", {class: "muted"}, text));
}

function drawWorkers(workers) {
  const box = document.getElementById("workers");
  box.replaceChildren();
  const alive = workers.filter((w) => w.alive).length;
  const gone = workers.filter(departed).length, lost = workers.filter((w) => w.state === "lost").length;
  document.getElementById("worker-count").textContent = `${alive} alive` +
    (gone ? ` · ${gone} left` : "") + (lost ? ` · ${lost} lost` : "");
  for (const w of workers) {
    const state = workerState(w);
    const card = el("div", {class: "worker", "data-worker": w.id},
      el("span", {class: "name"}, workerName(w)), " ",
      el("span", {class: `badge ${state}`}, stateText(w)), " ",
      el("span", {class: "muted"}, `${w.device_name || w.device} · ${w.id.slice(0, 8)} · score ${Number(w.score).toFixed(1)} · ${Math.min(w.running, w.slots)}/${w.slots} slots busy` +
        (w.running > w.slots ? ` (+${w.running - w.slots} queued)` : "") + ` · ${w.completed} done`));
    const stats = w.stats;
    if (stats && !w.alive) {
      card.append(el("div", {class: "muted"}, "not connected: no live load figures"));
    } else if (stats) {
      if (stats.cpu !== null && stats.cpu !== undefined) card.append(meter("CPU", stats.cpu / 100, `${stats.cpu.toFixed(0)} %`));
      const [used, total] = stats.ram || [0, 0];
      if (total) card.append(meter("RAM", used / total, `${bytes(used)} / ${bytes(total)}`));
      (stats.gpus || []).forEach((g, i) => {
        if (g.util !== null && g.util !== undefined) card.append(meter(`GPU ${i} util`, g.util / 100, `${g.util.toFixed(0)} %`));
        if (g.total) card.append(meter(`GPU ${i} VRAM`, g.used / g.total, `${bytes(g.used)} / ${bytes(g.total)}`));
      });
    } else if (w.alive) {
      card.append(el("div", {class: "muted"}, "no load figures from this worker (older gpumesh)"));
    }
    if (w.alive) {
      const actions = el("div");
      if (w.state === "alive") actions.append(el("button", {type: "button", class: "drain", onclick: () => steer(w, "drain")}, "Drain"));
      if (w.state === "paused" || w.state === "draining") actions.append(el("button", {type: "button", class: "resume", onclick: () => steer(w, "resume")}, "Resume"));
      card.append(actions);
    }
    box.append(card);
  }
}

async function steer(w, action) {
  const name = workerName(w, true);
  if (action === "drain" && !confirm(`Drain ${name}? Running tasks finish, then it leaves the mesh.`)) return;
  notice(`asking ${name} to ${action}…`);
  try {
    // The answer comes once the worker's new state shows, or says that it kept its own.
    const answer = await post("/api/worker", {worker: w.id, action});
    if (answer.held) {
      notice(`${name} is still ${answer.state}: its owner set that on its machine, and the mesh ` +
             `does not undo an owner's choice (they can run 'gpumesh ${action}' there).`);
    } else {
      notice(`${name}: ${action} done, now ${answer.state || "gone"}`);
    }
  } catch (error) { notice(`${action} ${name}: ${error.message}`); }
}

// ------------------------------------------------------------------ jobs

function progress(counts, total) {
  const bar = el("div", {class: "progress", "data-total": total});
  let finished = 0;
  for (const state of ["done", "failed", "cancelled", "running"]) {
    const n = counts[state] || 0;
    if (state !== "running") finished += n;
    if (!n || !total) continue;
    const part = el("div", {class: state});
    part.style.width = `${(100 * n) / total}%`;
    bar.append(part);
  }
  bar.setAttribute("data-finished", finished);
  bar.title = `${finished} of ${total} finished`;
  return bar;
}

function countsText(counts) {
  return Object.entries(counts || {}).map(([k, v]) => `${v} ${k}`).join(", ");
}

function drawJobs(jobs, queue) {
  const body = document.querySelector("#jobs tbody");
  body.replaceChildren();
  document.getElementById("queue").textContent = countsText(queue) || "queue empty";
  for (const job of jobs) {
    const cancel = job.status === "finished" ? "" :
      el("button", {type: "button", class: "cancel", onclick: (event) => { event.stopPropagation(); cancelJob(job); }}, "Cancel");
    const row = el("tr", {"data-job": job.job, onclick: () => showJob(job.job)},
      el("td", {}, job.name, el("div", {class: "muted"}, job.job)),
      el("td", {}, job.owner || ""),
      el("td", {}, job.outcome || job.status),
      el("td", {}, progress(job.counts || {}, job.total || 0)),
      el("td", {}, countsText(job.counts)),
      el("td", {}, seconds(job.elapsed)),
      el("td", {}, cancel));
    body.append(row);
  }
}

async function cancelJob(job, force) {
  try {
    const answer = await post("/api/cancel", {job: job.job, force: !!force});
    notice(`cancelled ${answer.cancelled} task(s) of ${job.name}`);
  } catch (error) {
    // The coordinator words it for the command line ("pass --force"); the page asks instead.
    const other = /submitted by (\S+), not by (\S+?):/.exec(error.message);
    if (!force && other) {
      if (confirm(`Job "${job.name}" was submitted by ${other[1]}, not by you (${other[2]}).\n\n` +
                  `Cancel its unfinished tasks anyway?`)) return cancelJob(job, true);
      notice(`job ${job.name} left running`);
      return;
    }
    notice(`cancel ${job.name}: ${error.message}`);
  }
}

async function showJob(jobId) {
  openJob = jobId;
  document.getElementById("job-detail").hidden = false;
  await refreshJob();
}

async function refreshJob() {
  if (!openJob) return;
  const response = await fetch(`/api/job?id=${encodeURIComponent(openJob)}`, {credentials: "same-origin"});
  const view = await response.json().catch(() => ({error: "unreadable answer"}));
  if (!response.ok || view.error) { notice(view.error || `HTTP ${response.status}`); return; }
  document.getElementById("job-title").textContent = `${view.name} (${view.job})`;
  document.getElementById("job-summary").textContent =
    `${view.outcome || view.status} · ${countsText(view.counts)} · ${view.total} task(s) · ${seconds(view.elapsed)}` +
    (view.tasks_not_shown ? ` · ${view.tasks_not_shown} not listed` : "");
  const body = document.querySelector("#tasks tbody");
  body.replaceChildren();
  for (const task of view.tasks || []) {
    const row = el("tr", {"data-task": task.id, class: `task-${task.state}`, onclick: () => showTask(task)},
      el("td", {}, task.index), el("td", {}, task.id), el("td", {}, task.state),
      el("td", {}, (task.worker || "").slice(0, 12)), el("td", {}, task.attempts),
      el("td", {}, seconds(task.elapsed)),
      el("td", {class: "error-text"}, errorText(task)));
    body.append(row);
    if (openTask && openTask.id === task.id) showTask(task);
  }
}

function errorText(task) {
  if (!task.error) return "";
  return task.error_type ? `${task.error_type}: ${task.error}` : task.error;
}

// cloudpickle names the code of functions shipped by value "<dynamic-code>". The submitting
// client maps those frames back to its script (client/remotetb.py) from its own __main__;
// the dashboard has neither that process's code objects nor its source file, and must never
// unpickle a task's function to get them. It says what the frames are instead.
const DYNAMIC_NOTE = 'Frames in "<dynamic-code>" are functions of the submitting script, sent by ' +
  "value: their line numbers are that script's own lines (the submitting Python shows them " +
  "with the file name and source).";

async function showTask(task) {
  const first = !openTask || openTask.id !== task.id;
  openTask = task;
  document.getElementById("task-detail").hidden = false;
  document.getElementById("task-title").textContent =
    `task ${task.id} · ${task.state} · worker ${task.worker || "-"} · ${task.attempts} attempt(s) · ${seconds(task.elapsed)}`;
  const box = document.getElementById("task-error");
  if (!first) return;
  // The job's list keeps the end of a traceback; the coordinator holds the whole of it until
  // the result is collected.
  box.textContent = [errorText(task), task.detail].filter(Boolean).join("\n\n") || "no error";
  if (task.state !== "failed") return;
  const response = await fetch(`/api/task?id=${encodeURIComponent(task.id)}`, {credentials: "same-origin"});
  const full = await response.json().catch(() => ({}));
  if (!response.ok || !full.id || openTask.id !== task.id) return;
  const error = full.error || {};
  const failures = (full.failures || []).length ? `earlier attempts: ${full.failures.join("; ")}` : "";
  const kind = error.type && error.type.replace(/^builtins\./, "");
  const trace = error.traceback || "";
  box.textContent = [kind && `${kind}: ${error.message || ""}`, trace, full.diagnosis, failures,
    trace.includes("<dynamic-code>") ? DYNAMIC_NOTE : ""]
    .filter(Boolean).join("\n\n") || box.textContent;
}

// ------------------------------------------------------------------ charts and lists

// A step of 1, 2 or 5 times a power of ten at or above x: axis tops read as round numbers.
function niceTop(x) {
  const power = Math.pow(10, Math.floor(Math.log10(x)));
  return [1, 2, 5, 10].map((m) => m * power).find((v) => v >= x);
}

// One chart: `floor` is the smallest top of the scale (an idle mesh draws a flat line at 0, not
// a scale of 1e-9), `label(top)` writes the top with its unit. The time axis runs from the
// oldest point kept (at least 1 min, at most 10) to now.
function chart(id, series, colors, floor, label) {
  const canvas = document.getElementById(id);
  const ratio = window.devicePixelRatio || 1;
  const cssWidth = canvas.clientWidth || 560, cssHeight = canvas.clientHeight || 120;
  if (canvas.width !== Math.round(cssWidth * ratio)) {  // sharp text at any width
    canvas.width = Math.round(cssWidth * ratio);
    canvas.height = Math.round(cssHeight * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  const w = cssWidth, h = cssHeight, left = 4, bottom = 16, plot = h - bottom - 4;
  ctx.clearRect(0, 0, w, h);
  const now = Date.now() / 1000;
  const first = Math.min(...series.flat().map((p) => p[0]), now);
  const span = Math.min(Math.max(now - first, 60), 600);
  const values = series.flat().filter((p) => p[1] !== null).map((p) => p[1]);
  const top = niceTop(Math.max(...values, floor));
  ctx.strokeStyle = "#2a3540";
  ctx.lineWidth = 1;
  ctx.beginPath();
  ctx.moveTo(left, h - bottom + 0.5); ctx.lineTo(w, h - bottom + 0.5);
  ctx.moveTo(left, h - bottom - plot / 2 + 0.5); ctx.lineTo(w, h - bottom - plot / 2 + 0.5);
  ctx.stroke();
  ctx.fillStyle = "#8a96a3";
  ctx.font = "10px sans-serif";
  ctx.textAlign = "left";
  ctx.fillText(label(top), left, 11);
  ctx.fillText(label(top / 2), left, h - bottom - plot / 2 - 3);
  ctx.fillText("0", left, h - bottom - 3);
  const minutes = span / 60;
  ctx.fillText(`−${minutes.toFixed(minutes < 2 ? 1 : 0)} min`, left, h - 3);
  ctx.textAlign = "center";
  ctx.fillText(`−${(minutes / 2).toFixed(minutes < 4 ? 1 : 0)} min`, w / 2, h - 3);
  ctx.textAlign = "right";
  ctx.fillText("now", w - 2, h - 3);
  series.forEach((points, i) => {
    ctx.strokeStyle = colors[i];
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let started = false;
    for (const [t, v] of points) {
      if (v === null) { started = false; continue; }
      const x = left + (w - left) * (1 - (now - t) / span), y = h - bottom - (v / top) * plot;
      if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
    }
    ctx.stroke();
  });
}

function rate(v) {
  return `${v < 10 ? Number(v.toPrecision(2)) : Math.round(v)} tasks/s`;
}

function millis(v) {
  return v < 1 ? `${Number((v * 1000).toPrecision(3))} ms` : `${Number(v.toPrecision(3))} s`;
}

function drawCharts() {
  const cutoff = Date.now() / 1000 - 600;
  history = history.filter((p) => p.t >= cutoff);
  chart("throughput", [history.map((p) => [p.t, p.throughput])], ["#3fb950"], 1, rate);
  chart("latency", [history.map((p) => [p.t, p.p50]), history.map((p) => [p.t, p.p95])],
        ["#58a6ff", "#d29922"], 0.01, millis);
  const last = history[history.length - 1];
  document.getElementById("tp-now").textContent = last ? `now ${rate(last.throughput)}` : "";
  document.getElementById("lat-now").textContent = last && last.p50 !== null ? `now ${millis(last.p50)} / ${millis(last.p95)}` : "";
}

function workerLabel(d) {
  const ref = d.worker && typeof d.worker === "object" ? d.worker : {id: d.worker};
  if (!ref.id) return "";
  const known = workerById(ref.id);
  return known ? workerName(known, true) : `${ref.hostname || "worker"} (${String(ref.id).slice(0, 6)})`;
}

// One line of the Events card, in words; `repeat` is a burst the server folded into one.
function eventText(kind, d) {
  const who = workerLabel(d);
  const by = d.by ? `by ${d.by}` : "";
  switch (kind) {
    case "task_finished":
      return d.repeat > 1 ? `${d.repeat} tasks ${d.state} in job ${d.job}`
        : `task ${d.task} ${d.state} in job ${d.job}` + (d.error ? ` · ${d.error}` : "");
    case "worker_lost":
      return d.departed ? `worker left · ${who} · ${d.reason || d.departed}` : `worker lost · ${who} · ${d.reason || ""}`;
    case "worker_joined": return `worker joined · ${who}`;
    case "worker_mode": return `worker ${who} is now ${d.mode}`;
    case "worker_control": return `${d.action} asked of ${who} ${by}`;
    case "job_cancelled": return `job ${d.job} cancelled ${by} · ${d.count} task(s)`;
    case "submitted": return `job ${d.job} submitted · ${d.count} task(s)`;
    case "retried": return `job ${d.job} retried · ${d.count} task(s)`;
    default:
      return [kind, d.job, d.state, who, d.action, by, d.reason, d.count && `${d.count} task(s)`]
        .filter(Boolean).join(" · ");
  }
}

function drawLists(data) {
  const failures = document.getElementById("failures");
  failures.replaceChildren();
  for (const f of [...(data.failures || [])].reverse()) {
    const where = workerById(f.worker);
    failures.append(el("li", {class: "clickable", "data-task": f.task, onclick: () => showJob(f.job)},
      `${clock(f.time)} task ${f.task} of job ${f.job} on ${where ? workerName(where, true) : (f.worker || "-").slice(0, 8)}`,
      f.error ? el("div", {class: "error-text"}, f.error) : null));
  }
  if (!failures.children.length) failures.append(el("li", {class: "muted"}, "none"));
  const events = document.getElementById("events");
  events.replaceChildren();
  // The server keeps successful tasks out of the list; an older one may still send them.
  const notable = (data.events || []).filter(([, , kind, d]) => kind !== "task_finished" || (d && d.state !== "done"));
  for (const [seq, time, kind, detail] of notable.reverse().slice(0, 60)) {
    const d = detail || {};
    const quiet = (kind === "worker_lost" && d.departed) || kind === "worker_mode" || kind === "submitted";
    events.append(el("li", {"data-seq": seq, "data-kind": kind, class: quiet ? "muted" : ""},
      `${clock(time)} ${eventText(kind, d)}`));
  }
  if (!events.children.length) events.append(el("li", {class: "muted"}, "none yet"));
}

function drawHealth(h, workers) {
  const box = document.getElementById("health");
  if (!h) { box.textContent = "coordinator health: not reported (older coordinator)"; return; }
  // Counted from the workers themselves: a drained worker has left, it is not lost.
  const states = {};
  for (const w of workers) { const s = departed(w) ? "left" : w.state; states[s] = (states[s] || 0) + 1; }
  const words = Object.entries(states).map(([k, v]) => `${v} ${k}`).join(", ");
  box.textContent = `coordinator ${h.version} · up ${seconds(h.uptime)} · queue ${countsText(h.queue) || "empty"} · ` +
    `journal ${bytes(h.journal_bytes)} · ${h.clients} client(s) · workers ${words || "none"}`;
}

// The badge says whether what the page shows is live; when it is not, the figures are greyed.
function drawConnection(data) {
  const conn = document.getElementById("conn");
  if (data.connected === false) {
    const why = data.down_kind === "unreachable" && data.down_since
      ? `coordinator not answering since ${clock(data.down_since)}`
      : data.down_kind === "token" ? "the token does not match this mesh" : data.error || "connecting…";
    conn.textContent = data.down_kind === "connecting" ? "connecting…" : `not connected: ${why}`;
    conn.className = "conn down";
    conn.title = data.error || "";
    document.body.classList.add("stale");
    return false;
  }
  conn.textContent = "live"; conn.className = "conn live"; conn.title = "";
  document.body.classList.remove("stale");
  return true;
}

function render(data) {
  snapshot = data;
  received = Date.now();
  if (data.point && (!history.length || history[history.length - 1].t < data.point.t)) history.push(data.point);
  const now = data.time || Date.now() / 1000;
  if (!drawConnection(data) && data.time === undefined) return;  // nothing yet to grey
  drawHealth(data.health, data.workers || []);
  drawMesh(data.workers || [], now);
  drawWorkers(data.workers || []);
  drawJobs(data.jobs || [], data.counts || {});
  drawLists(data);
  drawCharts();
  if (openJob && data.connected !== false) refreshJob();
}

// ------------------------------------------------------------------ start

async function start() {
  const response = await fetch("/api/session", {credentials: "same-origin"});
  if (response.status === 401) { location.href = "/login"; return; }
  const session = await response.json();
  csrf = session.csrf;
  const logout = document.getElementById("logout");
  logout.hidden = false;  // a session is a credential on loopback too (the link's key opens one)
  logout.addEventListener("click", async () => { await post("/logout", {}).catch(() => null); location.href = "/login"; });
  document.getElementById("job-close").addEventListener("click", () => {
    openJob = null; openTask = null;
    document.getElementById("job-detail").hidden = true;
    document.getElementById("task-detail").hidden = true;
  });
  const conn = document.getElementById("conn");
  const stream = new EventSource("/api/stream");
  stream.addEventListener("history", (event) => { history = JSON.parse(event.data); drawCharts(); });
  stream.addEventListener("snapshot", (event) => render(JSON.parse(event.data)));
  // A coordinator that stops answering holds the dashboard's query until its timeout: no new
  // snapshot comes meanwhile, so the page says so itself rather than show old figures as live.
  setInterval(() => {
    if (snapshot && snapshot.connected !== false && snapshot.time && Date.now() - received > SILENCE_MS) {
      drawConnection({connected: false, down_kind: "unreachable", down_since: snapshot.time});
    }
  }, 1000);
  stream.addEventListener("error", () => {
    conn.textContent = "reconnecting…"; conn.className = "conn down";
    // Refused (the dashboard restarted, the session expired): EventSource gives up, so load
    // the page again, which logs in again where that is needed.
    if (stream.readyState === EventSource.CLOSED) setTimeout(() => location.reload(), 3000);
  });
}

start();
