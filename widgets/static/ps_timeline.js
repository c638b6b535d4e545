// PSTimeline: one `.cl-ps-lane` per rank; each span a `.cl-ps-span` (data-kind) placed by its share of the run.
// Reads `lanes` and `colours`; redraws on change.

function render({ model, el }) {
  const root = h("div", "cl-ps");
  el.appendChild(root);
  presentMode(model, root);
  function draw() {
    root.replaceChildren();
    const lanes = model.get("lanes");
    const colours = model.get("colours");
    const end = Math.max(1e-9, ...lanes.flatMap((l) => l.spans.map((s) => s.end)));
    const legend = h("div", "cl-ps-legend");
    for (const [kind, colour] of Object.entries(colours)) {
      const key = h("span", "", kind);
      key.style.background = colour;
      legend.appendChild(key);
    }
    root.appendChild(legend);
    for (const lane of lanes) {
      const row = h("div", "cl-ps-lane");
      row.dataset.rank = lane.rank;
      row.appendChild(h("div", "cl-ps-rank", `rank ${lane.rank}`));
      const track = h("div", "cl-ps-track");
      for (const s of lane.spans) {
        const bar = h("div", "cl-ps-span");
        bar.dataset.kind = s.kind;
        bar.style.left = `${(100 * s.start) / end}%`;
        bar.style.width = `${(100 * (s.end - s.start)) / end}%`;
        bar.style.background = colours[s.kind];
        bar.title = `${s.kind}, step ${s.step}: ${((s.end - s.start) * 1e3).toFixed(1)} ms`;
        track.appendChild(bar);
      }
      row.appendChild(track);
      root.appendChild(row);
    }
    root.appendChild(h("div", "cl-ps-axis", `0 - ${end.toFixed(2)} s`));
  }
  model.on("change:lanes", draw);
  draw();
}

export default { render };
