// Box labels that fit (PipelineTimeline, ScheduleGallery): a label is chosen before the box is laid out, from the
// track's width in pixels and the text's width in the box's font, so that none is ever cut.

// Text widths in a font (one canvas, each distinct label measured once).
function textWidths(font) {
  const ctx = document.createElement("canvas").getContext("2d");
  ctx.font = font;
  const seen = new Map();
  return (text) => {
    if (!seen.has(text)) seen.set(text, ctx.measureText(text).width);
    return seen.get(text);
  };
}

// The tracks' width in pixels: the view's width less the lane labels (one layout read per build).
function trackWidth(root) {
  const label = parseFloat(getComputedStyle(root).getPropertyValue("--cl-label")) || 120;
  return Math.max(200, (root.clientWidth || root.parentElement.clientWidth || 800) - label - 8);
}

// What fits a box of `widthMs` (of `fit.span` ms over `fit.px` pixels): the first of `texts` whose width in
// `fit.width` fits inside the 1px borders with a pixel to spare; undefined if none does (the tooltip says it all).
function fitted(texts, widthMs, fit) {
  const px = (widthMs / fit.span) * fit.px - 3;
  return texts.find((text) => fit.width(text) <= px);
}

// A compute box's labels, longest first: "mb 3 · chunk 1", "3·c1", then "c1" (the chunk is what the shade alone
// does not make readable); "mb 3", "3" where the rank holds one chunk.
function boxTexts(mb, chunk, chunks) {
  return chunks > 1 && chunk !== null ? [`mb ${mb} · chunk ${chunk}`, `${mb}·c${chunk}`, `c${chunk}`]
    : [`mb ${mb}`, `${mb}`];
}
