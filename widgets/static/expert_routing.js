// ExpertRouting: the all-to-all matrix of one MoE layer in one step, as a grid (`.cl-moe-grid`).
// Rows are source ranks (`.cl-moe-rank` labels), columns experts grouped by the ep rank holding them; each
// `.cl-moe-cell` (data-rank, data-expert, data-count) has data-local "true" (stays on the sender's ep rank) or
// "false" (crosses the wire) and shades by its share of the largest cell (--share). Under it one `.cl-moe-bar` per
// expert: kept, then dropped (`.cl-moe-dropped`), with the mean load dashed (`.cl-moe-mean`). The check heads it
// (`.cl-moe-ok` or `.cl-moe-mismatch`); `.cl-moe-step` / `.cl-moe-layer` selectors write `step` / `layer`, and
// Python recomputes `view`.

function header(v) {
  const box = h("div", "cl-moe-head");
  box.appendChild(h("div", "cl-moe-title", `step ${v.step} · ${v.layer} · ep=${v.ep} · top_k=${v.top_k}`));
  box.appendChild(h("div", v.ok ? "cl-moe-ok" : "cl-moe-mismatch", v.header));
  const others = elsewhere(v, "cl-moe-mismatch cl-moe-elsewhere");
  if (others) box.appendChild(others);
  return box;
}

function grid(v) {
  const g = h("div", "cl-moe-grid");
  g.style.gridTemplateColumns = `auto repeat(${v.experts}, minmax(26px, 1fr))`;
  const edge = (e) => e > 0 && v.owner[e] !== v.owner[e - 1];
  g.appendChild(h("div", "cl-moe-corner", ""));
  for (let k = 0; k < v.ep; k++) {
    const span = v.owner.filter((o) => o === k).length;
    const group = h("div", "cl-moe-group" + (k > 0 ? " cl-moe-sep-left" : ""), `experts on ep rank ${k}`);
    group.style.gridColumn = `span ${span}`;
    g.appendChild(group);
  }
  g.appendChild(h("div", "cl-moe-corner", "source rank \\ expert"));
  v.owner.forEach((_, e) => g.appendChild(h("div", "cl-moe-expert" + (edge(e) ? " cl-moe-sep-left" : ""), `e${e}`)));
  const peak = Math.max(1, ...v.rows.flat());
  v.rows.forEach((row, i) => {
    const top = i > 0 && v.ep_ranks[i] !== v.ep_ranks[i - 1] ? " cl-moe-sep-top" : "";
    g.appendChild(h("div", "cl-moe-rank" + top, `rank ${v.ranks[i]} (ep ${v.ep_ranks[i]})`));
    row.forEach((n, e) => {
      const cell = h("div", "cl-moe-cell" + top + (edge(e) ? " cl-moe-sep-left" : ""), v.numbers ? String(n) : "");
      const stays = v.owner[e] === v.ep_ranks[i];
      Object.assign(cell.dataset, { rank: v.ranks[i], expert: e, local: String(stays), count: n });
      cell.style.setProperty("--share", n / peak);
      if (n / peak > 0.55) cell.classList.add("cl-moe-dark");
      cell.title = `rank ${v.ranks[i]} → expert ${e} (on ep rank ${v.owner[e]}): ${n} assignments, `
        + (stays ? "stay on the rank" : "cross the wire");
      g.appendChild(cell);
    });
  });
  g.appendChild(h("div", "cl-moe-rank cl-moe-sep-top", "load"));
  const most = Math.max(1, ...v.totals);
  v.totals.forEach((total, e) => {
    const slot = h("div", "cl-moe-slot cl-moe-sep-top" + (edge(e) ? " cl-moe-sep-left" : ""));
    const bar = h("div", "cl-moe-bar");
    Object.assign(bar.dataset, { expert: e, total, dropped: v.dropped_per_expert[e] });
    bar.style.height = `${(100 * total) / most}%`;
    bar.title = `expert ${e}: ${total} assigned, ${v.kept[e]} kept, ${v.dropped_per_expert[e]} dropped`;
    const dropped = h("div", "cl-moe-dropped");
    dropped.style.height = `${total ? (100 * v.dropped_per_expert[e]) / total : 0}%`;
    bar.append(dropped, h("div", "cl-moe-kept"));
    const mean = h("div", "cl-moe-mean");
    mean.style.setProperty("--level", v.mean / most);
    slot.append(bar, mean, h("div", "cl-moe-total", String(total)));
    g.appendChild(slot);
  });
  return g;
}

function render({ model, el }) {
  const root = h("div", "cl-moe");
  el.appendChild(root);
  presentMode(model, root);
  function draw() {
    const v = model.get("view");
    root.replaceChildren(stepLayerControls(model, v, "cl-moe"));
    if (v.error) { root.appendChild(h("div", "cl-moe-mismatch", v.error)); return; }
    if (!(v.ranks || []).length) { root.appendChild(h("div", "cl-moe-empty", "no routing records")); return; }
    root.append(header(v), grid(v), h("div", "cl-moe-summary", v.summary),
      h("div", "cl-moe-legend", "green: stays on the sender's ep rank · blue: crosses the wire (all-to-all) · "
        + "bars: load per expert, red = dropped over capacity, dashed = mean load"));
  }
  model.on("change:view", draw);
  draw();
}

export default { render };
