// ShardingView: one `.cl-shard-row` per rank, three layers (params / grads / optim),
// each tensor a `.cl-tensor` box holding a `.cl-shard` (the slice held; `.cl-shard-none`
// when nothing is held). Elements are kept between redraws, so a new layout or an
// FSDP phase moves the slices with CSS transitions.
// Clicking a rank's label highlights what it holds in all three layers (`.cl-focused`, counts in `.cl-shard-focus`);
// hovering a tensor outlines it on every rank (`.cl-same-tensor`) and says each rank's slice.
// Reads tensors, rows, phases, phase, title, zero, sizes, interval_ms; writes phase.

const LAYERS = [["params", "parameters"], ["grads", "gradients"], ["optim", "optimizer state"]];

// Mirrors widgets/sharding_view.py::_layer_extents.
function layerExtents(row, layer, phase) {
  if (layer === "optim") return row.optim;
  if (!phase) return row.params;
  if (layer === "params") {
    const whole = new Set(phase.whole);
    return row.params.map((e, i) => (whole.has(i) && e ? row.gathered[i] : e));
  }
  const gw = new Set(phase.grads_whole), gs = new Set(phase.grads_shard);
  return row.params.map((e, i) => (gw.has(i) && e ? row.gathered[i] : gs.has(i) ? e : null));
}

function rowLabel(r) {
  const c = Object.entries(r.coords).map(([k, v]) => `${k}${v}`).join(" ");
  const stages = r.stages.length ? ` · stages ${r.stages.join(",")}` : "";
  return `rank ${r.rank} · ${c}${stages} · blocks ${r.blocks.join(",") || "-"}`;
}

// Elements of tensor t inside extent [d0 start, d0 stop, d1 start, d1 stop] (null: none).
function heldCount(t, ext) {
  if (!ext) return 0;
  const n = t.shape.reduce((a, b) => a * b, 1), n0 = t.shape[0] || 1, n1 = t.shape.length > 1 ? t.shape[1] : 1;
  const [a, b, c, d] = ext;
  return (b - a) * (t.shape.length > 1 ? d - c : 1) * (t.shape.length > 2 ? n / (n0 * n1) : 1);
}

function sliceText(t, ext) {
  return ext ? `dim0 ${ext[0]}:${ext[1]}` + (t.shape.length > 1 ? `, dim1 ${ext[2]}:${ext[3]}` : "") : "not held";
}

function render({ model, el }) {
  const root = h("div", "cl-sharding");
  el.appendChild(root);
  const head = h("div", "cl-sharding-title");
  const key = h("div", "cl-sharding-legend", "one box = one whole parameter tensor (every box the same width "
    + "whatever its size; hover for its shape and element count) · the coloured part = the slice this rank "
    + "holds: dim 0 across, dim 1 down · blue parameters, orange gradients, green optimizer state, "
    + "pale: gathered whole for the moment");
  const controls = h("div", "cl-phase-controls");
  const steps = h("div", "cl-phase-steps");
  const grid = h("div", "cl-shard-grid");
  const HINT = "click a rank's label to see what it holds in all three rows; "
    + "hover a tensor to see its slice on every rank";
  const focus = h("div", "cl-shard-focus", HINT);
  root.append(head, key, controls, steps, focus, grid);
  let focused = null; // the rank whose holdings are highlighted
  let structure = "";
  let slices = new Map(); // "rank|layer|tensor index" -> .cl-shard element
  let timer = null;
  const stop = () => { if (timer) clearInterval(timer); timer = null; };
  const setPhase = (k) => { model.set("phase", k); model.save_changes(); };

  function build(tensors, rows) {
    grid.replaceChildren();
    slices = new Map();
    const units = h("div", "cl-units");
    units.appendChild(h("div", "cl-shard-label", ""));
    const cols = h("div", "cl-tensors");
    tensors.forEach((t, i) => {
      const u = h("div", "cl-unit", i === 0 || tensors[i - 1].unit !== t.unit ? t.unit : "");
      u.title = t.name;
      cols.appendChild(u);
    });
    units.appendChild(cols);
    grid.appendChild(units);
    rows.forEach((r) => {
      const row = h("div", "cl-shard-row");
      row.dataset.rank = r.rank;
      const label = row.appendChild(h("div", "cl-shard-label", rowLabel(r)));
      label.onclick = () => { focused = focused === r.rank ? null : r.rank; showFocus(); };
      label.title = "click: highlight what this rank holds (parameters, gradients, optimizer state)";
      LAYERS.forEach(([layer, name]) => {
        const line = h("div", "cl-shard-layer");
        line.dataset.layer = layer;
        line.appendChild(h("div", "cl-layer-name", name));
        const boxes = h("div", "cl-tensors");
        tensors.forEach((t, i) => {
          const box = h("div", "cl-tensor");
          box.dataset.tensor = t.name;
          box.dataset.unit = t.unit;
          box.onmouseenter = () => showTensor(i);
          box.onmouseleave = () => showTensor(null);
          const s = h("div", "cl-shard-none");
          s.dataset.tensor = t.name;
          s.dataset.layer = layer;
          box.appendChild(s);
          boxes.appendChild(box);
          slices.set(`${r.rank}|${layer}|${i}`, s);
        });
        line.appendChild(boxes);
        row.appendChild(line);
      });
      grid.appendChild(row);
    });
  }

  function place(s, t, ext, gathered) {
    const n0 = t.shape[0] || 1, n1 = t.shape.length > 1 ? t.shape[1] : 1;
    s.className = ext ? "cl-shard" + (gathered ? " cl-gathered" : "") : "cl-shard-none";
    const [a, b, c, d] = ext || [0, 0, 0, n1];
    // dim 0 runs across, dim 1 runs down; a slice of nothing collapses to zero width
    s.style.left = `${(100 * a) / n0}%`;
    s.style.width = `${(100 * (b - a)) / n0}%`;
    s.style.top = `${(100 * c) / n1}%`;
    s.style.height = `${(100 * (d - c)) / n1}%`;
    s.dataset.start = a;
    s.dataset.stop = b;
    const where = sliceText(t, ext);
    const n = t.shape.reduce((a, b) => a * b, 1);
    const held = heldCount(t, ext);
    s.dataset.held = held;
    s.parentElement.title = `${t.name}: global shape [${t.shape.join(", ")}] = ${n} elements; `
      + `local slice ${where} = ${held} elements held here; `
      + `${t.placements.join(",")}` +
      `${t.mesh_axes.length ? " on " + t.mesh_axes.join(",") : ""}: ${where}`;
  }

  function drawControls(phases, k) {
    controls.replaceChildren();
    steps.replaceChildren();
    if (!phases.length) return;
    const last = phases.length - 1;
    const buttons = [["cl-phase-reset", null, "at rest", () => setPhase(-1)],
      ["cl-phase-back", "back", "", () => setPhase(Math.max(-1, k - 1)), "previous phase"],
      ["cl-phase-play", timer ? "pause" : "play", timer ? "" : "FSDP step", toggle, timer ? "pause" : "play"],
      ["cl-phase-next", "next", "", () => setPhase(Math.min(last, k + 1)), "next phase"]];
    buttons.forEach(([cls, name, text, fn, label]) => {
      const b = h("button", cls, name ? undefined : text);
      if (name) setButton(b, name, text, label);
      b.onclick = fn;
      controls.appendChild(b);
    });
    const label = k >= 0 ? `${k + 1}/${phases.length}: ${phases[k].label}` : "layout at rest";
    const span = h("span", "cl-phase-label", label);
    if (k >= 0) span.dataset.op = phases[k].op;
    controls.appendChild(span);
    phases.forEach((p, i) => {
      const s = h("div", "cl-phase-step" + (i === k ? " cl-current" : ""), p.op || "·");
      s.dataset.op = p.op;
      s.title = p.label;
      s.onclick = () => { stop(); setPhase(i); };
      steps.appendChild(s);
    });
  }

  function toggle() {
    if (timer) { stop(); draw(); return; }
    timer = setInterval(() => {
      const k = model.get("phase"), n = model.get("phases").length;
      if (k >= n - 1) { stop(); draw(); return; }
      setPhase(k + 1);
    }, model.get("interval_ms"));
    draw();
  }

  function current() {
    const phases = model.get("phases") || [];
    const k = Math.min(model.get("phase"), phases.length - 1);
    return k >= 0 ? phases[k] : null;
  }

  // What one rank holds across the three rows: its row stays, the others fade, and the counts are said.
  function showFocus() {
    const tensors = model.get("tensors") || [], rows = model.get("rows") || [];
    const row = rows.find((r) => r.rank === focused);
    root.classList.toggle("cl-focus-rank", !!row);
    grid.querySelectorAll(".cl-shard-row").forEach((e) => {
      e.classList.toggle("cl-focused", !!row && e.dataset.rank === String(focused));
    });
    if (!row) { focus.textContent = HINT; return; }
    const total = tensors.reduce((a, t) => a + t.shape.reduce((x, y) => x * y, 1), 0);
    const parts = LAYERS.map(([layer, name]) => {
      const held = layerExtents(row, layer, current()).reduce((a, e, i) => a + heldCount(tensors[i], e), 0);
      return `${name} ${held} of ${total} elements (${((100 * held) / (total || 1)).toFixed(1)}%)`;
    });
    focus.textContent = `rank ${row.rank} holds: ${parts.join(" · ")}`;
  }

  // One tensor on every rank: its boxes are outlined and the line says each rank's slice of it.
  function showTensor(i) {
    const tensors = model.get("tensors") || [], rows = model.get("rows") || [];
    grid.querySelectorAll(".cl-same-tensor").forEach((e) => e.classList.remove("cl-same-tensor"));
    if (i === null || !tensors[i]) { showFocus(); return; }
    const t = tensors[i];
    grid.querySelectorAll(".cl-tensor").forEach((e) => e.classList.toggle("cl-same-tensor", e.dataset.tensor === t.name));
    const each = rows.map((r) => `r${r.rank} ${sliceText(t, layerExtents(r, "params", current())[i])}`);
    focus.textContent = `${t.name}: global shape [${t.shape.join(", ")}], ${t.placements.join(",")}`
      + `${t.mesh_axes.length ? " on " + t.mesh_axes.join(",") : ""} · parameters held: ${each.join(" · ")}`;
  }

  function draw() {
    const tensors = model.get("tensors") || [], rows = model.get("rows") || [], phases = model.get("phases") || [];
    const k = Math.min(model.get("phase"), phases.length - 1);
    head.textContent = model.get("title") || "no layout";
    root.classList.toggle("cl-present", model.get("present"));
    const key = JSON.stringify([tensors.map((t) => t.name), rows.map((r) => r.rank)]);
    const fresh = key !== structure;
    if (fresh) { build(tensors, rows); structure = key; }
    grid.querySelectorAll(".cl-shard-row").forEach((el, i) => {
      el.querySelector(".cl-shard-label").textContent = rowLabel(rows[i]);
    });
    const phase = k >= 0 ? phases[k] : null;
    const apply = () => rows.forEach((r) => LAYERS.forEach(([layer]) => {
      const exts = layerExtents(r, layer, phase);
      const gathered = phase ? new Set(layer === "params" ? phase.whole : phase.grads_whole) : new Set();
      tensors.forEach((t, i) => place(slices.get(`${r.rank}|${layer}|${i}`), t, exts[i], gathered.has(i) && exts[i]));
    }));
    if (fresh) requestAnimationFrame(() => requestAnimationFrame(apply)); // grow in from nothing
    else apply();
    drawControls(phases, k);
    if (focused !== null) showFocus();
  }

  for (const name of ["tensors", "rows", "phases", "phase", "strategy", "title", "sizes", "present"]) {
    model.on(`change:${name}`, draw);
  }
  draw();
  return () => stop();
}

export default { render };
