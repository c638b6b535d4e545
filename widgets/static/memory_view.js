// MemoryView: per rank (`.cl-mem-rank`, data-rank) a measured stacked bar (`.cl-mem-measured`) of
// `.cl-mem-seg[data-category]` beside the predicted one (`.cl-mem-predicted`), and a `.cl-mem-formula`
// tick at the ZeRO reference. `.cl-mem-moment[data-moment]` buttons write `moment`. Every bar shares one scale,
// read on the `.cl-mem-axis` (bytes, `.cl-mem-tick` labels); under each rank a `.cl-mem-table` gives the
// measured and predicted bytes per category, and a `.cl-mem-parts` table the activations by part (when measured),
// each beside its prediction. Under the bars, `.cl-mem-strip` (static/memory_strip.js): memory over the traced step.

const LABELS = { params: "parameters", grads: "gradients", optimizer: "optimizer state",
  activations: "activations", other: "other" };
// Colours by data-category (as widgets/memory_view.py COLORS); present mode swaps in the Okabe-Ito palette.
const CSS = `
.cl-memory { font-family: var(--jp-ui-font-family, sans-serif); font-size: 12px;
  color: var(--jp-ui-font-color1, #222); }
.cl-mem-moments { margin: 4px 0; } .cl-mem-moments button { margin-right: 4px; padding: 2px 8px; cursor: pointer; }
.cl-mem-moment.cl-active { font-weight: bold; border-bottom: 2px solid #4e79a7; }
.cl-mem-legend { display: flex; gap: 10px; margin: 4px 0; flex-wrap: wrap; }
.cl-mem-swatch { display: inline-block; width: 10px; height: 10px; margin-right: 3px; vertical-align: -1px; }
.cl-mem-plot { display: flex; align-items: flex-start; }
.cl-mem-axis { position: relative; height: 220px; width: 64px; margin: 4px 4px 0 0; border-right: 1px solid #777;
  flex: none; }
.cl-mem-tick { position: absolute; right: 0; transform: translateY(50%); font-size: 10px; color: #444;
  padding-right: 5px; white-space: nowrap; }
.cl-mem-tick::after { content: ""; position: absolute; right: -1px; top: 50%; width: 4px; border-top: 1px solid #777; }
.cl-mem-axis-label { position: absolute; left: 0; top: -2px; font-size: 10px; color: #444;
  transform: rotate(-90deg) translateX(-100%); transform-origin: left top; white-space: nowrap; }
.cl-mem-ranks { display: flex; gap: 14px; align-items: flex-start; padding: 4px; }
.cl-mem-rank { display: flex; flex-direction: column; align-items: center; }
.cl-mem-bars { position: relative; height: 220px; display: flex; gap: 3px; align-items: flex-end; }
.cl-mem-bar { width: 26px; height: 100%; display: flex; flex-direction: column-reverse; }
.cl-mem-seg { width: 100%; box-sizing: border-box; transition: height 0.4s; }
.cl-mem-predicted .cl-mem-seg { opacity: 0.45; border: 1px dashed #333; }
.cl-mem-formula { position: absolute; left: -3px; right: -3px; border-top: 2px dashed #000; transition: bottom 0.4s; }
.cl-mem-label { font-size: 11px; margin-top: 3px; text-align: center; }
.cl-mem-total { font-size: 10px; color: #555; text-align: center; }
.cl-mem-table { font-size: 10px; border-collapse: collapse; margin-top: 2px; }
.cl-mem-table td, .cl-mem-table th { padding: 0 3px; text-align: right; font-weight: normal; }
.cl-mem-table th { color: #555; }
.cl-mem-parts { font-size: 10px; border-collapse: collapse; margin-top: 4px; }
.cl-mem-parts td, .cl-mem-parts th { padding: 0 3px; text-align: right; font-weight: normal; white-space: nowrap; }
.cl-mem-parts caption { caption-side: bottom; font-size: 9px; color: #555; }
.cl-present .cl-mem-parts { font-size: 13px; }
.cl-mem-seg, .cl-mem-swatch { background: #999; }
[data-category="params"]:is(.cl-mem-seg, .cl-mem-swatch) { background: #4e79a7; }
[data-category="grads"]:is(.cl-mem-seg, .cl-mem-swatch) { background: #f28e2b; }
[data-category="optimizer"]:is(.cl-mem-seg, .cl-mem-swatch) { background: #59a14f; }
[data-category="activations"]:is(.cl-mem-seg, .cl-mem-swatch) { background: #e15759; }
[data-category="other"]:is(.cl-mem-seg, .cl-mem-swatch) { background: #bab0ac; }
.cl-memory.cl-present { font-size: 16px; }
.cl-present :is(.cl-mem-tick, .cl-mem-axis-label, .cl-mem-total, .cl-mem-table, .cl-mem-table th) { font-size: 13px;
  color: #000; }
.cl-present .cl-mem-label { font-size: 14px; }
.cl-present .cl-mem-bar { width: 36px; }
.cl-present .cl-mem-predicted .cl-mem-seg { opacity: 0.55; border: 2px dashed #000; }
.cl-present [data-category="params"]:is(.cl-mem-seg, .cl-mem-swatch) { background: #0072b2; }
.cl-present [data-category="grads"]:is(.cl-mem-seg, .cl-mem-swatch) { background: #e69f00; }
.cl-present [data-category="optimizer"]:is(.cl-mem-seg, .cl-mem-swatch) { background: #009e73; }
.cl-present [data-category="activations"]:is(.cl-mem-seg, .cl-mem-swatch) { background: #d55e00; }
.cl-present [data-category="other"]:is(.cl-mem-seg, .cl-mem-swatch) { background: #999999; }
`;

function bytes(v) {
  if (v === null || v === undefined) return "n/a";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let k = 0;
  while (Math.abs(v) >= 1024 && k < units.length - 1) { v /= 1024; k++; }
  return `${k ? v.toFixed(2) : v} ${units[k]}`;
}

// A round top for the shared scale and its ticks: 1, 2 or 5 times a power of ten of a binary unit.
function ticks(scale) {
  const units = [["B", 1], ["KiB", 1024], ["MiB", 1024 ** 2], ["GiB", 1024 ** 3], ["TiB", 1024 ** 4]];
  const [unit, size] = units.filter(([, u]) => scale / u >= 1).pop() || units[0];
  const raw = scale / size / 5;
  const p = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * p).find((x) => x >= raw);
  const count = Math.ceil(scale / size / step - 1e-9);
  return { unit, top: count * step * size, values: [...Array(count + 1).keys()].map((k) => k * step * size),
    label: (v) => `${+(v / size).toPrecision(6)} ${unit}` };
}

function axis(t) {
  const ax = h("div", "cl-mem-axis");
  for (const v of t.values) {
    const tick = h("span", "cl-mem-tick", t.label(v));
    tick.dataset.bytes = v;
    tick.style.bottom = `${(100 * v) / t.top}%`;
    ax.appendChild(tick);
  }
  ax.appendChild(h("span", "cl-mem-axis-label", `bytes (${t.unit})`));
  return ax;
}

function table(b, cats) {
  const t = h("table", "cl-mem-table");
  const head = t.appendChild(h("tr"));
  head.append(h("th", null, ""), h("th", null, "measured"), h("th", null, "predicted"));
  for (const cat of cats) {
    if (!b.measured[cat] && !(cat in b.predicted)) continue;
    const row = t.appendChild(h("tr"));
    row.dataset.category = cat;
    row.append(h("th", null, LABELS[cat] || cat), h("td", "cl-mem-measured-bytes", bytes(b.measured[cat])),
      h("td", "cl-mem-predicted-bytes", cat in b.predicted ? bytes(b.predicted[cat]) : "no rule"));
  }
  return t;
}

// The activations by the part of the model that saved them, measured beside the rule's prediction; each number's
// source is stated in the caption and on hover (the measured cell: the hooks; the predicted cell: the rule).
function partsTable(b) {
  const parts = Object.entries(b.activation_parts || {});
  if (!parts.length) return "";
  const t = h("table", "cl-mem-parts");
  const head = t.appendChild(h("tr"));
  head.append(h("th", null, "activations by part"), h("th", null, "measured"), h("th", null, "predicted"));
  const total = parts.reduce((a, [, v]) => a + (v.measured || 0), 0);
  for (const [part, v] of parts.sort((x, y) => (y[1].measured || 0) - (x[1].measured || 0))) {
    const row = t.appendChild(h("tr"));
    row.dataset.part = part;
    const share = total ? ` (${((100 * v.measured) / total).toFixed(0)}%)` : "";
    const measured = h("td", "cl-mem-part-bytes", `${bytes(v.measured)}${share}`);
    measured.title = v.source;
    const known = v.predicted !== null && v.predicted !== undefined;
    const predicted = h("td", "cl-mem-part-predicted", known ? bytes(v.predicted) : "no rule");
    predicted.title = v.predicted_source || "";
    if (known) predicted.dataset.bytes = v.predicted;
    row.append(h("th", null, part), measured, predicted);
  }
  const rule = parts.map(([, v]) => v.predicted_source).find((x) => x) || "";
  t.appendChild(h("caption", "cl-mem-parts-source",
    `measured: saved-tensor hooks by module · ${rule.startsWith("predicted") ? "predicted: the GPT rule of "
      + "kernels/activation_rules.py" : rule || "no prediction"} (hover a cell)`));
  return t;
}

function bar(cls, values, b, scale, cats, what) {
  const col = h("div", `cl-mem-bar ${cls}`);
  for (const cat of cats) {
    if (!(cat in values)) continue;
    const seg = h("div", "cl-mem-seg");
    seg.dataset.category = cat;
    seg.dataset.bytes = values[cat];
    seg.style.height = `${(100 * values[cat]) / scale}%`;
    const note = b.notes[cat] ? `\n${b.notes[cat]}` : "";
    seg.title = `rank ${b.rank} · ${LABELS[cat] || cat} · ${what}: ${bytes(values[cat])}${note}`;
    col.appendChild(seg);
  }
  return col;
}

function render({ model, el }) {
  const style = h("style");
  style.textContent = CSS + STRIP_CSS;
  const root = h("div", "cl-memory");
  el.append(style, root);

  function draw() {
    const moment = model.get("moment");
    const bars = (model.get("bars") || {})[moment] || [];
    const t = ticks(model.get("scale") || 1);
    const scale = t.top;
    const cats = model.get("categories");
    const frag = document.createDocumentFragment();
    const tabs = h("div", "cl-mem-moments");
    for (const m of model.get("moments")) {
      const b = h("button", "cl-mem-moment" + (m === moment ? " cl-active" : ""), m.replaceAll("_", " "));
      b.dataset.moment = m;
      b.onclick = () => { model.set("moment", m); model.save_changes(); };
      tabs.appendChild(b);
    }
    const legend = h("div", "cl-mem-legend");
    for (const cat of cats) {
      const item = h("span", "cl-mem-legend-item");
      const sw = h("span", "cl-mem-swatch");
      sw.dataset.category = cat;
      item.append(sw, LABELS[cat] || cat);
      legend.appendChild(item);
    }
    if (bars.length) legend.append("per rank: left bar measured, right bar (faded, dashed) predicted by the exact rule; "
      + "black dashes: the ZeRO formula");
    const ranks = h("div", "cl-mem-ranks");
    if (!bars.length) ranks.textContent = "no memory records";
    for (const b of bars) {
      const col = h("div", "cl-mem-rank");
      col.dataset.rank = b.rank;
      const area = h("div", "cl-mem-bars");
      area.append(bar("cl-mem-measured", b.measured, b, scale, cats, "measured"),
        bar("cl-mem-predicted", b.predicted, b, scale, cats, "predicted"));
      if (b.formula_total) {
        const f = h("div", "cl-mem-formula");
        f.style.bottom = `${(100 * b.formula_total) / scale}%`;
        f.title = `ZeRO formula (docs/design.md#zero-formulas): ${bytes(b.formula_total)}`;
        area.appendChild(f);
      }
      const cuda = b.cuda_max_allocated === null ? "" : ` · cuda max ${bytes(b.cuda_max_allocated)}`;
      col.append(area, h("div", "cl-mem-label", `rank ${b.rank}`),
        h("div", "cl-mem-total", `total: measured ${bytes(b.total)} · predicted ${bytes(b.predicted_total)}${cuda}`),
        table(b, cats), partsTable(b));
      ranks.appendChild(col);
    }
    const plot = h("div", "cl-mem-plot");
    plot.append(axis(t), ranks);
    frag.append(tabs, legend);
    if (bars.length || !(model.get("strip").rows || []).length) frag.append(plot);
    frag.append(memoryStrip(model.get("strip"), bytes));
    root.replaceChildren(frag);
    root.classList.toggle("cl-present", model.get("present"));
  }

  for (const name of ["moment", "bars", "moments", "scale", "present", "strip"]) model.on(`change:${name}`, draw);
  draw();
}

export default { render };
