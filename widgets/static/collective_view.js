// CollectiveView: the ring twin of each real collective, one frame per step.
// Reads `ops`, `op`, `frame`, `interval_ms`; writes `op` and `frame`.

const fmt = (v) => (Number.isInteger(v) ? String(v) : v.toPrecision(4));

function frameLabel(f) {
  if (f.phase === "input") return "inputs";
  return `${f.phase} ${f.step + 1}`;
}

function sendText(sends, rank) {
  const s = sends.filter((x) => x[0] === rank);
  return s.map((x) => `→ rank ${x[1]}: c${x[2]}`).join(", ");
}

// Mirrors widgets/_ring.py::_cells_at: frame 0's grid with the updates of frames 1..k applied.
function cellsAt(frames, k) {
  const cells = frames[0].cells.map((row) => row.slice());
  frames.slice(1, k + 1).forEach((f) => f.updates.forEach(([dst, c, cell]) => { cells[dst][c] = cell; }));
  return cells;
}

function renderRing(view, k) {
  const ring = h("div", "cl-ring");
  const n = view.world;
  const f = view.frames[k];
  const received = new Set(f.sends.map((s) => `${s[1]}:${s[2]}`));
  cellsAt(view.frames, k).forEach((row, i) => {
    const rank = view.ranks[i];
    const box = h("div", "cl-ring-rank");
    box.dataset.rank = rank;
    const angle = (2 * Math.PI * i) / n - Math.PI / 2;
    box.style.left = `${50 + 36 * Math.cos(angle)}%`;
    box.style.top = `${50 + 34 * Math.sin(angle)}%`;
    box.appendChild(h("div", "cl-ring-title", `rank ${rank}`));
    row.forEach((cell, c) => {
      const chunk = h("div", "cl-chunk");
      chunk.dataset.chunk = c;
      chunk.dataset.count = cell ? cell.from.length : 0;
      if (received.has(`${i}:${c}`)) chunk.classList.add("cl-chunk-recv");
      if (!cell || !cell.v.length) chunk.classList.add("cl-chunk-empty");
      if (cell && cell.from.length === n) chunk.classList.add("cl-chunk-full");
      chunk.style.setProperty("--share", cell ? cell.from.length / n : 0);
      const label = row.length > 1 ? `c${c}` : "x";
      const values = cell ? cell.v.map(fmt).join(", ") : "";
      if (values) chunk.textContent = `${label}: [${values}] Σ{${cell.from.join("+")}}`;
      else chunk.textContent = `${label}: ${cell ? "(empty chunk)" : "·"}`;
      box.appendChild(chunk);
    });
    const send = sendText(f.sends, i);
    if (send) box.appendChild(h("div", "cl-send", send));
    ring.appendChild(box);
  });
  return ring;
}

function renderIO(view) {
  const table = h("table", "cl-io");
  const head = h("tr");
  ["rank", "input", "real output", "ring twin"].forEach((t) => head.appendChild(h("th", "", t)));
  table.appendChild(head);
  view.ranks.forEach((rank, i) => {
    const tr = h("tr", "cl-io-row");
    tr.dataset.rank = rank;
    const same = JSON.stringify(view.outputs[i]) === JSON.stringify(view.final[i]);
    [rank, view.inputs[i].map(fmt).join(", "), view.outputs[i].map(fmt).join(", "),
     view.final[i].map(fmt).join(", ")].forEach((t) => tr.appendChild(h("td", "", String(t))));
    if (!view.ok && !same) tr.classList.add("cl-io-bad");
    table.appendChild(tr);
  });
  return table;
}

function render({ model, el }) {
  const root = h("div", "cl-collective");
  el.appendChild(root);
  presentMode(model, root);
  let timer = null;

  const stop = () => { if (timer) clearInterval(timer); timer = null; };
  const setFrame = (k) => { model.set("frame", k); model.save_changes(); };
  const current = () => (model.get("ops") || []).find((v) => v.op === model.get("op"));

  function draw() {
    root.replaceChildren();
    const ops = model.get("ops") || [];
    const view = current();
    const tabs = h("div", "cl-op-tabs");
    ops.forEach((v) => {
      const b = h("button", "cl-op-tab" + (v.op === model.get("op") ? " cl-active" : ""), v.op);
      b.dataset.op = v.op;
      if (!v.ok) b.classList.add("cl-op-bad");
      b.onclick = () => { stop(); model.set("op", v.op); model.set("frame", 0); model.save_changes(); };
      tabs.appendChild(b);
    });
    root.appendChild(tabs);
    if (!view) { root.appendChild(h("div", "cl-empty", "no collective records")); return; }
    const frames = view.frames;
    const k = Math.max(0, Math.min(frames.length - 1, model.get("frame")));
    const controls = h("div", "cl-controls");
    const last = frames.length - 1;
    const buttons = [["cl-reset", null, "reset", () => setFrame(0)],
      ["cl-back", "back", "previous step", () => setFrame(Math.max(0, k - 1))],
      ["cl-play", timer ? "pause" : "play", timer ? "pause" : "play", () => toggle()],
      ["cl-next", "next", "next step", () => setFrame(Math.min(last, k + 1))]];
    buttons.forEach(([cls, name, label, fn]) => {
      const b = name ? setButton(h("button", cls), name, "", label) : h("button", cls, label);
      b.onclick = fn;
      controls.appendChild(b);
    });
    controls.appendChild(h("span", "cl-frame-label", `step ${k} / ${frames.length - 1}: ${frameLabel(frames[k])}`));
    root.appendChild(controls);
    const okText = `ring twin ends with the ranks' real outputs (${view.world} ranks)`;
    if (view.ok) root.appendChild(h("div", "cl-ok", okText));
    else root.appendChild(h("div", "cl-mismatch", view.mismatch));
    const steps = h("div", "cl-steps");
    frames.forEach((f, i) => {
      const s = h("div", "cl-ring-step" + (i === k ? " cl-current" : "") + (i < k ? " cl-done" : ""), frameLabel(f));
      s.dataset.frame = i;
      s.dataset.phase = f.phase;
      s.onclick = () => { stop(); setFrame(i); };
      steps.appendChild(s);
    });
    root.appendChild(steps);
    root.appendChild(renderRing(view, k));
    root.appendChild(renderIO(view));
  }

  function toggle() {
    if (timer) { stop(); draw(); return; }
    const view = current();
    if (!view) return;
    if (model.get("frame") >= view.frames.length - 1) setFrame(0);
    timer = setInterval(() => {
      const f = model.get("frame");
      if (f >= current().frames.length - 1) { stop(); draw(); return; }
      setFrame(f + 1);
    }, model.get("interval_ms"));
    draw();
  }

  model.on("change:ops", draw);
  model.on("change:op", draw);
  model.on("change:frame", draw);
  draw();
  return () => stop();
}

export default { render };
