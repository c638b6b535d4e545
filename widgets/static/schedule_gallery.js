// ScheduleGallery: a `.cl-gallery` of `.cl-gallery-panel` (data-name), each a header with the measured bubble
// (`.cl-gallery-bubble-mean`) beside the theory (`.cl-gallery-bubble-theory`) and one `.cl-lane` per rank of
// `.cl-box` compute actions (data-kind, data-mb, data-stage, data-chunk; shaded per chunk as in PipelineTimeline),
// plus a dashed `.cl-vguide` on V schedules; one `.cl-gallery-axis` in ms shared by every panel; one play button
// and scrub replay all panels in lock-step. Reads panels, span_ms, cursor_ms, play_seconds, present; writes
// cursor_ms. Built once per state change; the time that took, layout included, is in `[data-render-ms]`.

const KIND_TEXT = { F: "F forward", B: "B backward (full)", I: "I backward, input grad", W: "W backward, weight grad" };
const pc = (v, span) => `${(100 * v) / span}%`;
const fx = (v) => (v === null || v === undefined ? "n/a" : Number(v).toFixed(3));

function galleryAxis(span) {
  const row = h("div", "cl-axis-row cl-gallery-axis");
  const ax = h("div", "cl-axis");
  const raw = span / 8, p = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw);
  for (let k = 0; k * step <= span * (1 + 1e-9); k++) {
    const tick = h("span", "cl-tick", String(+(k * step).toPrecision(6)));
    tick.style.left = pc(k * step, span);
    ax.appendChild(tick);
  }
  ax.appendChild(h("span", "cl-axis-unit", "ms from each run's first compute start"));
  row.appendChild(ax);
  return row;
}

function panelHead(p) {
  const b = p.bubble || {};
  const head = h("div", "cl-gallery-head");
  const m = (b.stages_per_rank || 1) > 1 ? "v·m" : "m";
  const parts = b.parts || {};
  const split = Object.keys(parts).length
    ? [" = ", h("span", "cl-gallery-bubble-parts",
      ["schedule", "transfer", "other"].map((k) => `${k} ${fx(parts[k])}`).join(" + "))] : [];
  head.append(h("b", "cl-gallery-name", p.name),
    ` · ${b.schedule || "?"} p=${b.pp} m=${b.microbatches} · measured bubble `,
    h("b", "cl-gallery-bubble-mean", fx(b.mean)), ...split,
    ` · theory ${b.theory_form || `(p-1)/(${m}+p-1)`} `, h("b", "cl-gallery-bubble-theory", fx(b.theory)),
    ` · makespan ${(1000 * (b.makespan || 0)).toFixed(0)} ms${b.synthetic ? "" : " · real compute"}`);
  return head;
}

function panelBody(p, span, items, fit) {
  const panel = h("div", "cl-gallery-panel");
  panel.dataset.name = p.name;
  const lanes = h("div", "cl-lanes");
  const tracks = {};
  for (const r of p.ranks) {
    const lane = h("div", "cl-lane");
    lane.dataset.rank = r;
    const body = h("div", "cl-lane-body");
    tracks[r] = body.appendChild(h("div", "cl-track"));
    lane.append(h("div", "cl-lane-label", `rank ${r}`), body);
    lanes.appendChild(lane);
  }
  const b = p.boxes;
  for (let i = 0; i < b.rank.length; i++) {
    const many = p.chunks > 1 && b.chunk[i] !== null;
    const w = b.end[i] - b.start[i];
    // the short labels of static/box_label.js: panels are narrow
    const e = h("div", "cl-box", fitted(boxTexts(b.mb[i], b.chunk[i], p.chunks).slice(1), w, fit));
    e.dataset.kind = b.kind[i];
    e.dataset.mb = b.mb[i];
    e.dataset.stage = b.stage[i];
    if (b.chunk[i] !== null) e.dataset.chunk = b.chunk[i];
    e.style.cssText = `left:${pc(b.start[i], span)};width:${pc(w, span)}`;
    e.title = `${p.name}: ${KIND_TEXT[b.kind[i]]}\nrank ${b.rank[i]} · stage ${b.stage[i]}`
      + `${many ? ` (chunk ${b.chunk[i]} of this rank)` : ""} · micro-batch ${b.mb[i]}\n`
      + `${b.start[i].toFixed(3)} to ${b.end[i].toFixed(3)} ms`;
    tracks[b.rank[i]].appendChild(e);
    items.push([e, b.start[i], b.end[i], 2]);
  }
  if (p.vguide && p.vguide.rank.length) lanes.appendChild(vGuide(p.vguide, p.ranks, span));
  panel.append(panelHead(p), lanes);
  return panel;
}

function galleryLegend(panels) {
  const legend = h("div", "cl-legend");
  const kinds = new Set(panels.flatMap((p) => p.boxes.kind));
  for (const k of ["F", "B", "I", "W"]) {
    if (!kinds.has(k)) continue;
    const item = h("span", "cl-legend-item");
    item.dataset.kind = k;
    const sw = h("span", "cl-swatch");
    sw.dataset.kind = k;
    item.append(sw, KIND_TEXT[k]);
    legend.appendChild(item);
  }
  const notes = ["blank: idle or communicating (open one run's timeline to tell waiting from transfer)",
    "box label: micro-batch, and ·c chunk where a rank holds several model chunks (darker shade = chunk 1); "
      + "only c1 where the box is narrow"];
  if (panels.some((p) => p.vguide && p.vguide.rank.length)) {
    notes.push("dashed V: the first micro-batch's forwards, down the ranks and back up");
  }
  for (const n of notes) legend.appendChild(h("span", "cl-legend-item cl-legend-note", n));
  return legend;
}

function render({ model, el }) {
  const root = h("div", "cl-gallery");
  el.appendChild(root);
  let items = [], ui = null, raf = null, cursor = null;

  function showAt(t) {
    const span = model.get("span_ms") || 1;
    const all = t < 0 || t >= span;
    for (const it of items) {
      const [e, s, end, was] = it;
      const now = all || t >= end ? 2 : s <= t ? 1 : 0;
      if (now === was && now !== 1) continue;
      if (now !== was) { e.classList.toggle("cl-future", now === 0); e.classList.toggle("cl-running", now === 1); }
      e.style.width = pc((now === 1 ? t : end) - s, span);
      it[3] = now;
    }
    cursor.style.display = all ? "none" : "block";
    cursor.style.left = `calc(var(--cl-label) + (100% - var(--cl-label)) * ${Math.max(0, t) / span})`;
    ui.scrub.value = all ? span : t;
    ui.time.textContent = all ? `shared axis: ${span.toFixed(1)} ms` : `${t.toFixed(1)} / ${span.toFixed(1)} ms`;
  }

  function stop(t) {
    if (raf !== null) cancelAnimationFrame(raf);
    raf = null;
    if (ui) setButton(ui.play, "play", "play all");
    if (t !== undefined) { model.set("cursor_ms", t); model.save_changes(); }
  }

  function play() {
    if (raf !== null) { stop(Number(ui.scrub.value)); return; }
    const span = model.get("span_ms") || 1;
    const rate = span / (1000 * (model.get("play_seconds") || 8));
    let t = model.get("cursor_ms");
    if (t < 0 || t >= span) t = 0;
    let last = performance.now();
    setButton(ui.play, "pause", "pause", "pause");
    const tick = (now) => {
      t += (now - last) * rate;
      last = now;
      if (t >= span) { stop(-1); showAt(-1); return; }
      showAt(t);
      raf = requestAnimationFrame(tick);
    };
    raf = requestAnimationFrame(tick);
  }

  function build() {
    const t0 = performance.now();
    stop();
    const panels = model.get("panels") || [];
    const span = model.get("span_ms") || 1;
    const bar = h("div", "cl-tl-controls");
    ui = { play: setButton(h("button", "cl-play"), "play", "play all"), scrub: h("input", "cl-scrub"),
      time: h("span", "cl-time") };
    Object.assign(ui.scrub, { type: "range", min: 0, max: span, step: "any" });
    ui.play.onclick = play;
    ui.scrub.oninput = () => { stop(); showAt(Number(ui.scrub.value)); };
    ui.scrub.onchange = () => { model.set("cursor_ms", Number(ui.scrub.value)); model.save_changes(); };
    bar.append(ui.play, ui.scrub, ui.time);
    items = [];
    const frag = document.createDocumentFragment();
    const body = h("div", "cl-gallery-panels");
    root.classList.toggle("cl-present", model.get("present"));
    const family = getComputedStyle(root).fontFamily || "sans-serif";
    const font = model.get("present") ? `600 13px ${family}` : `8px ${family}`; // .cl-gallery .cl-box's type (css)
    const fit = { span, px: trackWidth(root), width: textWidths(font) };
    for (const p of panels) body.appendChild(panelBody(p, span, items, fit));
    cursor = body.appendChild(h("div", "cl-cursor"));
    frag.append(bar, galleryLegend(panels), body, galleryAxis(span));
    root.replaceChildren(frag);
    root.classList.toggle("cl-present", model.get("present"));
    showAt(model.get("cursor_ms"));
    void root.offsetHeight; // force layout so the number includes it
    root.dataset.renderMs = (performance.now() - t0).toFixed(1);
    root.dataset.boxes = items.length;
  }

  model.on("change:panels", build);
  model.on("change:span_ms", build);
  model.on("change:present", build); // the labels are fitted to the present mode's type
  model.on("change:cursor_ms", () => { if (raf === null) showAt(model.get("cursor_ms")); });
  build();
  return () => stop();
}

export default { render };
