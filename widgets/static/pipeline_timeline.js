// PipelineTimeline: one `.cl-lane` per rank (data-rank) holding `.cl-box` compute actions (data-kind F|B|I|W,
// data-mb, data-stage, data-chunk: which of the rank's stages, shaded per chunk, labelled "mb 3 · chunk 1", or "3·c1"
// or "c1" where the box is too narrow, or only in its tooltip where even that would be cut),
// `.cl-idle` gaps between them (blank), and `.cl-comm` strips (send, recv, collectives, optimizer) cut into
// `.cl-wait` (hatched: blocked before the peer arrived) and `.cl-transfer` (solid: data moving); a `.cl-axis` in ms;
// replay in event order with `.cl-play` and `.cl-scrub`; the bubble in `.cl-bubble`; the planned order as
// `.cl-planned-box` rows shown by `.cl-planned-toggle`; a dashed `.cl-vguide` on V schedules; `.cl-present` on the
// root in present mode. Reads every trait; writes `cursor_ms` and
// `show_planned`. The DOM is built once per state change (one DocumentFragment); the time that took,
// layout included, is written to `.cl-timeline[data-render-ms]`.

const LABEL = { F: "forward", B: "backward (full)", I: "backward, input grad", W: "backward, weight grad" };
const LEGEND = [["F", "F forward"], ["B", "B backward (full)"],
  ["I", "I backward, input grad"], ["W", "W backward, weight grad"],
  ["wait", "waiting (hatched): blocked in send/recv/collective before the peer was there"],
  ["transfer", "transfer (solid): data moving, both sides in"],
  ["optimizer", "optimizer step"],
  ["idle", "idle (blank): no compute on this rank"],
  ["vguide", "dashed V: the first micro-batch's forwards, down the ranks and back up"]]; // fixed order

const pct = (v, span) => `${(100 * v) / span}%`;
const f3 = (v) => (v === null || v === undefined ? "n/a" : Number(v).toFixed(3));
const ms = (v) => `${Number(v).toFixed(3)} ms`;

function tickStep(span) {
  const raw = span / 8;
  const p = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw);
}

function axis(span) {
  const row = h("div", "cl-axis-row");
  const ax = h("div", "cl-axis");
  const step = tickStep(span);
  for (let k = 0; k * step <= span * (1 + 1e-9); k++) {
    const tick = h("span", "cl-tick", String(+(k * step).toPrecision(6)));
    tick.dataset.ms = k * step;
    tick.style.left = pct(k * step, span);
    ax.appendChild(tick);
  }
  ax.appendChild(h("span", "cl-axis-unit", "ms"));
  row.appendChild(ax);
  return row;
}

function tip(c, i) {
  const k = c.kind[i];
  const when = `${ms(c.start[i])} to ${ms(c.end[i])} (${ms(c.end[i] - c.start[i])})`;
  const chunk = c.chunk[i] === null ? "" : ` (chunk ${c.chunk[i]} of this rank)`;
  if (LABEL[k]) return `${k}: ${LABEL[k]}\nrank ${c.rank[i]} · stage ${c.stage[i]}${chunk} · micro-batch ${c.mb[i]}\n${when}`;
  const peer = c.peer[i] === null ? "" : ` ${k === "send" ? "to" : "from"} rank ${c.peer[i]}`;
  const what = c.stage[i] === null ? "" : ` · stage ${c.stage[i]} · micro-batch ${c.mb[i]}`;
  const bytes = c.nbytes[i] ? ` · ${c.nbytes[i]} bytes` : "";
  return `${k}${peer}\nrank ${c.rank[i]}${what}${bytes}\n${when}`;
}

function line(...parts) {
  const d = h("div", "cl-bubble-line");
  d.append(...parts);
  return d;
}

// The measured bubble's parts (lab/measure/bubble_parts.py), each with what it means on hover.
const PARTS = [["schedule", "what the order itself costs: the step replayed with these very action times and zero-latency transfers"],
  ["transfer", "what the measured point-to-point hops add on the critical path"],
  ["other", "the rest between actions: Python in the schedule loop, wake-ups, instrumentation"]];

function bubbleBox(b, stepMs) {
  const box = h("div", "cl-bubble");
  if (!b || b.mean === undefined) {
    box.textContent = "no bubble report given";
    return box;
  }
  const v = b.stages_per_rank || 1;
  const vm = v > 1 ? "v·m" : "m";
  const head = h("div", "cl-bubble-head");
  const theory = b.theory === null || b.theory === undefined
    ? [line("theory: ", h("b", "cl-bubble-theory", "n/a"), " (no closed form for this schedule; see its planned order)")]
    : [line(`theory: bubble fraction ${b.theory_form || `(p-1)/(${vm}+p-1)`} = `, h("b", "cl-bubble-theory", f3(b.theory)),
      " (share of the makespan a rank is idle, the same kind of number as the measured one)"),
    line("bubble time / ideal time (Megatron's ratio form) = ",
      h("b", "cl-bubble-megatron", f3(b.theory_megatron)), " (not a fraction: it can exceed 1)")];
  if (b.planned !== null && b.planned !== undefined) {
    theory.push(line("planned order at T_F = T_B = T_W, zero-latency transfer = ", h("b", "cl-bubble-planned", f3(b.planned)),
      " (the order this schedule really runs, laid out without overhead)"));
  }
  head.append(`${b.schedule} · p=${b.pp} · m=${b.microbatches}${v > 1 ? ` · v=${v}` : ""} · step ${b.step} · `,
    h("span", "cl-bubble-mode", b.synthetic ? "synthetic costs (comparable with theory)"
      : "real compute (per-action overhead included; theory holds only for equal synthetic costs)"));
  const measured = line("measured bubble = mean over ranks of the idle share of the makespan = ",
    h("b", "cl-bubble-mean", f3(b.mean)));
  const parts = b.parts || {};
  const split = [];
  if (Object.keys(parts).length) {
    const sum = line("= ");
    PARTS.forEach(([name, what], i) => {
      const s = h("span", "cl-bubble-part", `${name} `);
      s.dataset.part = name;
      s.title = what;
      s.append(h("b", null, f3(parts[name])));
      sum.append(...(i ? [" + ", s] : [s]));
    });
    sum.classList.add("cl-bubble-parts");
    split.push(sum);
  }
  const per = h("div", "cl-bubble-ranks", "idle per rank: ");
  (b.ranks || []).forEach((r, i) => {
    const s = h("span", "cl-bubble-rank", `r${r} ${f3(b.idle[i])}`);
    s.dataset.rank = r;
    per.append(s, " ");
  });
  const us = (b.clock_uncertainty || 0) * 1e6;
  per.append(` · clock alignment ±${us.toFixed(1)} µs`);
  const defs = line(h("b", null, "makespan "), h("span", "cl-bubble-makespan", ms(b.makespan * 1e3)),
    " = first compute start to last compute end over all ranks (what the bubble is a share of) · ",
    h("b", null, "whole step "), h("span", "cl-bubble-step", ms(stepMs)),
    " = wall time from the step's first traced event to its last, incl. p2p, gradient all-reduce and optimizer");
  defs.classList.add("cl-bubble-defs");
  box.append(head, measured, ...split, ...theory, per, defs);
  return box;
}

function legendBox(present, chunks) {
  const legend = h("div", "cl-legend");
  for (const [key, text] of LEGEND) {
    if (!present.has(key)) continue;
    const item = h("span", "cl-legend-item");
    item.dataset.kind = key;
    const sw = h("span", "cl-swatch"); // styled by data-kind, so a swatch never counts as a box or a strip
    sw.dataset.kind = key;
    item.append(sw, text);
    legend.appendChild(item);
  }
  if (chunks > 1) { // the shade of a box says which model chunk (stage of this rank) it belongs to
    const item = h("span", "cl-legend-item cl-legend-chunks", "shade = model chunk (which of the rank's stages):");
    for (let k = 0; k < chunks; k++) {
      const sw = h("span", "cl-swatch");
      Object.assign(sw.dataset, { kind: "F", chunk: k });
      item.append(" ", sw, `chunk ${k}`);
    }
    legend.appendChild(item);
  }
  return legend;
}

function controls(model, present, chunks, hasPlan) {
  const bar = h("div", "cl-tl-controls");
  const play = setButton(h("button", "cl-play"), "play", "play");
  const scrub = h("input", "cl-scrub");
  Object.assign(scrub, { type: "range", min: 0, max: model.get("span_ms") || 1, step: "any" });
  const time = h("span", "cl-time");
  const toggle = h("button", "cl-planned-toggle", "planned order");
  toggle.disabled = !hasPlan;
  toggle.title = hasPlan ? "overlay the planned order, laid out with the measured mean durations"
    : "no planned order given";
  bar.append(play, scrub, time, toggle);
  return { bar, legend: legendBox(present, chunks), play, scrub, time, toggle };
}

function laneRows(ranks, bubble, match) {
  const idle = {};
  (bubble.ranks || []).forEach((r, i) => { idle[r] = bubble.idle[i]; });
  const lanes = h("div", "cl-lanes");
  const tracks = {};
  const plans = {};
  for (const r of ranks) {
    const lane = h("div", "cl-lane");
    lane.dataset.rank = r;
    const label = h("div", "cl-lane-label", `rank ${r}`);
    if (idle[r] !== undefined) label.appendChild(h("span", "cl-lane-idle", `idle ${f3(idle[r])}`));
    if (match[r] === false) label.appendChild(h("span", "cl-plan-differs", "order differs from plan"));
    const body = h("div", "cl-lane-body");
    tracks[r] = body.appendChild(h("div", "cl-track"));
    plans[r] = body.appendChild(h("div", "cl-planned-row"));
    lane.append(label, body);
    lanes.appendChild(lane);
  }
  return { lanes, tracks, plans };
}

function piece(track, cls, c, i, start, end, span, items, text) {
  const e = h("div", cls, text);
  e.dataset.kind = c.kind[i];
  if (c.mb[i] !== null) e.dataset.mb = c.mb[i];
  if (c.stage[i] !== null) e.dataset.stage = c.stage[i];
  if (c.chunk[i] !== null) e.dataset.chunk = c.chunk[i];
  e.style.cssText = `left:${pct(start, span)};width:${pct(end - start, span)}`;
  e.title = tip(c, i);
  track.appendChild(e);
  items.push([e, start, end, 2]);
}

// Returns [element, start, end, state] in event (start) order; a comm event is its wait, then its transfer.
function eventBoxes(c, tracks, span, chunks, fit) {
  const items = [];
  for (let i = 0; i < c.rank.length; i++) {
    const k = c.kind[i], track = tracks[c.rank[i]];
    if (LABEL[k]) {
      piece(track, "cl-box", c, i, c.start[i], c.end[i], span, items,
        fitted(boxTexts(c.mb[i], c.chunk[i], chunks), c.end[i] - c.start[i], fit));
    } else if (c.ready[i] === null) {
      piece(track, "cl-comm", c, i, c.start[i], c.end[i], span, items);
    } else {
      if (c.ready[i] > c.start[i]) piece(track, "cl-comm cl-wait", c, i, c.start[i], c.ready[i], span, items);
      if (c.end[i] > c.ready[i]) piece(track, "cl-comm cl-transfer", c, i, c.ready[i], c.end[i], span, items);
    }
  }
  return items;
}

function idleGaps(g, tracks, span, items) {
  for (let i = 0; i < g.rank.length; i++) {
    const e = h("div", "cl-idle");
    e.style.cssText = `left:${pct(g.start[i], span)};width:${pct(g.end[i] - g.start[i], span)}`;
    e.title = `idle: no compute on rank ${g.rank[i]}\n${ms(g.start[i])} to ${ms(g.end[i])} (${ms(g.end[i] - g.start[i])})`;
    tracks[g.rank[i]].appendChild(e);
    items.push([e, g.start[i], g.end[i], 2]);
  }
}

function plannedBoxes(p, plans, span, chunks, fit) {
  const small = { ...fit, width: textWidths(fit.font.replace(/\d+px/, "8px")) }; // planned boxes: 8px type
  for (let i = 0; i < p.rank.length; i++) {
    const e = h("div", "cl-planned-box", fitted(boxTexts(p.mb[i], p.chunk[i], chunks), p.end[i] - p.start[i], small));
    Object.assign(e.dataset, { kind: p.kind[i], mb: p.mb[i], stage: p.stage[i] });
    if (p.chunk[i] !== null) e.dataset.chunk = p.chunk[i];
    e.style.cssText = `left:${pct(p.start[i], span)};width:${pct(p.end[i] - p.start[i], span)}`;
    e.title = `planned: ${p.kind[i]} stage ${p.stage[i]} (chunk ${p.chunk[i]}) micro-batch ${p.mb[i]}\n`
      + `${ms(p.start[i])} to ${ms(p.end[i])} (laid out with the measured mean duration of ${p.kind[i]})`;
    plans[p.rank[i]].appendChild(e);
  }
}

function render({ model, el }) {
  const root = h("div", "cl-timeline");
  el.appendChild(root);
  let items = []; // [element, start, end, state] in event (start) order
  let ui = null;
  let cursor = null;
  let raf = null;
  let queued = false;
  let pending = null; // draws the planned boxes

  function showAt(t) {
    const span = model.get("span_ms") || 1;
    const all = t < 0 || t >= span;
    for (const it of items) { // [element, start, end, shown state]: touch only what changes
      const [e, s, end, was] = it;
      const now = all || t >= end ? 2 : s <= t ? 1 : 0; // 2 done, 1 running, 0 not started
      if (now === was && now !== 1) continue;
      if (now !== was) {
        e.classList.toggle("cl-future", now === 0);
        e.classList.toggle("cl-running", now === 1);
      }
      e.style.width = pct((now === 1 ? t : end) - s, span);
      it[3] = now;
    }
    cursor.style.display = all ? "none" : "block";
    cursor.style.left = `calc(var(--cl-label) + (100% - var(--cl-label)) * ${Math.max(0, t) / span})`;
    ui.scrub.value = all ? span : t;
    ui.time.textContent = all ? `time axis: ${ms(span)}` : `${ms(t)} / ${ms(span)}`;
  }

  function stop(save) {
    if (raf !== null) cancelAnimationFrame(raf);
    raf = null;
    if (ui) setButton(ui.play, "play", "play");
    if (save) { model.set("cursor_ms", Number(save.t)); model.save_changes(); }
  }

  function play() {
    if (raf !== null) { stop({ t: Number(ui.scrub.value) }); return; }
    const span = model.get("span_ms") || 1;
    const rate = span / (1000 * (model.get("play_seconds") || 6));
    let t = model.get("cursor_ms");
    if (t < 0 || t >= span) t = 0;
    let last = performance.now();
    setButton(ui.play, "pause", "pause");
    const tick = (now) => {
      t += (now - last) * rate;
      last = now;
      if (t >= span) { stop({ t: -1 }); showAt(-1); return; }
      showAt(t);
      raf = requestAnimationFrame(tick);
    };
    raf = requestAnimationFrame(tick);
  }

  function applyPlanned() {
    const on = model.get("show_planned");
    if (on && pending) { pending(); pending = null; }
    root.classList.toggle("cl-show-planned", on);
    ui.toggle.setAttribute("aria-pressed", String(on));
  }

  function build() {
    queued = false;
    const t0 = performance.now();
    stop();
    const c = model.get("events");
    const p = model.get("planned");
    const span = model.get("span_ms") || 1;
    const bubble = model.get("bubble") || {};
    const idle = model.get("idle") || { rank: [], start: [], end: [] };
    const chunks = 1 + Math.max(0, ...c.chunk.filter((k) => k !== null), ...(p.chunk || []).filter((k) => k !== null));
    const present = new Set(c.kind.filter((k) => LABEL[k]));
    c.ready.forEach((r, i) => {
      if (LABEL[c.kind[i]]) return;
      if (r === null) present.add(c.kind[i]);
      else { if (r > c.start[i]) present.add("wait"); if (c.end[i] > r) present.add("transfer"); }
    });
    if (idle.rank.length) present.add("idle");
    if ((model.get("vguide") || { rank: [] }).rank.length) present.add("vguide");
    ui = controls(model, present, chunks, p.rank.length > 0);
    ui.play.onclick = play;
    ui.scrub.oninput = () => { stop(); showAt(Number(ui.scrub.value)); };
    ui.scrub.onchange = () => { model.set("cursor_ms", Number(ui.scrub.value)); model.save_changes(); };
    ui.toggle.onclick = () => { model.set("show_planned", !model.get("show_planned")); model.save_changes(); };
    const frag = document.createDocumentFragment();
    frag.append(ui.bar, ui.legend, bubbleBox(bubble, Math.max(0, ...c.end)));
    const { lanes, tracks, plans } = laneRows(model.get("ranks"), bubble, model.get("plan_match") || {});
    root.classList.toggle("cl-present", model.get("present"));
    const family = getComputedStyle(root).fontFamily || "sans-serif";
    const font = model.get("present") ? `600 13px ${family}` : `9px ${family}`; // .cl-box's type (css)
    const fit = { span, px: trackWidth(root), font, width: textWidths(font) };
    items = eventBoxes(c, tracks, span, chunks, fit);
    idleGaps(idle, tracks, span, items);
    items.sort((a, b) => a[1] - b[1]);
    pending = () => plannedBoxes(p, plans, span, chunks, fit); // drawn on first show: the render stays one pass
    const guide = model.get("vguide") || { rank: [] };
    if (guide.rank.length) lanes.appendChild(vGuide(guide, model.get("ranks"), span));
    cursor = lanes.appendChild(h("div", "cl-cursor"));
    frag.append(lanes, axis(span));
    root.replaceChildren(frag);
    root.classList.toggle("cl-present", model.get("present"));
    applyPlanned();
    showAt(model.get("cursor_ms"));
    void root.offsetHeight; // force layout so the number includes it
    root.dataset.renderMs = (performance.now() - t0).toFixed(1);
    root.dataset.boxes = c.kind.filter((k) => LABEL[k]).length;
  }

  function rebuild() {
    if (!queued) { queued = true; queueMicrotask(build); }
  }

  for (const name of ["events", "idle", "vguide", "planned", "ranks", "span_ms", "bubble", "plan_match"]) {
    model.on(`change:${name}`, rebuild);
  }
  model.on("change:cursor_ms", () => { if (raf === null && !queued) showAt(model.get("cursor_ms")); });
  model.on("change:show_planned", applyPlanned);
  model.on("change:present", rebuild); // the labels are fitted to the present mode's font
  build();
  return () => stop();
}

export default { render };
