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
    picture.append(svg("text", {x: cx + (x - cx) * 0.35, y: cy + (y - cy) * 0.35 - 4, class: "edge-label"},
      `${bytes(Math.max(rate, 0))}/s`));
    const state = workerState(w);
    const node = svg("g", {class: "node", "data-worker": w.id});
    node.append(svg("circle", {cx: x, cy: y, r: 26, class: `state-${state}`}));
    node.append(svg("text", {x: x, y: y + 4}, `${Math.min(w.running, w.slots)}/${w.slots}`));
    node.append(svg("text", {x: x, y: y + 42}, w.hostname || w.id.slice(0, 8)));
    node.append(svg("text", {x: x, y: y + 56, class: "sub"},
      `${w.device_name || w.device} · score ${Number(w.score).toFixed(1)} · ${state}`));
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
  document.getElementById("worker-count").textContent = `${alive} alive of ${workers.length}`;
  for (const w of workers) {
    const state = workerState(w);
    const card = el("div", {class: "worker", "data-worker": w.id},
      el("span", {class: "name"}, w.hostname || w.id.slice(0, 8)), " ",
      el("span", {class: `badge ${state}`}, state), " ",
      el("span", {class: "muted"}, `${w.device_name || w.device} · ${w.id.slice(0, 8)} · score ${Number(w.score).toFixed(1)} · ${Math.min(w.running, w.slots)}/${w.slots} slots busy` +
        (w.running > w.slots ? ` (+${w.running - w.slots} queued)` : "") + ` · ${w.completed} done`));
    const stats = w.stats;
    if (stats) {
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
  const name = w.hostname || w.id.slice(0, 8);
  if (action === "drain" && !confirm(`Drain ${name}? Running tasks finish, then it leaves the mesh.`)) return;
  try {
    await post("/api/worker", {worker: w.id, action});
    notice(`${action} sent to ${name}`);
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
    if (!force && /--force/.test(error.message) && confirm(`${error.message}\n\nCancel it anyway?`)) return cancelJob(job, true);
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
      el("td", {class: "error-text"}, task.error || ""));
    body.append(row);
    if (openTask && openTask.id === task.id) showTask(task);
  }
}

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
  box.textContent = [task.error, task.detail].filter(Boolean).join("\n\n") || "no error";
  if (task.state !== "failed") return;
  const response = await fetch(`/api/task?id=${encodeURIComponent(task.id)}`, {credentials: "same-origin"});
  const full = await response.json().catch(() => ({}));
  if (!response.ok || !full.id || openTask.id !== task.id) return;
  const error = full.error || {};
  const failures = (full.failures || []).length ? `earlier attempts: ${full.failures.join("; ")}` : "";
  box.textContent = [error.type && `${error.type}: ${error.message || ""}`, error.traceback, full.diagnosis, failures]
    .filter(Boolean).join("\n\n") || box.textContent;
}

// ------------------------------------------------------------------ charts and lists

function chart(id, series, colors) {
  const canvas = document.getElementById(id);
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const now = Date.now() / 1000;
  const first = Math.min(...series.flat().map((p) => p[0]), now);
  const span = Math.min(Math.max(now - first, 60), 600);  // the history there is, 1 to 10 min
  const values = series.flat().filter((p) => p[1] !== null);
  const top = Math.max(...values.map((p) => p[1]), 1e-9) * 1.15;
  ctx.fillStyle = "#8a96a3";
  ctx.font = "10px sans-serif";
  ctx.fillText(top.toPrecision(3), 4, 12);
  series.forEach((points, i) => {
    ctx.strokeStyle = colors[i];
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let started = false;
    for (const [t, v] of points) {
      if (v === null) { started = false; continue; }
      const x = w - ((now - t) / span) * w, y = h - (v / top) * (h - 4);
      if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
    }
    ctx.stroke();
  });
}

function drawCharts() {
  const cutoff = Date.now() / 1000 - 600;
  history = history.filter((p) => p.t >= cutoff);
  chart("throughput", [history.map((p) => [p.t, p.throughput])], ["#3fb950"]);
  chart("latency", [history.map((p) => [p.t, p.p50]), history.map((p) => [p.t, p.p95])], ["#58a6ff", "#d29922"]);
  const last = history[history.length - 1];
  document.getElementById("tp-now").textContent = last ? `now ${last.throughput.toFixed(1)}/s` : "";
  document.getElementById("lat-now").textContent = last && last.p50 !== null ? `now ${seconds(last.p50)} / ${seconds(last.p95)}` : "";
}

function drawLists(data) {
  const failures = document.getElementById("failures");
  failures.replaceChildren();
  for (const f of [...(data.failures || [])].reverse()) {
    failures.append(el("li", {class: "clickable", "data-task": f.task, onclick: () => showJob(f.job)},
      `${new Date(f.time * 1000).toLocaleTimeString()} task ${f.task} of job ${f.job} on ${(f.worker || "-").slice(0, 8)}`));
  }
  if (!failures.children.length) failures.append(el("li", {class: "muted"}, "none"));
  const events = document.getElementById("events");
  events.replaceChildren();
  // Successful tasks are in the throughput chart: listing each would bury everything else.
  const notable = (data.events || []).filter(([, , kind, d]) => kind !== "task_finished" || (d && d.state !== "done"));
  for (const [seq, time, kind, detail] of notable.reverse().slice(0, 60)) {
    const d = detail || {};
    const who = d.worker && typeof d.worker === "object" ? d.worker.hostname || d.worker.id : d.worker;
    const text = [kind, d.job, d.state, who, d.action, d.by && `by ${d.by}`, d.reason, d.count && `${d.count} task(s)`]
      .filter(Boolean).join(" · ");
    events.append(el("li", {"data-seq": seq}, `${new Date(time * 1000).toLocaleTimeString()} ${text}`));
  }
}

function drawHealth(h, error) {
  const box = document.getElementById("health");
  if (error) { box.textContent = error; return; }
  if (!h) { box.textContent = "coordinator health: not reported (older coordinator)"; return; }
  const workers = Object.entries(h.workers || {}).map(([k, v]) => `${v} ${k}`).join(", ");
  box.textContent = `coordinator ${h.version} · up ${seconds(h.uptime)} · queue ${countsText(h.queue) || "empty"} · ` +
    `journal ${bytes(h.journal_bytes)} · ${h.clients} client(s) · workers ${workers || "none"}`;
}

function render(data) {
  snapshot = data;
  if (data.point && (!history.length || history[history.length - 1].t < data.point.t)) history.push(data.point);
  const now = data.time || Date.now() / 1000;
  drawHealth(data.health, data.error);
  drawMesh(data.workers || [], now);
  drawWorkers(data.workers || []);
  drawJobs(data.jobs || [], data.counts || {});
  drawLists(data);
  drawCharts();
  if (openJob) refreshJob();
}

// ------------------------------------------------------------------ start

async function start() {
  const response = await fetch("/api/session", {credentials: "same-origin"});
  if (response.status === 401) { location.href = "/login"; return; }
  const session = await response.json();
  csrf = session.csrf;
  const logout = document.getElementById("logout");
  logout.hidden = !session.login_required;
  logout.addEventListener("click", async () => { await post("/logout", {}).catch(() => null); location.href = "/login"; });
  document.getElementById("job-close").addEventListener("click", () => {
    openJob = null; openTask = null;
    document.getElementById("job-detail").hidden = true;
    document.getElementById("task-detail").hidden = true;
  });
  const conn = document.getElementById("conn");
  const stream = new EventSource("/api/stream");
  stream.addEventListener("history", (event) => { history = JSON.parse(event.data); drawCharts(); });
  stream.addEventListener("snapshot", (event) => {
    conn.textContent = "live"; conn.className = "conn live";
    render(JSON.parse(event.data));
  });
  stream.addEventListener("error", () => {
    conn.textContent = "reconnecting…"; conn.className = "conn down";
    // Refused (the dashboard restarted, the session expired): EventSource gives up, so load
    // the page again, which logs in again where that is needed.
    if (stream.readyState === EventSource.CLOSED) setTimeout(() => location.reload(), 3000);
  });
}

start();
