// MemoryView's peak-over-time strip (widgets/_memory_strip.py): per rank a `.cl-mem-strip-rank[data-rank]` row,
// an SVG of the four categories stacked as steps over the traced step (`path[data-category]`), a `.cl-mem-strip-peak`
// marker and label, on one time axis and one byte scale; moving over a row reads out the sample under the pointer.
const STRIP_CSS = `
.cl-mem-strip { margin-top: 10px; }
.cl-mem-strip-title { font-weight: bold; margin-bottom: 2px; }
.cl-mem-strip-rank { display: flex; align-items: center; gap: 6px; height: 46px; }
.cl-mem-strip-name { width: 56px; text-align: right; font-size: 11px; flex: none; }
.cl-mem-strip-plot { position: relative; flex: 1; height: 100%; min-width: 300px; border-left: 1px solid #777;
  border-bottom: 1px solid #777; }
.cl-mem-strip-plot svg { position: absolute; inset: 0; width: 100%; height: 100%; }
.cl-mem-strip path[data-category="params"] { fill: #4e79a7; } .cl-mem-strip path[data-category="grads"] { fill: #f28e2b; }
.cl-mem-strip path[data-category="optimizer"] { fill: #59a14f; }
.cl-mem-strip path[data-category="activations"] { fill: #e15759; }
.cl-mem-strip-peak { position: absolute; font-size: 10px; white-space: nowrap; transform: translateX(-50%);
  top: -2px; pointer-events: none; }
.cl-mem-strip-peak::before { content: ""; display: inline-block; margin-right: 3px; border: 4px solid transparent;
  border-top: 6px solid #000; border-bottom: 0; }
.cl-mem-strip-axis { display: flex; justify-content: space-between; margin-left: 62px; font-size: 10px; color: #444; }
.cl-mem-strip-readout { font-size: 11px; min-height: 1.3em; margin-left: 62px; color: #333; }
.cl-present .cl-mem-strip-rank { height: 64px; } .cl-present .cl-mem-strip-name { font-size: 14px; width: 72px; }
.cl-present .cl-mem-strip-peak, .cl-present .cl-mem-strip-axis, .cl-present .cl-mem-strip-readout { font-size: 13px; }
.cl-present .cl-mem-strip path[data-category="params"] { fill: #0072b2; }
.cl-present .cl-mem-strip path[data-category="grads"] { fill: #e69f00; }
.cl-present .cl-mem-strip path[data-category="optimizer"] { fill: #009e73; }
.cl-present .cl-mem-strip path[data-category="activations"] { fill: #d55e00; }
`;
const STRIP_STACK = ["params", "grads", "optimizer", "activations"];

// One category's band as a step area: from the sample's time to the next one, between `low` and `high`.
function stepBand(t, low, high, span, scale) {
  const x = (v) => ((1000 * v) / span).toFixed(1);
  const y = (v) => (100 - (100 * v) / scale).toFixed(2);
  const ends = t.slice(1).concat([span]);
  let top = "", bottom = "";
  t.forEach((t0, i) => { top += `L${x(t0)},${y(high[i])}L${x(ends[i])},${y(high[i])}`; });
  for (let i = t.length - 1; i >= 0; i--) bottom += `L${x(ends[i])},${y(low[i])}L${x(t[i])},${y(low[i])}`;
  return "M" + (top + bottom).slice(1) + "Z";
}

function memoryStrip(strip, fmt) {
  const box = h("div", "cl-mem-strip");
  if (!strip || !(strip.rows || []).length) return box;
  const ns = "http://www.w3.org/2000/svg";
  const scale = strip.scale * 1.15 || 1;
  const span = strip.span_ms || 1;
  const readout = h("div", "cl-mem-strip-readout", "move over a rank's strip to read a sample");
  box.appendChild(h("div", "cl-mem-strip-title", "memory over the traced step, per rank (measured after each action)"));
  for (const row of strip.rows) {
    const line = h("div", "cl-mem-strip-rank");
    line.dataset.rank = row.rank;
    const plot = h("div", "cl-mem-strip-plot");
    const svg = document.createElementNS(ns, "svg");
    svg.setAttribute("viewBox", "0 0 1000 100");
    svg.setAttribute("preserveAspectRatio", "none");
    let low = row.t.map(() => 0);
    for (const cat of STRIP_STACK) {
      const high = low.map((v, i) => v + row.stack[cat][i]);
      const path = document.createElementNS(ns, "path");
      path.dataset.category = cat;
      path.setAttribute("d", stepBand(row.t, low, high, span, scale));
      svg.appendChild(path);
      low = high;
    }
    const k = row.peak.index;
    const peak = h("span", "cl-mem-strip-peak", `peak ${fmt(row.peak.bytes)} after ${row.peak.label}`);
    peak.dataset.bytes = row.peak.bytes;
    peak.style.left = `${(100 * row.t[k]) / span}%`;
    plot.append(svg, peak);
    plot.onmousemove = (ev) => {
      const r = plot.getBoundingClientRect();
      const at = ((ev.clientX - r.left) / r.width) * span;
      let i = 0;
      while (i + 1 < row.t.length && row.t[i + 1] <= at) i++;
      const parts = STRIP_STACK.map((c) => `${c} ${fmt(row.stack[c][i])}`).join(" · ");
      const total = STRIP_STACK.reduce((a, c) => a + row.stack[c][i], 0);
      readout.textContent = `rank ${row.rank} after ${row.labels[i]} (${row.t[i]} ms): ${fmt(total)} = ${parts}`;
    };
    line.append(h("span", "cl-mem-strip-name", `rank ${row.rank}`), plot);
    box.appendChild(line);
  }
  const axisRow = h("div", "cl-mem-strip-axis");
  axisRow.append(h("span", null, "0 ms"), h("span", null, "time in the traced step (ms)"),
    h("span", null, `${(+span).toFixed(1)} ms`));
  box.append(axisRow, readout);
  return box;
}
