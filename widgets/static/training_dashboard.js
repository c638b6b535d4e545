// TrainingDashboard: a loss chart and one `.cl-dash-rank` row per rank (data-rank, data-stale, data-straggler).
// Reads loss, ranks, steps, stale_after, finished, clock and speed (tokens/s, MFU); ages tick here between updates.

function lossChart(points) {
  const ns = "http://www.w3.org/2000/svg", W = 320, H = 80;
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", W);
  svg.setAttribute("height", H);
  svg.setAttribute("class", "cl-dash-loss");
  if (points.length) {
    const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1), y0 = Math.min(...ys), y1 = Math.max(...ys, y0 + 1e-9);
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", points.map(([x, y]) =>
      `${4 + ((x - x0) / (x1 - x0)) * (W - 8)},${4 + (1 - (y - y0) / (y1 - y0)) * (H - 8)}`).join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", "#2f6fd0");
    svg.appendChild(line);
  }
  return svg;
}

function strip(times, slowest) {
  const s = h("div", "cl-dash-strip");
  for (const t of times.slice(-60)) {
    const c = h("div", "cl-dash-cell");
    const v = slowest > 0 ? t / slowest : 0;
    c.style.background = `rgb(${Math.round(255 - 200 * v)}, ${Math.round(255 - 160 * v)}, ${Math.round(255 - 60 * v)})`;
    c.title = `${(1e3 * t).toFixed(1)} ms`;
    s.appendChild(c);
  }
  return s;
}

function split(row) {
  const s = h("div", "cl-dash-split");
  const total = row.compute_s + row.collective_s;
  const c = h("div", "cl-dash-compute"), w = h("div", "cl-dash-wait");
  c.style.width = total > 0 ? `${(100 * row.compute_s) / total}%` : "0";
  w.style.width = total > 0 ? `${(100 * row.collective_s) / total}%` : "0";
  s.title = `compute ${(1e3 * row.compute_s).toFixed(1)} ms, waiting ${(1e3 * row.collective_s).toFixed(1)} ms`;
  s.append(c, w);
  return s;
}

function speedText(speed) {  // the run's tokens/s and MFU (docs/design.md#overlap-model-flops-and-mfu)
  if (!speed || speed.tokens_per_s === null || speed.tokens_per_s === undefined) return "";
  const mfu = speed.mfu === null || speed.mfu === undefined ? "" : ` · MFU ${(100 * speed.mfu).toFixed(1)}%`;
  return ` · ${Math.round(speed.tokens_per_s).toLocaleString("en-US")} tokens/s${mfu}`;
}

function render({ model, el }) {
  const root = h("div", "cl-dash");
  el.appendChild(root);
  let receivedAt = Date.now() / 1000;
  const ages = [];
  function tick() {  // a rank's age grows between updates; past stale_after its row turns red
    const finished = model.get("finished"), limit = model.get("stale_after");
    const drift = Date.now() / 1000 - receivedAt;
    for (const { tr, cell, row } of ages) {
      if (finished) { cell.textContent = "done"; tr.dataset.stale = "false"; continue; }
      const age = row.heard_at === null ? null : model.get("clock") - row.heard_at + drift;
      cell.textContent = age === null ? "not yet" : `${age.toFixed(1)} s ago`;
      tr.dataset.stale = String(age === null ? row.stale : age > limit);
    }
  }
  function draw() {
    receivedAt = Date.now() / 1000;
    root.replaceChildren();
    ages.length = 0;
    const rows = model.get("ranks"), loss = model.get("loss");
    const last = loss.length ? loss[loss.length - 1] : null;
    const state = model.get("finished") ? "finished" : "running";
    root.appendChild(h("div", "cl-dash-head", `${state} · step ${last ? last[0] + 1 : 0}/${model.get("steps")}` +
      (last ? ` · loss ${last[1].toFixed(4)}` : "") + speedText(model.get("speed"))));
    root.appendChild(lossChart(loss));
    const table = h("table", "cl-dash-table");
    const head = h("tr");
    for (const t of ["rank", "step", "step time per step", "compute | waiting", "memory", "last heard"])
      head.appendChild(h("th", null, t));
    table.appendChild(head);
    const slowest = Math.max(0, ...rows.flatMap((r) => r.step_s));
    for (const row of rows) {
      const tr = h("tr", "cl-dash-rank");
      tr.dataset.rank = row.rank;
      tr.dataset.step = row.step === null ? "" : row.step;
      tr.dataset.straggler = String(row.straggler);
      tr.appendChild(h("td", "cl-dash-id", `rank ${row.rank}`));
      tr.appendChild(h("td", "cl-dash-step", row.step === null ? "-" : String(row.step + 1)));
      const st = h("td"); st.appendChild(strip(row.step_s, slowest)); tr.appendChild(st);
      const sp = h("td"); sp.appendChild(split(row)); tr.appendChild(sp);
      tr.appendChild(h("td", "cl-dash-memory", row.memory_bytes === null ? "-" :
        `${(row.memory_bytes / 2 ** 20).toFixed(0)} MiB ${row.memory_kind}`));
      const age = h("td", "cl-dash-age");
      tr.appendChild(age);
      ages.push({ tr, cell: age, row });
      table.appendChild(tr);
    }
    root.appendChild(table);
    tick();
  }
  for (const name of ["ranks", "loss", "finished", "clock", "speed"]) model.on(`change:${name}`, draw);
  draw();
  const timer = setInterval(tick, 500);
  return () => clearInterval(timer);
}

export default { render };
