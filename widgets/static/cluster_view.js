// ClusterView: one `.cl-rank` card per rank (data-state), grouped in `.cl-host` boxes.
// Reads `ranks` and `summary`; redraws on change (update() on the Python side).

const STALE_S = 5;  // a busy rank silent this long is marked stale (red), as in TrainingDashboard

function card(r) {
  const c = h("div", "cl-rank");
  c.dataset.rank = r.rank;
  c.dataset.state = r.state;
  c.title = r.detail || r.state;
  c.appendChild(h("div", "cl-rank-id", `rank ${r.rank}`));
  c.appendChild(h("div", "cl-rank-state", r.state));
  c.appendChild(h("div", "cl-rank-device", `${r.device} · ${r.backend}`));
  c.appendChild(h("div", "cl-rank-pid", `pid ${r.pid} · ${r.threads} threads`));
  if (r.rss_bytes !== null && r.rss_bytes !== undefined)
    c.appendChild(h("div", "cl-rank-memory", `${(r.rss_bytes / 2 ** 20).toFixed(0)} MiB resident`));
  if (r.last_heard_s !== null && r.last_heard_s !== undefined) {
    const heard = h("div", "cl-rank-heard", `heard ${r.last_heard_s.toFixed(1)} s ago`);
    c.dataset.stale = String(r.state === "busy" && r.last_heard_s > STALE_S);
    c.appendChild(heard);
  }
  if (r.detail) c.appendChild(h("div", "cl-rank-detail", r.detail));
  return c;
}

function render({ model, el }) {
  const root = h("div", "cl-cluster");
  el.appendChild(root);
  presentMode(model, root);
  function draw() {
    root.replaceChildren();
    root.appendChild(h("div", "cl-cluster-summary", model.get("summary")));
    const hosts = new Map();
    for (const r of model.get("ranks")) {
      if (!hosts.has(r.host)) hosts.set(r.host, []);
      hosts.get(r.host).push(r);
    }
    for (const [host, ranks] of hosts) {
      const box = h("div", "cl-host");
      box.dataset.host = host;
      box.appendChild(h("div", "cl-host-name", host));
      const grid = h("div", "cl-rank-grid");
      ranks.forEach((r) => grid.appendChild(card(r)));
      box.appendChild(grid);
      root.appendChild(box);
    }
  }
  model.on("change:ranks", draw);
  model.on("change:summary", draw);
  draw();
}

export default { render };
