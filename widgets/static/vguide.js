// The V guide of ZBV / DualPipeV (widgets/_vshape.py): a dashed `svg.cl-vguide` joining the first micro-batch's
// forward boxes in stage order, over lanes of equal height (`ranks` in lane order), x in ms of a `span` axis.
function vGuide(g, ranks, span) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "cl-vguide");
  svg.setAttribute("viewBox", `0 0 1000 ${ranks.length}`);
  svg.setAttribute("preserveAspectRatio", "none");
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", g.mid.map((t, i) => `${(1000 * t) / span},${ranks.indexOf(g.rank[i]) + 0.5}`).join(" "));
  line.setAttribute("vector-effect", "non-scaling-stroke");
  const title = document.createElementNS(ns, "title");
  title.textContent = `V shape: one micro-batch's forwards through stages ${g.stage.join(" > ")}, `
    + "down the ranks and back up (rank r holds stages r and 2p-1-r)";
  svg.append(title, line);
  return svg;
}
