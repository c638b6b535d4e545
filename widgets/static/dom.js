// The one DOM helper every view's module uses; widgets/_esm.py puts it in front of each.
function h(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
