// The step and layer selectors of a per-step, per-layer view (ExpertRouting, RingTimeline): `.<prefix>-step` and
// `.<prefix>-layer` write the model's `step` / `layer`; Python recomputes `view`. Choices where a record fails its
// check (`view.disagree_at`, [step, layer] pairs) say "(mismatch)".

function choice(cls, values, current, label, write) {
  const select = h("select", cls);
  values.forEach((value) => {
    const option = h("option", "", label(value));
    option.value = String(value);
    option.selected = value === current;
    select.appendChild(option);
  });
  select.onchange = () => write(select.value);
  return select;
}

function stepLayerControls(model, v, prefix) {
  const failing = v.disagree_at || [];
  const row = h("div", `${prefix}-controls`);
  const stepBad = (s) => failing.some(([step]) => step === s);
  const layerBad = (l) => failing.some(([step, layer]) => step === model.get("step") && layer === l);
  const set = (key, value) => { model.set(key, value); model.save_changes(); };
  row.appendChild(h("span", "", "step "));
  row.appendChild(choice(`${prefix}-step`, v.steps || [], model.get("step"),
    (s) => `${s}${stepBad(s) ? " (mismatch)" : ""}`, (s) => set("step", Number(s))));
  row.appendChild(h("span", "", " layer "));
  row.appendChild(choice(`${prefix}-layer`, v.layers || [], model.get("layer"),
    (l) => `${l}${layerBad(l) ? " (mismatch)" : ""}`, (l) => set("layer", l)));
  return row;
}

// "also failing: step 3 blocks.1.mlp, ...": the other choices whose records fail their check, or null.
function elsewhere(v, cls) {
  const others = (v.disagree_at || []).filter(([s, l]) => s !== v.step || l !== v.layer);
  return others.length ? h("div", cls, `also failing: ${others.map(([s, l]) => `step ${s} ${l}`).join(", ")}`) : null;
}
