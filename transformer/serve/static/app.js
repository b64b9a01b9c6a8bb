"use strict";
// The look-inside page of `transformer serve`: asks its JSON API and draws the answers. Model output and user
// text only ever reach the page as textContent or SVG text nodes, never as HTML.

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg"; // the SVG namespace name, not a resource: nothing is fetched
const KIND_NAMES = {encoder: "Encoder self-attention", decoder: "Decoder self-attention", cross: "Encoder-decoder attention"};
const KIND_HELP = {
  encoder: "Each source piece (row, the query) reads every source piece (columns, the keys).",
  decoder: "Each piece the decoder reads (row) may attend to itself and the pieces before it; grey cells are masked.",
  cross: "Each piece the decoder reads (row) attends to the source pieces (columns): what it looks at to choose the next word.",
};
const state = {info: null, att: null, kind: "cross", layer: 0, head: 0, focus: null, beam: null, step: 1, lines: [],
               text: null, beamSize: null, asked: {}}; // text, beamSize, asked (its language): what the animation animates

async function api(path, body) {
  const options = body === undefined ? {} : {
    method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body),
  };
  const response = await fetch(path, options);
  const data = await response.json().catch(() => ({error: `${response.status} ${response.statusText}`}));
  if (!response.ok) throw new Error(data.error || response.statusText);
  return data;
}

function el(tag, props = {}, children = []) {
  const node = document.createElement(tag);
  Object.assign(node, props);
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// ------------------------------------------------------------------------------------------- colours

function ramp(stops, t) {
  t = Math.max(0, Math.min(1, t)) * (stops.length - 1);
  const i = Math.min(Math.floor(t), stops.length - 2), f = t - i;
  const c = stops[i].map((a, k) => Math.round(a + (stops[i + 1][k] - a) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}
const BLUES = [[255, 255, 255], [222, 235, 247], [158, 202, 225], [66, 146, 198], [8, 81, 156], [8, 38, 94]];
const RDBU = [[5, 48, 97], [67, 147, 195], [209, 229, 240], [247, 247, 247], [253, 219, 199], [214, 96, 77], [103, 0, 31]];
const blue = (w) => ramp(BLUES, w);
const redBlue = (v) => ramp(RDBU, (v + 1) / 2);

const spaced = (pieces) => pieces.join("").replace(/\u2581/g, " "); // SentencePiece marks a word start with U+2581

function sizeCanvas(canvas, width, height) {
  const ratio = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return ctx;
}

// ------------------------------------------------------------------------------------------- header

function describeModel(info) {
  const m = info.model, v = info.validation;
  const parts = [`${info.checkpoint}${info.step != null ? ` · step ${info.step}` : ""}`,
    `${m.n_encoder_layers}+${m.n_decoder_layers} layers, ${m.n_heads} heads, d_model ${m.d_model}`,
    `${info.vocab_size} pieces, ${info.languages.join(" → ")}`,
    `${(m.parameters / 1e6).toFixed(2)} M parameters on ${info.device} (${info.dtype})`];
  // The maps and the beam trace are always our model's; only the translation box may come from CTranslate2.
  if (info.decode.engine === "ctranslate2") parts.push("translations by CTranslate2");
  if (v) {
    const figures = [];
    if (v.bleu != null) figures.push(`BLEU ${v.bleu.toFixed(2)}`);
    if (v.loss != null) figures.push(`loss ${v.loss.toFixed(3)}`);
    if (v.ppl != null) figures.push(`ppl ${v.ppl.toFixed(2)}`);
    if (!figures.length && v.best != null) figures.push(`best ${v.metric} ${v.best.toFixed(3)}`);
    if (figures.length) parts.push(`validation ${figures.join(", ")}`);
  }
  return parts.join("  ·  ");
}

// ------------------------------------------------------------------------------------------- translation

function showTranslation(result, source) {
  const best = result.translations[0];
  showAlignment(source, best);
  // A sentence longer than the model takes was translated from its start only: say so beside the translation.
  $("translation").textContent = (best.text || "(empty)") +
    (best.truncated ? "  (the sentence is longer than this model takes: only its start was translated)" : "");
  $("translation").classList.toggle("muted", !best.text);
  const body = $("nbest-table").querySelector("tbody");
  body.replaceChildren(...best.nbest.map((h, i) => el("tr", {}, [
    el("td", {textContent: String(i + 1)}), el("td", {className: "score", textContent: h.score.toFixed(3)}),
    el("td", {textContent: h.text || "(empty)"})])));
  $("nbest-table").hidden = false;
}

function showAlignment(source, best) {
  // Word alignment (i-j: source word i, output word j), read from the last decoder layer's cross-attention.
  const words = source.trim().split(/\s+/), out = (best.text || "").trim().split(/\s+/);
  const pairs = (best.alignment || []).filter(([i, j]) => i < words.length && j < out.length);
  $("alignment").replaceChildren(...pairs.map(([i, j]) =>
    el("span", {className: "link", textContent: `${words[i]} → ${out[j]}`, title: `${i}-${j}`})));
  $("alignment-card").hidden = !pairs.length;
}

// ------------------------------------------------------------------------------------------- beam search

const lengthPenalty = (tokens, alpha) => Math.pow((5 + tokens + 1) / 6, alpha); // tokens + EOS

function beamPoints(trace) {
  // One point per hypothesis and step, y = summed log-probability, linked to the hypothesis it extends.
  const points = [{step: 0, key: "", y: 0, parent: null, finished: false, pieces: []}];
  let previous = new Map([["", points[0]]]);
  trace.steps.forEach((step, t) => {
    const now = new Map();
    const add = (h, finished) => {
      const y = finished ? h.score * lengthPenalty(h.pieces.length, trace.lenpen) : h.score;
      const parentKey = (finished ? h.pieces : h.pieces.slice(0, -1)).join("\u0000");
      const point = {step: t + 1, y, finished, pieces: h.pieces, text: h.text, score: h.score,
                     parent: previous.get(parentKey) || null};
      points.push(point);
      if (!finished) now.set(h.pieces.join("\u0000"), point);
    };
    step.alive.forEach((h) => add(h, false));
    step.finished.forEach((h) => add(h, true));
    previous = now;
  });
  return points;
}

function drawBeamChart() {
  const box = $("beam-chart"), trace = state.beam;
  const width = Math.max(300, box.clientWidth), height = 150, left = 44, right = 10, top = 8, bottom = 22;
  const points = beamPoints(trace), steps = trace.steps.length;
  const low = Math.min(-1, ...points.map((p) => p.y));
  const x = (s) => left + (s / Math.max(1, steps)) * (width - left - right);
  const y = (v) => top + (v / low) * (height - top - bottom);
  const chart = svg("svg", {width, height});
  for (const v of [0, low / 2, low]) {
    chart.append(svg("line", {x1: left, x2: width - right, y1: y(v), y2: y(v), stroke: "#e4e8ee"}));
    chart.append(svg("text", {x: left - 6, y: y(v) + 4, "text-anchor": "end", "font-size": 10, fill: "#5f6b7a"}, v.toFixed(1)));
  }
  chart.append(svg("text", {x: left, y: height - 6, "font-size": 10, fill: "#5f6b7a"},
    "decoder step →   (y: summed log-probability; green: finished; thick: the best translation's path)"));
  chart.append(svg("rect", {x: x(state.step) - 6, y: top - 4, width: 12, height: height - top - bottom + 8,
                            fill: "#e3edf8", rx: 3}));
  const finished = points.filter((p) => p.finished);
  const winner = finished.length ? finished.reduce((a, b) => (b.score > a.score ? b : a)) : null;
  const path = new Set();
  for (let p = winner; p; p = p.parent) path.add(p); // the best translation's way through the search
  for (const p of points) {
    if (p.parent) chart.append(svg("line", {x1: x(p.parent.step), y1: y(p.parent.y), x2: x(p.step), y2: y(p.y),
      stroke: path.has(p) ? "#237a46" : p.finished ? "#8cc7a0" : "#b5c6da", "stroke-width": path.has(p) ? 2.5 : 1}));
  }
  for (const p of points.slice(1)) {
    const dot = svg("circle", {cx: x(p.step), cy: y(p.y), r: p.finished ? 4.5 : 3,
      fill: p.finished ? "#237a46" : "#1f5fa8", "fill-opacity": p.step === state.step ? 1 : 0.55});
    dot.append(svg("title", {}, `step ${p.step}: ${p.text || "(empty)"}  ${p.score.toFixed(3)}${p.finished ? " (finished)" : ""}`));
    dot.addEventListener("click", () => setStep(p.step));
    chart.append(dot);
  }
  box.replaceChildren(chart);
}

function hypothesisItem(h, best, finished) {
  const share = Math.exp(h.score - best); // probability relative to the step's best hypothesis
  const text = el("span", {className: "text"});
  if (finished) {
    text.append(`${h.text || "(empty)"} ⏎`);
  } else { // the piece this step added in bold
    const full = spaced(h.pieces), last = spaced(h.pieces.slice(-1)), head = full.slice(0, full.length - last.length).trimStart();
    text.append(head, el("b", {textContent: head ? last : last.trimStart()}));
  }
  const bar = el("span", {className: "bar"}, [el("i")]);
  bar.firstChild.style.width = `${Math.round(100 * Math.min(1, share))}%`;
  return el("li", {className: finished ? "finished" : ""},
    [bar, text, el("span", {className: "score", textContent: h.score.toFixed(3)})]);
}

function setStep(step) {
  const trace = state.beam, n = trace.steps.length;
  state.step = Math.max(1, Math.min(n, step));
  $("step").value = state.step;
  const current = trace.steps[state.step - 1];
  $("step-label").textContent = `step ${state.step} of ${n} · beam ${trace.beam} · stop ${trace.stop}`;
  const items = [];
  if (current.alive.length) {
    items.push(el("li", {className: "heading", textContent: "alive after this step (summed log-probability)"}));
    current.alive.forEach((h) => items.push(hypothesisItem(h, current.alive[0].score, false)));
  }
  if (current.finished.length) {
    items.push(el("li", {className: "heading", textContent: "finished at this step (normalised score)"}));
    const best = Math.max(...current.finished.map((h) => h.score));
    current.finished.forEach((h) => items.push(hypothesisItem(h, best, true)));
  }
  $("beam-step").replaceChildren(...items);
  drawBeamChart();
}

function showBeam(trace) {
  state.beam = trace;
  $("step").max = trace.steps.length;
  setStep(1);
}

// ------------------------------------------------------------------------------------------- attention

function pieces(kind) {
  const a = state.att, spec = a.attention[kind];
  return {rows: a[`${spec.queries}_pieces`], cols: a[`${spec.keys}_pieces`], spec};
}

function matrix(kind, layer, head) { return state.att.attention[kind].weights[layer][head]; }

function showAttention(att) {
  state.att = att;
  const spec = att.attention[state.kind];
  state.layer = Math.min(state.layer, spec.layers - 1);
  state.head = Math.min(state.head, spec.heads - 1);
  $("kinds").replaceChildren(...Object.keys(att.attention).map((kind) => {
    const button = el("button", {type: "button", textContent: KIND_NAMES[kind] || kind, className: kind === state.kind ? "on" : ""});
    button.addEventListener("click", () => { state.kind = kind; showAttention(state.att); });
    return button;
  }));
  $("attention-help").textContent = KIND_HELP[state.kind] + (att.translated ? " The decoder reads the model's own translation." : "");
  drawGrid();
  drawBig();
}

function drawThumb(canvas, w, size, masked) {
  const ctx = sizeCanvas(canvas, size, size), rows = w.length, cols = w[0].length;
  const cw = size / cols, ch = size / rows;
  for (let i = 0; i < rows; i++) {
    for (let j = 0; j < cols; j++) {
      ctx.fillStyle = masked && j > i ? "#eceff3" : blue(w[i][j]);
      ctx.fillRect(j * cw, i * ch, Math.ceil(cw), Math.ceil(ch));
    }
  }
}

function drawGrid() {
  const spec = state.att.attention[state.kind], grid = $("grid");
  const size = Math.max(40, Math.min(72, Math.floor(440 / spec.heads) - 6));
  grid.style.gridTemplateColumns = `auto repeat(${spec.heads}, ${size + 4}px)`;
  const cells = [el("span")];
  for (let h = 0; h < spec.heads; h++) cells.push(el("span", {textContent: `head ${h + 1}`}));
  for (let l = 0; l < spec.layers; l++) {
    cells.push(el("span", {textContent: `layer ${l + 1}`}));
    for (let h = 0; h < spec.heads; h++) {
      const canvas = el("canvas", {title: `layer ${l + 1}, head ${h + 1}`});
      canvas.dataset.layer = l;
      canvas.dataset.head = h;
      if (l === state.layer && h === state.head) canvas.classList.add("on");
      drawThumb(canvas, matrix(state.kind, l, h), size, state.kind === "decoder");
      canvas.addEventListener("click", () => { state.layer = l; state.head = h; state.focus = null; drawGrid(); drawBig(); });
      cells.push(canvas);
    }
  }
  grid.replaceChildren(...cells);
}

function textWidth(ctx, labels) { return Math.max(0, ...labels.map((s) => ctx.measureText(s).width)); }

const cellSize = (rows, cols) => Math.max(12, Math.min(26, Math.floor(420 / Math.max(rows.length, cols.length))));

function drawHeatmap() {
  const {rows, cols} = pieces(state.kind), w = matrix(state.kind, state.layer, state.head);
  const canvas = $("heatmap"), probe = canvas.getContext("2d");
  probe.font = "12px 'DejaVu Sans', sans-serif";
  const cell = cellSize(rows, cols);
  const slant = textWidth(probe, cols) * Math.SQRT1_2; // column labels run up and right at 45 degrees
  const left = textWidth(probe, rows) + 10, top = slant + 16;
  const ctx = sizeCanvas(canvas, left + cols.length * cell + slant, top + rows.length * cell + 4);
  ctx.font = "12px 'DejaVu Sans', sans-serif";
  const focus = state.focus;
  for (let i = 0; i < rows.length; i++) {
    for (let j = 0; j < cols.length; j++) {
      const masked = state.kind === "decoder" && j > i;
      ctx.fillStyle = masked ? "#eceff3" : blue(w[i][j]);
      ctx.fillRect(left + j * cell, top + i * cell, cell - 1, cell - 1);
    }
    ctx.fillStyle = focus && focus.query === i ? "#1f5fa8" : "#1d2733";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    ctx.fillText(rows[i], left - 6, top + i * cell + cell / 2);
  }
  cols.forEach((label, j) => {
    ctx.save();
    ctx.translate(left + j * cell + cell / 2, top - 6);
    ctx.rotate(-Math.PI / 4);
    ctx.textAlign = "left";
    ctx.fillStyle = focus && focus.key === j ? "#1f5fa8" : "#1d2733";
    ctx.fillText(label, 0, 0);
    ctx.restore();
  });
  if (focus && focus.query != null) {
    ctx.strokeStyle = "#e8710a";
    ctx.lineWidth = 2;
    ctx.strokeRect(left - 1, top + focus.query * cell - 1, cols.length * cell + 1, cell + 1);
  }
  if (focus && focus.key != null) {
    ctx.strokeStyle = "#e8710a";
    ctx.lineWidth = 2;
    ctx.strokeRect(left + focus.key * cell - 1, top - 1, cell + 1, rows.length * cell + 1);
  }
  canvas.onmousemove = (event) => {
    const box = canvas.getBoundingClientRect();
    const i = Math.floor((event.clientY - box.top - top) / cell), j = Math.floor((event.clientX - box.left - left) / cell);
    const query = i >= 0 && i < rows.length ? i : null;
    const key = j >= 0 && j < cols.length && query != null ? j : null;
    const next = query == null ? null : {query, key};
    if (JSON.stringify(next) !== JSON.stringify(state.focus)) setFocus(next);
  };
  canvas.onmouseleave = () => setFocus(null);
  canvas.title = "";
  if (focus && focus.query != null && focus.key != null) {
    canvas.title = `${rows[focus.query]} → ${cols[focus.key]}: ${w[focus.query][focus.key].toFixed(3)}`;
  }
}

function drawLines() {
  const {rows, cols, spec} = pieces(state.kind), w = matrix(state.kind, state.layer, state.head);
  const box = $("lines"), rowH = Math.max(15, cellSize(rows, cols)), gap = 150, top = 24;
  const probe = $("heatmap").getContext("2d");
  probe.font = "12px 'DejaVu Sans', sans-serif";
  const captions = [`${spec.queries} (query)`, `${spec.keys} (key)`];
  const leftW = Math.max(textWidth(probe, rows), textWidth(probe, captions.slice(0, 1))) + 12;
  const rightW = Math.max(textWidth(probe, cols), textWidth(probe, captions.slice(1))) + 12;
  const longest = Math.max(rows.length, cols.length), width = leftW + gap + rightW, height = top + longest * rowH + 4;
  box.setAttribute("width", width);
  box.setAttribute("height", height);
  const nodes = [svg("text", {x: leftW - 8, y: 12, "text-anchor": "end", class: "caption"}, captions[0]),
                 svg("text", {x: leftW + gap + 8, y: 12, class: "caption"}, captions[1])];
  state.lines = [];
  // The shorter column is centred against the longer one.
  const yq = (i) => top + (longest - rows.length) * rowH / 2 + i * rowH + rowH / 2;
  const yk = (j) => top + (longest - cols.length) * rowH / 2 + j * rowH + rowH / 2;
  for (let i = 0; i < rows.length; i++) {
    for (let j = 0; j < cols.length; j++) {
      if (w[i][j] < 0.02) continue; // invisible anyway: fewer nodes to draw
      const line = svg("line", {x1: leftW, y1: yq(i), x2: leftW + gap, y2: yk(j), stroke: "#1f5fa8",
                                "stroke-width": (0.5 + 3.5 * w[i][j]).toFixed(2), "stroke-linecap": "round"});
      line.dataset.query = i;
      line.dataset.key = j;
      line.dataset.weight = w[i][j];
      state.lines.push(line);
      nodes.push(line);
    }
  }
  const label = (text, x, yy, anchor, kind, index) => {
    const node = svg("text", {x, y: yy + 4, "text-anchor": anchor}, text);
    node.dataset[kind] = index;
    node.addEventListener("mouseenter", () => setFocus(kind === "query" ? {query: index, key: null} : {query: null, key: index}));
    node.addEventListener("mouseleave", () => setFocus(null));
    return node;
  };
  rows.forEach((p, i) => nodes.push(label(p, leftW - 8, yq(i), "end", "query", i)));
  cols.forEach((p, j) => nodes.push(label(p, leftW + gap + 8, yk(j), "start", "key", j)));
  box.replaceChildren(...nodes);
  styleLines();
}

function styleLines() {
  const focus = state.focus;
  for (const line of state.lines) {
    const q = +line.dataset.query, k = +line.dataset.key, weight = +line.dataset.weight;
    const hot = focus && ((focus.query != null && q === focus.query) || (focus.query == null && focus.key === k));
    line.setAttribute("stroke", hot ? "#e8710a" : "#1f5fa8");
    line.setAttribute("stroke-opacity", (focus ? (hot ? Math.max(0.25, weight) : 0.04) : 0.15 + 0.85 * weight).toFixed(3));
  }
  for (const node of $("lines").querySelectorAll("text")) {
    const hot = focus && ((node.dataset.query != null && +node.dataset.query === focus.query) ||
                          (node.dataset.key != null && +node.dataset.key === focus.key));
    node.classList.toggle("hot", Boolean(hot));
  }
}

function setFocus(focus) {
  state.focus = focus;
  drawHeatmap();
  styleLines();
}

function drawBig() {
  $("big-title").textContent = `${KIND_NAMES[state.kind]}, layer ${state.layer + 1}, head ${state.head + 1}`;
  drawHeatmap();
  drawLines();
}

// ------------------------------------------------------------------------------------------- positions

async function showPositions() {
  // What the model's kind of position has to show (Positions.view): its tables (one per side for learned
  // positions), or only a note when it adds no table to the embeddings.
  const m = state.info.model, length = Math.min(m.max_positions, 100);
  const data = await api(`/positions?d_model=${m.d_model}&length=${length}`);
  $("positions-title").textContent = data.title;
  $("positions-help").textContent = data.note;
  const canvas = $("positions"), tables = Object.entries(data.tables);
  canvas.hidden = tables.length === 0;
  if (!tables.length) return;
  const width = tables[0][1][0].length, available = Math.max(400, $("positions-card").clientWidth - 140);
  const scale = Math.max(1e-9, ...tables.flatMap(([, t]) => t.flat().map(Math.abs)));
  // A narrow table (rotary's angles: half a head's dimensions) gets wider cells; the canvas leaves room for the label.
  const cw = Math.max(1, Math.min(40, Math.floor(available / width))), ch = Math.max(2, Math.min(4, Math.floor(300 / length)));
  const left = 44, named = tables.length > 1 ? 16 : 0, mapW = cw * width, mapH = ch * length, block = named + mapH + 10;
  const ctx = sizeCanvas(canvas, Math.max(left + mapW + 90, 560), 6 + tables.length * block + 24);
  ctx.font = "11px 'DejaVu Sans', sans-serif";
  tables.forEach(([name, table], k) => {
    const top = 6 + k * block + named;
    table.forEach((row, pos) => row.forEach((v, i) => {
      ctx.fillStyle = redBlue(v / scale);
      ctx.fillRect(left + i * cw, top + pos * ch, cw, ch);
    }));
    ctx.fillStyle = "#5f6b7a";
    ctx.textAlign = "left";
    ctx.textBaseline = "bottom";
    if (named) ctx.fillText(name, left, top - 3);
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let pos = 0; pos < length; pos += length > 50 ? 20 : 10) ctx.fillText(String(pos), left - 6, top + pos * ch + ch / 2);
    ctx.save();
    ctx.translate(12, top + mapH / 2);
    ctx.rotate(-Math.PI / 2);
    ctx.textAlign = "center";
    ctx.fillText("position ↓", 0, 0);
    ctx.restore();
  });
  const top = 6 + named, bottom = 6 + tables.length * block - 10;
  ctx.textAlign = "left";
  ctx.textBaseline = "top";
  ctx.fillText(`${data.columns} →`, left, bottom + 8);
  const barX = left + mapW + 24;
  for (let y = 0; y < mapH; y++) {
    ctx.fillStyle = redBlue(1 - 2 * y / mapH);
    ctx.fillRect(barX, top + y, 14, 1);
  }
  ctx.fillStyle = "#5f6b7a";
  ctx.textBaseline = "middle";
  const label = (v) => String(Number(v.toPrecision(2)));
  [[scale, 0], [0, mapH / 2], [-scale, mapH]].forEach(([v, y]) => ctx.fillText(label(v), barX + 20, top + y));
}

// ------------------------------------------------------------------------------------------- the animation

async function downloadAnimation() {
  // The GIF `transformer animate` writes, for the sentence on screen and its beam; saved as walk.gif.
  const button = $("animate"), link = $("animation-link");
  button.disabled = true;
  button.textContent = "Drawing the animation…";
  showError("");
  try {
    const response = await fetch("/animate", {
      method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({text: state.text, beam: state.beamSize, ...state.asked}),
    });
    if (!response.ok) {
      const data = await response.json().catch(() => ({error: `${response.status} ${response.statusText}`}));
      throw new Error(data.error || response.statusText);
    }
    const blob = await response.blob();
    if (link.href) URL.revokeObjectURL(link.href);
    link.href = URL.createObjectURL(blob);
    link.textContent = `walk.gif (${Math.round(blob.size / 1024)} kB)`;
    link.hidden = false;
    link.click();
  } catch (error) {
    showError(`animation: ${error.message}`);
  } finally {
    button.disabled = false;
    button.textContent = "Download the animation (GIF)";
  }
}

// ------------------------------------------------------------------------------------------- wiring

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

async function translate(text) {
  const beam = Math.max(1, Number($("beam").value) || 1), nbest = Math.max(1, Math.min(beam, Number($("nbest").value) || 1));
  $("nbest").value = nbest;
  showError("");
  if (!text.trim()) { showError("Type a sentence first."); return; }
  $("go").disabled = true;
  document.body.dataset.state = "busy";
  const asked = state.info.target_languages.length > 1 ? {target_lang: $("target-lang").value} : {};
  state.asked = asked;  // the animation of this sentence asks for the same language
  const [tr, att, beams] = await Promise.allSettled([api("/translate", {text: [text], beam, nbest, alignments: true, ...asked}),
    api("/attention", {text, beam, ...asked}), api("/beam", {text, beam, nbest, ...asked})]);
  const errors = [tr, att, beams].filter((r) => r.status === "rejected").map((r) => r.reason.message);
  if (tr.status === "fulfilled") {
    showTranslation(tr.value, text);
    state.text = text;
    state.beamSize = beam;
    $("animate").disabled = false;
    $("animation-link").hidden = true;
  }
  if (beams.status === "fulfilled") showBeam(beams.value);
  if (att.status === "fulfilled") showAttention(att.value);
  showError([...new Set(errors)].join("; "));
  $("go").disabled = false;
  document.body.dataset.state = errors.length ? "error" : "ready";
}

async function start() {
  $("ask").addEventListener("submit", (event) => { event.preventDefault(); translate($("text").value); });
  $("step").addEventListener("input", () => setStep(Number($("step").value)));
  $("animate").addEventListener("click", () => state.text && downloadAnimation());
  $("step-prev").addEventListener("click", () => state.beam && setStep(state.step - 1));
  $("step-next").addEventListener("click", () => state.beam && setStep(state.step + 1));
  try {
    state.info = await api("/info");
  } catch (error) {
    showError(`cannot reach the server: ${error.message}`);
    return;
  }
  $("model-info").textContent = describeModel(state.info);
  $("beam").value = state.info.decode.beam;
  $("beam").max = state.info.limits.max_beam;
  $("nbest").value = Math.min(3, state.info.decode.beam);
  for (const lang of state.info.target_languages) {  // a model of several target languages: which one
    const option = document.createElement("option");
    option.value = option.textContent = lang;
    option.selected = lang === state.info.target_lang;
    $("target-lang").append(option);
  }
  $("target-lang-label").hidden = state.info.target_languages.length < 2;
  document.body.dataset.state = "idle";
  showPositions().catch((error) => showError(error.message));
  const asked = new URLSearchParams(window.location.search).get("text");
  if (asked) {
    $("text").value = asked;
    translate(asked);
  }
}

start();
