// The playground: streams generations from /v1/generate with per-token traces, and shows
// each token as a chip coloured by its probability or entropy, its top-k alternatives
// (click one to branch from it), its attention over the earlier tokens, n samples side by
// side, and live numbers from the server; its code mode completes code as you type
// (code.js).

import { Api, ApiError, parseMetrics } from "./api.js";
import { CodePane } from "./code.js";
import { validate } from "./schema.js";

const $ = (id) => document.getElementById(id);
const api = new Api(() => $("api-key").value.trim());

const app = {
  model: null, // {name, maxModelLen, layers, heads}
  limits: null, // /server_info
  history: [], // chat turns before the current run: [{role, content}]
  run: null, // the current run: {messages|prompt, promptIds, promptText, body, columns}
  selected: null, // {column, index}: the token whose attention is shown
  pinned: false, // the popover stays open (a chip was clicked)
  shown: 0, // the latest attention view asked for: an older answer arriving late is dropped
  code: null, // the code pane (code.js)
};

// --- start ---------------------------------------------------------------------------------

const KEY_STORE = "infer.apiKey";

function init() {
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem(KEY_STORE, $("api-key").value.trim());
    connect();
  });
  for (const radio of document.querySelectorAll("input[name=mode]")) {
    radio.addEventListener("change", showMode);
  }
  $("send").addEventListener("click", send);
  $("stop-all").addEventListener("click", stopAll);
  $("clear").addEventListener("click", clear);
  $("copy-curl").addEventListener("click", copyCurl);
  $("prompt-attention").addEventListener("click", () => showPromptAttention());
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send();
  });
  $("colour").addEventListener("change", () => app.run && app.run.columns.forEach(paintColumn));
  $("attn-layer").addEventListener("change", () => showAttention());
  $("attn-head").addEventListener("change", () => showAttention());
  $("schema").addEventListener("input", () => checkSchemaText());
  const popover = $("popover");
  popover.addEventListener("mouseenter", () => clearTimeout(popover.hideTimer));
  popover.addEventListener("mouseleave", () => hidePopoverSoon());
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape") {
      app.pinned = false;
      popover.hidden = true;
    }
  });
  app.code = new CodePane(api);
  showMode();
  connect();
  setInterval(pollStats, 2000);
}

// The model, its shape and the server's limits; retried while the model loads.
async function connect() {
  try {
    const [models, info, limits] = await Promise.all([
      api.get("/v1/models"),
      api.get("/model_info"),
      api.get("/server_info"),
    ]);
    const card = models.data[0];
    app.model = {
      name: card.id,
      maxModelLen: card.max_model_len,
      layers: info.num_hidden_layers,
      heads: info.num_attention_heads,
    };
    app.limits = limits;
    $("model").textContent = `${card.id} · ${card.max_model_len} tokens of context`;
    $("model").className = "";
    $("n").max = limits.max_choices;
    $("max_tokens").max = card.max_model_len;
    $("trace_k").max = limits.max_logprobs;
    fillOptions($("trace_layer"), app.model.layers, Math.floor(app.model.layers / 2), true);
    fillOptions($("attn-layer"), app.model.layers, Math.floor(app.model.layers / 2));
    fillOptions($("attn-head"), app.model.heads, 0);
    status("");
    pollStats();
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) {
      $("model").textContent = "an API key is needed (the field on the left)";
    } else {
      $("model").textContent = `waiting for the server (${error.message})`;
      setTimeout(connect, 1000);
    }
  }
}

function fillOptions(select, count, chosen, withOff = false) {
  select.replaceChildren();
  if (withOff) select.append(new Option("off", ""));
  for (let i = 0; i < count; i++) select.append(new Option(String(i), String(i)));
  select.value = String(chosen);
}

function mode() {
  return document.querySelector("input[name=mode]:checked").value;
}

function showMode() {
  document.body.dataset.mode = mode();
  if (mode() === "code") {
    $("code-editor").focus();
    return;
  }
  const chat = mode() === "chat";
  $("system-row").hidden = !chat;
  $("history").hidden = !chat;
  $("input").placeholder = chat ? "Write a message (Ctrl+Enter sends)" : "A prompt to continue";
}

// A line beside the buttons: what just happened, or (error) what went wrong.
function status(text, kind = "error") {
  $("status").textContent = text;
  $("status").dataset.kind = kind;
}

// --- the server, live -------------------------------------------------------------------------

let lastSample = null;

async function pollStats() {
  if (!app.model) return;
  let values;
  try {
    values = parseMetrics(await api.get("/metrics"));
  } catch {
    return;
  }
  const now = performance.now();
  const tokens = values["infer_generated_tokens_total"];
  let rate = "";
  if (lastSample) {
    const perSecond = ((tokens - lastSample.tokens) * 1000) / (now - lastSample.at);
    rate = ` · ${perSecond.toFixed(1)} tok/s`;
  }
  lastSample = { tokens, at: now };
  const hits = values["infer_prefix_cache_hits_total"];
  const queries = values["infer_prefix_cache_queries_total"];
  const hitRate = queries ? ` · prefix cache ${Math.round((100 * hits) / queries)}%` : "";
  $("server-stats").textContent =
    `running ${values["infer_requests_running"]} · waiting ${values["infer_requests_waiting"]}` +
    ` · KV blocks ${values["infer_kv_blocks_used"]}/${values["infer_kv_blocks_total"]}` +
    rate +
    hitRate;
}

// --- a run: n samples of one prompt ------------------------------------------------------------

function num(id) {
  const text = $(id).value.trim();
  return text === "" ? null : Number(text);
}

function samplingFields() {
  const fields = {
    max_tokens: num("max_tokens"),
    temperature: num("temperature"),
    top_p: num("top_p"),
    top_k: num("top_k"),
    presence_penalty: num("presence_penalty"),
    frequency_penalty: num("frequency_penalty"),
    repetition_penalty: num("repetition_penalty"),
  };
  for (const key of Object.keys(fields)) if (fields[key] === null) delete fields[key];
  const stop = $("stop").value
    .split(",")
    .map((s) => s.replace(/\\n/g, "\n").replace(/\\t/g, "\t"))
    .filter((s) => s.length);
  if (stop.length) fields.stop = stop;
  if ($("schema-enabled").checked) {
    const schema = checkSchemaText();
    if (!schema) throw new Error("the JSON schema is not valid JSON");
    fields.response_format = {
      type: "json_schema",
      json_schema: { name: "playground", schema },
    };
  }
  const k = num("trace_k") || 5;
  const layer = $("trace_layer").value;
  fields.trace = layer === "" ? { top_k: k } : { top_k: k, layer: Number(layer) };
  return fields;
}

function checkSchemaText() {
  try {
    const schema = JSON.parse($("schema").value);
    $("schema-error").textContent = "";
    return schema;
  } catch (error) {
    $("schema-error").textContent = error.message;
    return null;
  }
}

function requestId() {
  const bytes = crypto.getRandomValues(new Uint8Array(12));
  return "pg-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

async function send() {
  if (!app.model) return;
  const text = $("input").value;
  if (!text.trim()) {
    status("write something first");
    return;
  }
  let fields;
  try {
    fields = samplingFields();
  } catch (error) {
    status(error.message);
    return;
  }
  stopAll();
  keepReply();
  status("");
  const chat = mode() === "chat";
  const source = {};
  if (chat) {
    const system = $("system").value.trim();
    const messages = [...app.history, { role: "user", content: text }];
    source.messages = system ? [{ role: "system", content: system }, ...messages] : messages;
  } else {
    source.prompt = text;
  }
  let promptIds;
  let promptText = text;
  try {
    promptIds = (await api.post("/tokenize", source)).tokens;
    if (chat) promptText = (await api.post("/detokenize", { tokens: promptIds })).prompt;
  } catch (error) {
    status(`${error.code}: ${error.message}`);
    return;
  }
  if (chat) {
    app.history.push({ role: "user", content: text });
    renderHistory();
    $("input").value = "";
  }
  const n = Math.max(1, Math.min(num("n") || 1, app.limits.max_choices));
  const seed = num("seed");
  const body = { ...source, ...fields };
  app.run = { source, promptIds, promptText, body, columns: [], pieces: null, kept: 0 };
  app.selected = null;
  $("columns").replaceChildren();
  $("attention").hidden = true;
  $("prompt-attention").disabled = false;
  $("rendered-prompt").textContent = promptText;
  $("prompt-count").textContent = `(${promptIds.length} tokens)`;
  $("raw-request").textContent = JSON.stringify(seed === null ? body : { ...body, seed }, null, 2);
  $("curl").hidden = true;
  for (let i = 0; i < n; i++) {
    const columnBody = { ...body, request_id: requestId() };
    if (seed !== null) columnBody.seed = seed + i;
    const label = n > 1 ? `sample ${i + 1}` + (seed !== null ? ` (seed ${seed + i})` : "") : "";
    startColumn(columnBody, { label, tokens: [], sample: true });
  }
}

// A column: one stream's tokens (after the inherited ones of a branch) and its numbers.
function startColumn(body, { label, tokens, sample, branchOf = null }) {
  const run = app.run;
  const column = {
    index: run.columns.length,
    run,
    body,
    label,
    sample,
    branchOf,
    tokens, // [{id, text, prob, entropy, topk, attn, layer, drafted, inherited, forced}]
    base: tokens.length, // tokens before this stream's first
    status: "running",
    controller: new AbortController(),
    sent: performance.now(),
    first: null,
    last: null,
    resumes: 0,
    usage: null,
    finish: null,
  };
  run.columns.push(column);
  buildColumn(column);
  $("stop-all").disabled = false;
  stream(column);
  return column;
}

async function stream(column) {
  try {
    const end = await api.generate(column.body, {
      signal: column.controller.signal,
      onEvent: (event) => onEvent(column, event),
      onResume: () => {
        column.resumes += 1;
        renderNumbers(column);
      },
    });
    column.status = end.event === "done" ? "done" : "error";
    column.usage = end.data.usage || null;
    column.finish = end.event === "done" ? end.data.finish_reason : end.data.code;
    if (end.event === "error") column.error = end.data.message;
  } catch (error) {
    column.status = "error";
    column.finish = column.controller.signal.aborted ? "stopped" : error.code || "error";
    column.error = column.controller.signal.aborted ? "" : error.message;
  }
  renderNumbers(column);
  checkStructured(column);
  if (app.run && app.run.columns.every((c) => c.status !== "running")) {
    $("stop-all").disabled = true;
  }
}

function onEvent(column, { event, data }) {
  if (event === "token") {
    const now = performance.now();
    if (column.first === null) column.first = now;
    column.last = now;
    const token = { id: data.token_id, text: data.token, count: data.count || 1 };
    column.tokens[column.base + data.i] = token;
    column.generated = data.i + 1;
    addChip(column, column.base + data.i);
    markDivergence();
    renderNumbers(column);
  } else if (event === "trace") {
    const token = column.tokens[column.base + data.i];
    if (!token) return;
    Object.assign(token, {
      prob: data.prob,
      entropy: data.entropy,
      topk: data.topk,
      attn: data.attn,
      layer: column.body.trace.layer,
      drafted: Boolean(data.drafted),
    });
    paintChip(column, column.base + data.i);
    renderNumbers(column);
  }
}

function stopAll() {
  if (!app.run) return;
  for (const column of app.run.columns) {
    if (column.status !== "running") continue;
    column.controller.abort();
    // The stream is resumable: without this the server would keep it for its window.
    api.call("DELETE", `/v1/generate/${column.body.request_id}`).catch(() => {});
  }
}

// In chat mode the kept column's reply joins the conversation before the next message.
function keepReply() {
  const run = app.run;
  if (!run || !run.source.messages || !run.columns.length) return;
  const column = run.columns[run.kept] || run.columns[0];
  const reply = column.tokens.map((t) => t.text).join("");
  if (reply) app.history.push({ role: "assistant", content: reply });
  renderHistory();
}

function clear() {
  stopAll();
  app.history = [];
  app.run = null;
  renderHistory();
  $("columns").replaceChildren();
  $("attention").hidden = true;
  $("prompt-attention").disabled = true;
  $("rendered-prompt").textContent = "";
  $("raw-request").textContent = "";
  $("curl").hidden = true;
  status("");
}

function renderHistory() {
  $("history").replaceChildren(
    ...app.history.map((turn) => {
      const div = document.createElement("div");
      div.className = `turn ${turn.role}`;
      div.textContent = turn.content;
      return div;
    }),
  );
}

// --- columns and chips ------------------------------------------------------------------------

function buildColumn(column) {
  const el = document.createElement("div");
  el.className = "column";
  el.dataset.column = column.index;
  const head = document.createElement("div");
  head.className = "column-head";
  const title = document.createElement("strong");
  title.textContent = column.label || "reply";
  head.append(title);
  if (column.run.source.messages) {
    const keep = document.createElement("button");
    keep.type = "button";
    keep.className = "keep";
    keep.textContent = "keep";
    keep.title = "this reply joins the conversation when you send the next message";
    keep.addEventListener("click", () => {
      column.run.kept = column.index;
      column.run.columns.forEach((c) => c.el.classList.toggle("kept", c === column));
    });
    head.append(keep);
  }
  const numbers = document.createElement("div");
  numbers.className = "numbers";
  const strip = document.createElement("div");
  strip.className = "strip";
  const check = document.createElement("div");
  check.className = "schema-check";
  el.append(head, numbers, strip, check);
  column.el = el;
  column.strip = strip;
  column.numbers = numbers;
  column.check = check;
  if (column.index === column.run.kept) el.classList.add("kept");
  $("columns").append(el);
  for (let i = 0; i < column.tokens.length; i++) addChip(column, i);
  renderNumbers(column);
}

function shown(text) {
  return text.replace(/\n/g, "↵\n").replace(/\t/g, "→");
}

function addChip(column, index) {
  const token = column.tokens[index];
  const chip = document.createElement("span");
  chip.className = "chip";
  if (token.inherited) chip.classList.add("inherited");
  if (token.forced) chip.classList.add("forced");
  chip.dataset.column = column.index;
  chip.dataset.index = index;
  chip.textContent = token.text === "" ? "·" : shown(token.text);
  chip.addEventListener("mouseenter", () => showPopover(column, index, chip));
  chip.addEventListener("mouseleave", () => hidePopoverSoon());
  chip.addEventListener("click", () => select(column, index, chip));
  const existing = column.strip.children[index];
  if (existing) existing.replaceWith(chip);
  else column.strip.append(chip);
  paintChip(column, index);
}

function chipOf(column, index) {
  return column.strip.children[index];
}

// Probability: red (unlikely) to green (likely). Entropy: green (sure) to red (unsure).
function colour(token) {
  if ($("colour").value === "entropy") {
    if (token.entropy === undefined) return "";
    const unsure = Math.min(1, token.entropy / 4);
    return `hsla(${Math.round(120 * (1 - unsure))}, 70%, 50%, 0.35)`;
  }
  if (token.prob === undefined) return "";
  return `hsla(${Math.round(120 * token.prob)}, 70%, 50%, 0.35)`;
}

function paintChip(column, index) {
  const chip = chipOf(column, index);
  const token = column.tokens[index];
  if (!chip || !token) return;
  chip.style.backgroundColor = colour(token);
  chip.classList.toggle("drafted", Boolean(token.drafted));
  const parts = [];
  if (token.prob !== undefined) parts.push(`p = ${token.prob.toFixed(3)}`);
  if (token.entropy !== undefined) parts.push(`entropy ${token.entropy.toFixed(2)} nats`);
  if (token.drafted) parts.push("drafted (speculative decoding), the model agreed");
  chip.dataset.prob = token.prob === undefined ? "" : token.prob;
  chip.title = parts.join(", ");
}

function paintColumn(column) {
  column.tokens.forEach((_, i) => paintChip(column, i));
}

// Speculative decoding: tokens that came from a kept draft, and tokens per model step (each
// step ends with one token the model chose itself, after the draft tokens it kept).
function draftNumbers(column) {
  const own = column.tokens.slice(column.base);
  const drafted = own.filter((t) => t && t.drafted).length;
  if (!drafted) return "";
  const steps = own.filter((t) => t && t.prob !== undefined && !t.drafted).length;
  const perStep = steps ? ` · ${(own.length / steps).toFixed(2)} tokens/step` : "";
  return `drafted ${drafted}${perStep}`;
}

function renderNumbers(column) {
  const parts = [];
  if (column.first !== null) {
    parts.push(`TTFT ${Math.round(column.first - column.sent)} ms`);
    const generated = column.generated || 0;
    if (generated > 1 && column.last > column.first) {
      const rate = ((generated - 1) * 1000) / (column.last - column.first);
      parts.push(`${rate.toFixed(1)} tok/s`);
    }
  }
  if (column.usage) {
    const u = column.usage;
    const cached = (u.prompt_tokens_details || {}).cached_tokens || 0;
    parts.push(`prompt ${u.prompt_tokens} (cached ${cached})`, `generated ${u.completion_tokens}`);
  }
  const drafts = draftNumbers(column);
  if (drafts) parts.push(drafts);
  if (column.resumes) parts.push(`resumed ×${column.resumes}`);
  if (column.status === "running") parts.push("streaming…");
  else if (column.finish) parts.push(`finish: ${column.finish}`);
  if (column.error) parts.push(column.error);
  column.numbers.textContent = parts.join(" · ");
  column.el.dataset.status = column.status;
}

// n > 1: mark the first position where the samples' tokens differ.
function markDivergence() {
  const samples = app.run.columns.filter((c) => c.sample);
  if (samples.length < 2) return;
  let at = 0;
  for (;; at++) {
    const ids = samples.map((c) => (c.tokens[at] ? c.tokens[at].id : undefined));
    if (ids.some((id) => id === undefined)) {
      if (samples.some((c) => c.status === "running")) return; // not known yet
      break;
    }
    if (ids.some((id) => id !== ids[0])) break;
  }
  for (const c of samples) {
    for (const chip of c.strip.querySelectorAll(".diverge")) chip.classList.remove("diverge");
    const chip = chipOf(c, at);
    if (chip) chip.classList.add("diverge");
  }
}

// --- alternatives and branches ----------------------------------------------------------------

function showPopover(column, index, chip) {
  if (app.pinned) return;
  fillPopover(column, index, chip);
}

function fillPopover(column, index, chip) {
  const token = column.tokens[index];
  const popover = $("popover");
  clearTimeout(popover.hideTimer);
  popover.replaceChildren();
  const head = document.createElement("div");
  head.className = "popover-head";
  head.textContent =
    token.topk === undefined
      ? "no trace for this token"
      : `p = ${token.prob.toFixed(3)} · entropy ${token.entropy.toFixed(2)} nats` +
        (token.forced ? " · chosen by you" : "");
  popover.append(head);
  for (const alt of token.topk || []) {
    const row = document.createElement("button");
    row.type = "button";
    row.className = "alt";
    if (alt.token_id === token.id) row.classList.add("chosen");
    row.dataset.tokenId = alt.token_id;
    const text = document.createElement("span");
    text.className = "alt-text";
    text.textContent = JSON.stringify(alt.token);
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = `${Math.max(1, Math.round(alt.prob * 100))}px`;
    const p = document.createElement("span");
    p.className = "alt-prob";
    p.textContent = alt.prob.toFixed(3);
    row.append(text, bar, p);
    row.title = alt.token_id === token.id ? "the token generated here" : "branch from this token";
    row.addEventListener("click", () => branch(column, index, alt));
    popover.append(row);
  }
  const box = chip.getBoundingClientRect();
  popover.style.left = `${Math.round(window.scrollX + box.left)}px`;
  popover.style.top = `${Math.round(window.scrollY + box.bottom + 4)}px`;
  popover.hidden = false;
}

function hidePopoverSoon() {
  const popover = $("popover");
  clearTimeout(popover.hideTimer);
  if (app.pinned) return;
  popover.hideTimer = setTimeout(() => (popover.hidden = true), 300);
}

function select(column, index, chip) {
  for (const el of document.querySelectorAll(".chip.selected")) el.classList.remove("selected");
  chip.classList.add("selected");
  app.selected = { column, index };
  app.pinned = false;
  fillPopover(column, index, chip);
  app.pinned = true;
  showAttention();
}

// Generation continues from `alt` in place of token `index`: a new column whose prompt is
// the run's prompt, the tokens before `index`, and `alt` (the prefix cache holds most of it).
function branch(column, index, alt) {
  if (column.tokens.slice(0, index).some((t) => t.count > 1)) {
    status("cannot branch after tokens that arrived merged (their ids are not known)");
    return;
  }
  const source = column.tokens[index];
  const tokens = column.tokens.slice(0, index).map((t) => ({ ...t, inherited: true }));
  tokens.push({
    id: alt.token_id,
    text: alt.token,
    prob: alt.prob,
    entropy: source.entropy,
    topk: source.topk,
    attn: source.attn,
    layer: source.layer,
    inherited: true,
    forced: true,
    count: 1,
  });
  const run = app.run;
  const prompt = [...run.promptIds, ...tokens.map((t) => t.id)];
  const { messages, prompt: _text, ...fields } = run.body;
  const body = { ...fields, prompt, request_id: requestId() };
  if (column.body.seed !== undefined) body.seed = column.body.seed;
  if (body.max_tokens) body.max_tokens = Math.max(1, body.max_tokens - tokens.length);
  app.pinned = false;
  $("popover").hidden = true;
  const label = `branch of ${column.label || "reply"} at token ${index + 1}`;
  startColumn(body, { label, tokens, sample: false, branchOf: { column: column.index, index } });
}

// --- structured output --------------------------------------------------------------------------

function checkStructured(column) {
  const format = column.body.response_format;
  if (!format || column.status !== "done") return;
  const text = column.tokens.map((t) => t.text).join("");
  let problems;
  try {
    problems = validate(JSON.parse(text), format.json_schema.schema);
  } catch (error) {
    problems = [`not JSON: ${error.message}`];
  }
  column.check.textContent = problems.length
    ? `✗ does not match the schema: ${problems.join("; ")}`
    : "✓ valid JSON that matches the schema";
  column.check.dataset.valid = problems.length ? "false" : "true";
}

// --- attention --------------------------------------------------------------------------------

// The selected token's attention row at the chosen layer and head: from its trace when the
// trace carried that layer, else from /v1/inspect/attention over the tokens before it.
async function showAttention() {
  const selected = app.selected;
  if (!selected) return;
  const ticket = ++app.shown;
  const { column, index } = selected;
  const token = column.tokens[index];
  const layer = Number($("attn-layer").value);
  const head = Number($("attn-head").value);
  const section = $("attention");
  section.hidden = false;
  $("matrix").hidden = true;
  $("matrix-label").textContent = "";
  $("attention-title").textContent =
    `of token ${index + 1} ${JSON.stringify(token.text)} (${column.label || "reply"})`;
  const ids = [...column.run.promptIds, ...column.tokens.slice(0, index).map((t) => t.id)];
  let row;
  let pieces;
  let source;
  try {
    if (token.attn && token.layer === layer) {
      row = token.attn[head];
      pieces = await piecesOf(column, index);
      source = "from the stream's trace";
    } else {
      const answer = await api.post("/v1/inspect/attention", { prompt: ids, layer, head });
      row = answer.attn[answer.attn.length - 1];
      pieces = answer.tokens;
      source = "from /v1/inspect/attention";
    }
  } catch (error) {
    if (ticket !== app.shown) return;
    $("heat").replaceChildren();
    $("attention-source").textContent = `${error.code || "error"}: ${error.message}`;
    return;
  }
  if (ticket !== app.shown) return;
  $("attention-source").textContent = source;
  drawHeat(row, pieces);
}

// The text of each key position: the prompt's pieces (asked once per run) and the tokens.
async function piecesOf(column, index) {
  const run = column.run;
  if (!run.pieces) {
    const ids = run.promptIds;
    if (ids.length <= app.limits.max_inspect_tokens) {
      const answer = await api.post("/v1/inspect/attention", { prompt: ids, layer: 0, head: 0 });
      run.pieces = answer.tokens;
    } else {
      run.pieces = ids.map((id) => `#${id}`);
    }
  }
  return [...run.pieces, ...column.tokens.slice(0, index).map((t) => t.text)];
}

function drawHeat(row, pieces) {
  const heat = $("heat");
  heat.replaceChildren();
  const top = Math.max(...row);
  row.forEach((weight, i) => {
    const key = document.createElement("span");
    key.className = "key";
    key.textContent = shown(pieces[i] === undefined ? "?" : pieces[i]) || "·";
    // The square root keeps small weights visible beside an attention sink.
    key.style.backgroundColor = `rgba(220, 60, 30, ${top > 0 ? Math.sqrt(weight / top) : 0})`;
    key.title = `position ${i}: ${weight.toFixed(4)}`;
    key.dataset.weight = weight;
    heat.append(key);
  });
}

// The whole prompt's attention matrix at the chosen layer and head.
async function showPromptAttention() {
  const run = app.run;
  if (!run) return;
  const ticket = ++app.shown;
  const layer = Number($("attn-layer").value);
  const head = Number($("attn-head").value);
  $("attention").hidden = false;
  $("heat").replaceChildren();
  $("attention-title").textContent = "of the prompt";
  let answer;
  try {
    answer = await api.post("/v1/inspect/attention", { prompt: run.promptIds, layer, head });
  } catch (error) {
    if (ticket === app.shown) {
      $("attention-source").textContent = `${error.code || "error"}: ${error.message}`;
    }
    return;
  }
  if (ticket !== app.shown) return;
  $("attention-source").textContent = "from /v1/inspect/attention";
  const n = answer.tokens.length;
  const cell = Math.max(2, Math.min(28, Math.floor(560 / n)));
  const canvas = $("matrix");
  canvas.width = canvas.height = n * cell;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  answer.attn.forEach((row, i) => {
    const top = Math.max(...row) || 1;
    row.forEach((weight, j) => {
      ctx.fillStyle = `rgba(220, 60, 30, ${Math.sqrt(weight / top)})`;
      ctx.fillRect(j * cell, i * cell, cell, cell);
    });
  });
  canvas.hidden = false;
  canvas.onmousemove = (e) => {
    const i = Math.floor(e.offsetY / cell);
    const j = Math.floor(e.offsetX / cell);
    if (i < n && j < n) {
      const weight = answer.attn[i][j];
      $("matrix-label").textContent =
        `${JSON.stringify(answer.tokens[i])} → ${JSON.stringify(answer.tokens[j])}: ` +
        weight.toFixed(4);
    }
  };
  $("matrix-label").textContent = `${n} × ${n}, layer ${layer}, head ${head} (rows: queries)`;
}

// --- the request as curl ---------------------------------------------------------------------

function copyCurl() {
  const text = $("raw-request").textContent;
  if (!text) return;
  const key = $("api-key").value.trim() ? ` \\\n  -H "Authorization: Bearer $INFER_API_KEY"` : "";
  const quoted = "'" + text.replace(/'/g, "'\\''") + "'";
  const curl =
    `curl -N ${location.origin}/v1/generate \\\n  -H "Content-Type: application/json"` +
    `${key} \\\n  -d ${quoted}`;
  $("curl").textContent = curl;
  $("curl").hidden = false;
  if (navigator.clipboard) {
    navigator.clipboard.writeText(curl).then(
      () => status("copied as curl", "note"),
      () => status("the browser refused the clipboard: the command is shown below the request"),
    );
  }
}

// For the browser's console (and the tests): the current run's token ids and text.
window.__playground = {
  columnIds: () => (app.run ? app.run.columns.map((c) => c.tokens.map((t) => t.id)) : []),
  columnText: (i) => app.run.columns[i].tokens.map((t) => t.text).join(""),
  idsBefore: (i, index) => {
    const column = app.run.columns[i];
    return [...app.run.promptIds, ...column.tokens.slice(0, index).map((t) => t.id)];
  },
};

init();
