// MemoryView: per rank (`.cl-mem-rank`, data-rank) a measured stacked bar (`.cl-mem-measured`) of
// `.cl-mem-seg[data-category]` beside the predicted one (`.cl-mem-predicted`), and a `.cl-mem-formula`
// tick at the ZeRO reference. `.cl-mem-moment[data-moment]` buttons write `moment`. Every bar shares one scale.

const LABELS = { params: "parameters", grads: "gradients", optimizer: "optimizer state",
  activations: "activations", other: "other" };
const COLORS = { params: "#4e79a7", grads: "#f28e2b", optimizer: "#59a14f", activations: "#e15759", other: "#bab0ac" };
const CSS = `
.cl-memory { font-family: var(--jp-ui-font-family, sans-serif); font-size: 12px;
  color: var(--jp-ui-font-color1, #222); }
.cl-mem-moments { margin: 4px 0; } .cl-mem-moments button { margin-right: 4px; padding: 2px 8px; cursor: pointer; }
.cl-mem-moment.cl-active { font-weight: bold; border-bottom: 2px solid #4e79a7; }
.cl-mem-legend { display: flex; gap: 10px; margin: 4px 0; flex-wrap: wrap; }
.cl-mem-swatch { display: inline-block; width: 10px; height: 10px; margin-right: 3px; vertical-align: -1px; }
.cl-mem-ranks { display: flex; gap: 14px; align-items: flex-end; padding: 4px; }
.cl-mem-rank { display: flex; flex-direction: column; align-items: center; }
.cl-mem-bars { position: relative; height: 220px; display: flex; gap: 3px; align-items: flex-end; }
.cl-mem-bar { width: 26px; height: 100%; display: flex; flex-direction: column-reverse; }
.cl-mem-seg { width: 100%; box-sizing: border-box; transition: height 0.4s; }
.cl-mem-predicted .cl-mem-seg { opacity: 0.45; border: 1px dashed #333; }
.cl-mem-formula { position: absolute; left: -3px; right: -3px; border-top: 2px dashed #000; transition: bottom 0.4s; }
.cl-mem-label { font-size: 11px; margin-top: 3px; text-align: center; }
.cl-mem-total { font-size: 10px; color: #555; text-align: center; }
`;

function bytes(v) {
  if (v === null || v === undefined) return "n/a";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let k = 0;
  while (Math.abs(v) >= 1024 && k < units.length - 1) { v /= 1024; k++; }
  return `${k ? v.toFixed(2) : v} ${units[k]}`;
}

function bar(cls, values, b, scale, cats, what) {
  const col = h("div", `cl-mem-bar ${cls}`);
  for (const cat of cats) {
    if (!(cat in values)) continue;
    const seg = h("div", "cl-mem-seg");
    seg.dataset.category = cat;
    seg.dataset.bytes = values[cat];
    seg.style.height = `${(100 * values[cat]) / scale}%`;
    seg.style.background = COLORS[cat] || "#999";
    const note = b.notes[cat] ? `\n${b.notes[cat]}` : "";
    seg.title = `rank ${b.rank} · ${LABELS[cat] || cat} · ${what}: ${bytes(values[cat])}${note}`;
    col.appendChild(seg);
  }
  return col;
}

function render({ model, el }) {
  const style = h("style");
  style.textContent = CSS;
  const root = h("div", "cl-memory");
  el.append(style, root);

  function draw() {
    const moment = model.get("moment");
    const bars = (model.get("bars") || {})[moment] || [];
    const scale = model.get("scale") || 1;
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
      sw.style.background = COLORS[cat];
      item.append(sw, LABELS[cat] || cat);
      legend.appendChild(item);
    }
    legend.append("left bar: measured · right (dashed): predicted · black dashes: ZeRO formula");
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
        h("div", "cl-mem-total", `${bytes(b.total)} | ${bytes(b.predicted_total)}${cuda}`));
      ranks.appendChild(col);
    }
    frag.append(tabs, legend, ranks);
    root.replaceChildren(frag);
  }

  for (const name of ["moment", "bars", "moments", "scale"]) model.on(`change:${name}`, draw);
  draw();
}

export default { render };
