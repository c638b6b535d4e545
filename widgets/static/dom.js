// The one DOM helper every view's module uses; widgets/_esm.py puts it in front of each.
function h(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// Present mode (a view's `present` trait): `.cl-present` on the view's root, kept in step with the trait.
function presentMode(model, root) {
  const apply = () => root.classList.toggle("cl-present", !!model.get("present"));
  model.on("change:present", apply);
  apply();
}

// Button icons drawn as SVG: font glyphs such as U+23F8 (pause) are missing from some system fonts.
const ICON_PATHS = { play: "M3 2 L13 8 L3 14 Z", pause: "M3 2 H6 V14 H3 Z M10 2 H13 V14 H10 Z",
  back: "M13 2 L3 8 L13 14 Z", next: "M2 2 L10 8 L2 14 Z M11 2 H14 V14 H11 Z" };

function icon(name) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", "0 0 16 16");
  svg.setAttribute("width", "10");
  svg.setAttribute("height", "10");
  svg.setAttribute("class", "cl-icon");
  svg.dataset.icon = name;
  svg.style.verticalAlign = "-1px";
  const path = document.createElementNS(ns, "path");
  path.setAttribute("d", ICON_PATHS[name]);
  path.setAttribute("fill", "currentColor");
  svg.appendChild(path);
  return svg;
}

// A button's content: an SVG icon, then optional text (accessible name in aria-label when text is empty).
function setButton(button, name, text, label) {
  button.replaceChildren(icon(name), text ? ` ${text}` : "");
  button.setAttribute("aria-label", label || text || name);
  return button;
}
