// The console's own script: live training curves, the usage chart, copy buttons and the
// playground. Charts are drawn with the vendored uPlot; no inline script (the pages' CSP).
"use strict";

const csrfToken = () => document.querySelector('meta[name="csrf-token"]')?.content || "";
const COLORS = ["#1f5fbf", "#b3380c", "#1b7a3a", "#7a3ea1", "#8a6d00", "#0b7c86"];

function chartWidth(el) {
  return Math.max(280, Math.min(el.clientWidth || 600, 900));
}

function lineChart(el, title, label, xs, ys, color, timeAxis) {
  const opts = {
    title,
    width: chartWidth(el),
    height: 220,
    scales: { x: { time: !!timeAxis } },
    axes: [{ label: timeAxis ? "hour (local time)" : "step" }, { label }],
    series: [{ label: timeAxis ? "hour" : "step" }, { label, stroke: color, width: 2, points: { show: true, size: 5 } }],
  };
  return new uPlot(opts, [xs, ys], el);
}

// ---- training curves ----------------------------------------------------------------------

function startCurves(root) {
  const url = root.dataset.pointsUrl;
  const status = document.getElementById("curve-status");
  const stepsEl = document.getElementById("run-steps");
  let after = 0;
  const points = [];
  const charts = new Map();  // series name -> {chart, box}

  function seriesOf() {
    const out = new Map();
    const push = (name, label, value) => {
      if (!out.has(name)) out.set(name, { label, xs: [], ys: [] });
      const s = out.get(name);
      s.xs.push(p.step);
      s.ys.push(value === undefined || value === null ? null : value);
    };
    let p;
    const names = new Set();
    for (p of points) for (const k of Object.keys(p.metrics)) names.add(k);
    const others = [...names].filter((n) => n !== "loss:sum").sort();
    for (p of points) {
      if (names.has("loss:sum")) {
        push("loss:sum", "loss:sum", p.metrics["loss:sum"]);
        push("loss-per-token", "loss:sum / trained tokens",
          p.trained_tokens ? p.metrics["loss:sum"] / p.trained_tokens : null);
      }
      for (const name of others) push(name, name, p.metrics[name]);
      push("trained_tokens", "trained tokens per step", p.trained_tokens);
      push("step_s", "step time (s)", p.step_s);
    }
    return out;
  }

  function draw() {
    let i = 0;
    for (const [name, s] of seriesOf()) {
      let entry = charts.get(name);
      if (!entry) {
        const box = document.createElement("figure");
        box.className = "chart";
        box.dataset.series = name;
        box.setAttribute("role", "img");
        root.appendChild(box);
        entry = { box, chart: lineChart(box, s.label, s.label, s.xs, s.ys, COLORS[i % COLORS.length]) };
        charts.set(name, entry);
      } else {
        entry.chart.setData([s.xs, s.ys]);
      }
      const last = s.ys[s.ys.length - 1];
      entry.box.dataset.points = String(s.xs.length);
      entry.box.setAttribute("aria-label",
        `${s.label}: ${s.xs.length} steps, last ${last === null ? "none" : Number(last).toPrecision(4)}`);
      i += 1;
    }
  }

  async function poll() {
    try {
      const response = await fetch(`${url}?after=${after}`, { credentials: "same-origin" });
      if (!response.ok) throw new Error(`${response.status}`);
      const body = await response.json();
      after = body.next_after;
      if (stepsEl) stepsEl.textContent = String(body.training_step);
      if (body.points.length) {
        points.push(...body.points);
        draw();
      }
      const last = points[points.length - 1];
      status.textContent = points.length
        ? `${points.length} steps recorded; last step ${last.step}` +
          (last.metrics["loss:sum"] !== undefined ? `, loss:sum ${last.metrics["loss:sum"].toPrecision(4)}` : "")
        : "No optimizer step recorded yet; the curves appear as the run trains.";
      root.dataset.points = String(points.length);
    } catch (err) {
      status.textContent = `Could not load the curves (${err.message}); retrying.`;
    }
    setTimeout(poll, 2000);
  }
  poll();
}

// ---- usage ----------------------------------------------------------------------------------

async function startUsage(el) {
  const response = await fetch(el.dataset.usageUrl, { credentials: "same-origin" });
  if (!response.ok) return;
  const report = await response.json();
  // Every hour of the period, zero where nothing ran: gaps read as idle hours, not as lines.
  const HOUR = 3600;
  const now = Math.floor(Date.now() / 1000 / HOUR) * HOUR;
  const since = report.since ? Math.floor(Date.parse(report.since) / 1000 / HOUR) * HOUR : now;
  const byHour = new Map(report.buckets.map((b) => [Date.parse(b.start) / 1000, b]));
  const xs = [];
  for (let t = since; t <= now; t += HOUR) xs.push(t);
  const classes = [["prefill_tokens", "prefill"], ["sampled_tokens", "sampled"], ["trained_tokens", "trained"]];
  const perClass = classes.map(([k]) => xs.map((t) => byHour.get(t)?.totals[k] ?? 0));
  const tokens = (c) => c.prefill_tokens + c.sampled_tokens + c.trained_tokens;
  const operations = Object.keys(report.by_operation).filter((op) => tokens(report.by_operation[op]) > 0).sort();
  const perOp = operations.map((op) => xs.map((t) => {
    const c = byHour.get(t)?.by_operation[op];
    return c ? tokens(c) : 0;
  }));
  // A step holds its hour's value until the next x: one x past the last hour closes it.
  xs.push(now + HOUR);
  for (const ys of [...perClass, ...perOp]) ys.push(ys[ys.length - 1]);
  const chart = (box, title, labels, series) => new uPlot({
    title,
    width: chartWidth(box),
    height: 240,
    axes: [{ label: "hour (local time)" }, { label: "tokens" }],
    series: [{}, ...labels.map((label, i) => ({
      label, stroke: COLORS[i % COLORS.length], width: 2, paths: uPlot.paths.stepped({ align: 1 }),
    }))],
  }, [xs, ...series], box);
  const byClass = document.createElement("figure");
  byClass.className = "chart";
  el.appendChild(byClass);
  chart(byClass, "Tokens per hour, by class", classes.map(([, l]) => l), perClass);
  if (operations.length) {
    const byOp = document.createElement("figure");
    byOp.className = "chart";
    el.appendChild(byOp);
    chart(byOp, "Tokens per hour, by operation", operations, perOp);
  }
}

// ---- playground -----------------------------------------------------------------------------

function startPlayground(form) {
  const log = document.getElementById("chat-log");
  const messages = [];
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const text = form.elements.message.value.trim();
    if (!text) return;
    messages.push({ role: "user", content: text });
    const turn = document.createElement("div");
    turn.className = "turn";
    const asked = document.createElement("p");
    asked.className = "user";
    asked.textContent = text;
    turn.appendChild(asked);
    log.appendChild(turn);
    form.elements.message.value = "";
    const button = form.querySelector("button[type=submit]");
    button.disabled = true;
    try {
      const response = await fetch("/console/data/chat", {
        method: "POST",
        credentials: "same-origin",
        headers: { "content-type": "application/json", "x-csrf-token": csrfToken() },
        body: JSON.stringify({
          model: form.elements.model.value,
          messages,
          max_tokens: Number(form.elements.max_tokens.value),
          temperature: Number(form.elements.temperature.value),
          logprobs: true,
          top_logprobs: 5,
        }),
      });
      const body = await response.json();
      if (!response.ok) throw new Error(body.error?.message || body.detail || response.status);
      const choice = body.choices[0];
      messages.push({ role: "assistant", content: choice.message.content });
      turn.appendChild(answer(choice));
    } catch (err) {
      messages.pop();
      const p = document.createElement("p");
      p.className = "error";
      p.setAttribute("role", "alert");
      p.textContent = `Error: ${err.message}`;
      turn.appendChild(p);
    } finally {
      button.disabled = false;
    }
  });
}

function answer(choice) {
  const box = document.createElement("div");
  box.className = "assistant";
  const tokens = choice.logprobs?.content || [];
  const line = document.createElement("p");
  line.className = "tokens";
  for (const t of tokens) {
    const span = document.createElement("span");
    span.className = "tok";
    span.tabIndex = 0;
    span.textContent = t.token;
    // Shade by probability: darker is less likely.
    const prob = Math.exp(t.logprob);
    span.style.backgroundColor = `rgba(179, 56, 12, ${(0.45 * (1 - prob)).toFixed(2)})`;
    const alts = (t.top_logprobs || []).map((a) => `${JSON.stringify(a.token)} ${a.logprob.toFixed(2)}`);
    span.title = `logprob ${t.logprob.toFixed(3)}` + (alts.length ? `\ntop: ${alts.join(", ")}` : "");
    line.appendChild(span);
  }
  if (!tokens.length) line.textContent = choice.message.content;
  box.appendChild(line);
  const details = document.createElement("details");
  const summary = document.createElement("summary");
  summary.textContent = `Token log-probabilities (${tokens.length} tokens, finish: ${choice.finish_reason})`;
  details.appendChild(summary);
  const table = document.createElement("table");
  table.innerHTML = "<thead><tr><th scope='col'>Token</th><th scope='col'>Logprob</th><th scope='col'>Top alternatives</th></tr></thead>";
  const tbody = document.createElement("tbody");
  for (const t of tokens) {
    const row = tbody.insertRow();
    row.insertCell().textContent = JSON.stringify(t.token);
    row.insertCell().textContent = t.logprob.toFixed(4);
    row.insertCell().textContent = (t.top_logprobs || []).map((a) => `${JSON.stringify(a.token)} (${a.logprob.toFixed(2)})`).join(", ");
  }
  table.appendChild(tbody);
  details.appendChild(table);
  box.appendChild(details);
  return box;
}

// ---- copy buttons ---------------------------------------------------------------------------

document.addEventListener("click", async (event) => {
  const button = event.target.closest("button.copy");
  if (!button) return;
  try {
    await navigator.clipboard.writeText(button.dataset.copy);
    button.textContent = "Copied";
  } catch {
    button.textContent = "Select the path to copy";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 2000);
});

document.addEventListener("DOMContentLoaded", () => {
  const curves = document.getElementById("curves");
  if (curves) startCurves(curves);
  const usage = document.getElementById("usage-chart");
  if (usage) startUsage(usage);
  const chat = document.getElementById("chat-form");
  if (chat) startPlayground(chat);
});
