// RingTimeline: one `.cl-cp-lane` per rank (data-rank, data-cp-rank) on a shared ms axis. Per ring step a
// `.cl-cp-compute` box (data-ring-step, data-kv-rank) says whose key/value block it attended, a hatched `.cl-cp-wait`
// follows it, and above it a `.cl-cp-transfer` arrow (data-bytes) spans from the compute's start to the end of the
// wait: the block sent on to the next cp rank, in flight while this one computes. The header (`.cl-cp-head`) gives
// bytes per rank and the share of time waiting; `.cl-cp-mismatch` says what a record contradicts.

const bytes = (v) => {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let k = 0;
  while (Math.abs(v) >= 1024 && k < units.length - 1) { v /= 1024; k += 1; }
  return k ? `${v.toFixed(2)} ${units[k]}` : `${v} B`;
};
const ms = (v) => `${v.toFixed(v < 10 ? 2 : 1)} ms`;

function placed(cls, start, width, span) {
  const e = h("div", cls);
  e.style.left = `${(100 * start) / span}%`;
  e.style.width = `${(100 * width) / span}%`;
  return e;
}

function lane(l, span) {
  const row = h("div", "cl-cp-lane");
  Object.assign(row.dataset, { rank: l.rank, cpRank: l.cp_rank });
  const waiting = `waiting ${(100 * l.wait_share).toFixed(0)}%`;
  row.appendChild(h("div", "cl-cp-label", `rank ${l.rank} (cp ${l.cp_rank})\n${waiting}`));
  const track = h("div", "cl-cp-track");
  l.boxes.forEach((b) => {
    const compute = placed("cl-cp-compute", b.start_ms, b.compute_ms, span);
    Object.assign(compute.dataset, { ringStep: b.ring_step, kvRank: b.kv_rank });
    compute.textContent = `kv ${b.kv_rank}`;
    compute.title = `ring step ${b.ring_step}: attends the kv block of cp rank ${b.kv_rank}, ${b.chunk_pairs} chunk `
      + `pairs, ${ms(b.compute_ms)} from ${ms(b.start_ms)}`;
    track.appendChild(compute);
    if (b.wait_ms > 0) {
      const wait = placed("cl-cp-wait", b.start_ms + b.compute_ms, b.wait_ms, span);
      wait.title = `ring step ${b.ring_step}: waiting ${ms(b.wait_ms)} for the next block`;
      track.appendChild(wait);
    }
    if (b.sent_bytes) {
      const arrow = placed("cl-cp-transfer", b.start_ms, b.compute_ms + b.wait_ms, span);
      arrow.dataset.bytes = b.sent_bytes;
      arrow.textContent = `→ cp ${b.to_cp_rank}: ${bytes(b.sent_bytes)}`;
      arrow.title = `ring step ${b.ring_step}: kv block of cp rank ${b.kv_rank} sent on to cp rank ${b.to_cp_rank}, `
        + `${bytes(b.sent_bytes)}, posted as the compute began, there by the end of the wait`;
      track.appendChild(arrow);
    }
  });
  row.appendChild(track);
  return row;
}

function render({ model, el }) {
  const root = h("div", "cl-cp");
  el.appendChild(root);
  presentMode(model, root);
  function draw() {
    const v = model.get("view");
    root.replaceChildren(stepLayerControls(model, v, "cl-cp"));
    if (v.error) { root.appendChild(h("div", "cl-cp-mismatch", v.error)); return; }
    if (!(v.lanes || []).length) { root.appendChild(h("div", "cl-cp-empty", "no ring-attention records")); return; }
    const [said, wrong] = v.header.split("\nMISMATCH: ");
    root.appendChild(h("div", "cl-cp-head", said));
    if (wrong) root.appendChild(h("div", "cl-cp-mismatch", `MISMATCH: ${wrong}`));
    const others = elsewhere(v, "cl-cp-mismatch cl-cp-elsewhere");
    if (others) root.appendChild(others);
    const span = v.span_ms || 1;
    v.lanes.forEach((l) => root.appendChild(lane(l, span)));
    root.appendChild(h("div", "cl-cp-axis", `0 to ${ms(span)} from the call's start, each rank's own clock`));
    root.appendChild(h("div", "cl-cp-legend", "blue: compute on the kv block of rank n · hatched: waiting for the "
      + "next block · orange arrow: the block sent on to the next cp rank, in flight until the wait ends"));
  }
  model.on("change:view", draw);
  draw();
}

export default { render };
