// The try-it page: upload images, show top classes and the attention overlay, and teach classes by example, all
// from this service's API.
"use strict";

const $ = (id) => document.getElementById(id);
const API_KEY_STORAGE = "vit-api-key";
const DEFAULT_METHODS = ["rollout", "last"];
let methods = DEFAULT_METHODS;
let models = new Map();  // name -> description, from /v1/models
let defaultModel = "";  // the model a request without a name goes to

function apiHeaders() {
  const key = $("api-key").value.trim();
  return key ? { "X-API-Key": key } : {};
}

async function errorText(response) {
  // The API answers errors as {"detail": "..."}; anything else is shown as its status line.
  let detail = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.detail !== undefined) {
      detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    }
  } catch (_) { /* not JSON: keep the status line */ }
  const retry = response.headers.get("Retry-After");
  if (retry) detail += ` (retry after ${retry} s)`;
  return detail;
}

// The served set changes at runtime (models loaded, replaced, unloaded): the listing is read again every
// MODEL_REFRESH_MS, keeping the model chosen while it is still served.
const MODEL_REFRESH_MS = 15000;
let shownModel = "";  // name@version on the page

async function loadModel() {
  const status = $("model-status");
  try {
    const response = await fetch("/v1/models");
    if (response.status === 503) {
      status.textContent = "The model is still loading; retrying…";
      setTimeout(loadModel, 2000);
      return;
    }
    if (!response.ok) throw new Error(await errorText(response));
    const listing = await response.json();
    const select = $("model-select");
    const chosen = models.size > 0 && listing.models.some((m) => m.name === select.value) ? select.value : listing.default;
    models = new Map(listing.models.map((m) => [m.name, m]));
    defaultModel = listing.default || "";
    select.replaceChildren(...listing.models.map((m) => new Option(`${m.name} (${m.version})`, m.name, m.name === chosen, m.name === chosen)));
    $("model-picker").hidden = models.size < 2;
    if (models.size === 0) {
      status.textContent = "No model is loaded; this page shows one as soon as the server loads it.";
    } else if (`${chosen}@${models.get(chosen).version}` !== shownModel) {
      showModel(models.get(chosen));  // redrawn only when it changed: a refresh keeps what the user set
    } else {
      loadHeads(chosen);  // heads taught or deleted elsewhere meanwhile; the one chosen stays chosen
    }
  } catch (e) {
    status.textContent = `Could not read the model description: ${e.message}`;
  }
  setTimeout(loadModel, MODEL_REFRESH_MS);
}

function chosenModel() {
  return models.size > 1 ? $("model-select").value : null;
}

function showModel(info) {
  shownModel = `${info.name}@${info.version}`;
  $("model-name").textContent = info.name;
  $("model-version").textContent = info.version;
  const channels = info.channels === 1 ? "grayscale" : "RGB";
  $("model-input").textContent = `${info.input_size[0]} × ${info.input_size[1]} px, ${channels}`;
  const zeroShot = Boolean(info.zero_shot);
  const rule = zeroShot && info.zero_shot.rule === "softmax" ? "one softmax over them" : "each scored alone";
  const named = `${info.classes.length}: ${info.classes.slice(0, 10).join(", ")}${info.classes.length > 10 ? ", …" : ""}`;
  $("model-class-count").textContent = zeroShot ? `named with each request (zero-shot, ${rule})` : named;
  const list = $("model-classes");
  list.replaceChildren(...info.classes.map((c) => Object.assign(document.createElement("li"), { textContent: c })));
  // A zero-shot model (CLIP, SigLIP) takes its classes from the labels box, filled with its own labels if it has some.
  $("labels-row").hidden = !zeroShot;
  if (zeroShot) $("labels").value = info.classes.join(", ");
  $("top-k").max = String(zeroShot ? 1000 : Math.min(info.classes.length, 1000));
  $("top-k").value = String(zeroShot ? 5 : Math.min(5, info.classes.length));
  $("model-status").textContent = "";
  loadHeads(info.name);
  $("model-info").hidden = false;
  $("model-classes-details").hidden = false;
}

async function loadMethods() {
  // The attention kinds the API offers, from its own OpenAPI schema, so new kinds appear here by themselves.
  try {
    const schema = await (await fetch("/openapi.json")).json();
    const params = schema.paths["/predict"].post.parameters || [];
    const attention = params.find((p) => p.name === "attention");
    const kinds = (attention && attention.schema && attention.schema.enum) || [];
    const offered = kinds.filter((k) => k !== "none");
    if (offered.length) methods = offered;
  } catch (_) { /* keep the defaults */ }
  fillMethods($("method"), methods[0]);
}

function fillMethods(select, selected) {
  select.replaceChildren(...methods.map((m) => new Option(m, m, m === selected, m === selected)));
}

function addResultItem(file, before) {
  const item = $("result-template").content.firstElementChild.cloneNode(true);
  item.querySelector(".filename").textContent = file.name || "pasted image";
  const thumb = item.querySelector(".thumbnail");
  thumb.addEventListener("error", () => { item.querySelector(".thumb").hidden = true; });  // not an image
  thumb.src = URL.createObjectURL(file);
  thumb.alt = `Uploaded image ${file.name || ""}`.trim();
  $("results").insertBefore(item, before);  // a batch keeps its order; the newest batch comes first
  $("results-empty").hidden = true;
  return item;
}

async function classify(file, before) {
  const item = addResultItem(file, before);
  const model = chosenModel();  // a result stays with the model it was sent to, and with the labels it was given
  if (model) item.querySelector(".filename").textContent += ` · ${model}`;
  const head = $("head-select").value || null;  // a head taught by example answers with its classes
  if (head) item.querySelector(".filename").textContent += ` · head ${head}`;
  const labels = head || $("labels-row").hidden ? null : $("labels").value;
  const cache = new Map();
  const select = item.querySelector(".result-method");
  fillMethods(select, $("method").value);
  select.addEventListener("change", () => request(file, item, select.value, cache, model, labels, head));
  await request(file, item, select.value, cache, model, labels, head);
}

async function request(file, item, method, cache, model, labels, head) {
  const status = item.querySelector(".status");
  const error = item.querySelector(".error");
  status.hidden = false;
  status.textContent = `Classifying (${method} map)…`;
  error.hidden = true;
  try {
    let data = cache.get(method);
    if (!data) {
      const body = new FormData();
      body.append("file", file, file.name || "pasted.png");
      const query = new URLSearchParams({ top_k: $("top-k").value || "5", attention: method, overlay: "true" });
      if (model) query.set("model", model);
      if (labels !== null && labels.trim()) query.set("labels", labels);  // none: the model's own, or its 422 says why
      if (head) query.set("head", head);
      const described = models.get(model || defaultModel);
      // a model with reference statistics scores it (for its own classes: a head's have none)
      if (described && described.reference && !head) query.set("ood", "true");
      const response = await fetch(`/predict?${query}`, { method: "POST", body, headers: apiHeaders() });
      if (response.status === 401) showApiKeyField();
      if (!response.ok) throw new Error(await errorText(response));
      data = await response.json();
      cache.set(method, data);
    }
    showResult(item, data.results[0], method, file.name || "the pasted image", models.get(data.model.name));
    status.hidden = true;
  } catch (e) {
    status.hidden = true;
    error.textContent = e instanceof TypeError ? `Could not reach the service: ${e.message}` : e.message;
    error.hidden = false;
  }
}

// Whether an image looks like what the model knows, in plain words: by the service's flag where VIT_OOD_THRESHOLD
// sets one, else against the score 99 in 100 of the model's own held-out images stay under (its ood_p99).
function verdict(result, described) {
  if (result.ood_score === undefined) return null;
  const shown = (v) => (v >= 10 ? v.toFixed(1) : v.toPrecision(2));  // 28.8, 7.9, 0.087: distances and 1 - a probability
  const score = shown(result.ood_score);
  const limit = described && described.ood_p99 != null ? described.ood_p99 : null;
  let unlike, why;
  if (result.ood !== undefined) {
    [unlike, why] = [result.ood, `score ${score}, judged by this service's threshold`];
  } else if (limit !== null) {
    [unlike, why] = [result.ood_score > limit, `score ${score}; 99 in 100 of its own images score at most ${shown(limit)}`];
  } else {
    return { text: `Out-of-distribution score ${score} (higher: further from the model's own images).`, unlike: false };
  }
  if (unlike) return { text: `Unlike the images this model knows (${why}): its classes may mean little here.`, unlike: true };
  return { text: `Looks like the images this model knows (${why}).`, unlike: false };
}

function showResult(item, result, method, name, described) {
  const said = verdict(result, described);
  const line = item.querySelector(".verdict");
  line.hidden = said === null;
  if (said) {
    line.textContent = said.text;
    line.classList.toggle("unlike", said.unlike);
  }
  const list = item.querySelector(".top-k");
  list.replaceChildren(...result.top_k.map((entry) => {
    const li = document.createElement("li");
    const pct = `${(entry.probability * 100).toFixed(1)} %`;
    const label = Object.assign(document.createElement("span"), { className: "label", textContent: entry.label });
    const bar = Object.assign(document.createElement("progress"), { max: 1, value: entry.probability });
    bar.setAttribute("aria-label", `${entry.label}: ${pct}`);
    const value = Object.assign(document.createElement("span"), { className: "pct", textContent: pct });
    li.append(label, bar, value);
    return li;
  }));
  list.hidden = false;
  item.querySelector(".map-choice").hidden = false;
  const figure = item.querySelector(".overlay-figure");
  if (result.attention && result.overlay_png) {
    const [rows, cols] = result.attention.grid;
    const overlay = item.querySelector(".overlay");
    overlay.src = `data:image/png;base64,${result.overlay_png}`;
    overlay.alt = `Attention map (${method}) over ${name}, ${rows} × ${cols} patch grid`;
    item.querySelector(".overlay-caption").textContent = `${method} map · ${rows} × ${cols} grid`;
    figure.hidden = false;
  } else {
    figure.hidden = true;
  }
}

// Heads taught by example on the model shown: listed in the Classes choice, the one just taught chosen.
async function loadHeads(name, chosen) {
  const select = $("head-select");
  const keep = chosen !== undefined ? chosen : select.value;
  let heads = [];
  try {
    const response = await fetch(`/v1/models/${encodeURIComponent(name)}/heads`);
    if (response.ok) heads = (await response.json()).heads;
  } catch (_) { /* the model's own classes remain */ }
  const own = new Option("the model's own classes", "", keep === "", keep === "");
  const taught = heads.map((h) => new Option(`head ${h.name}: ${h.classes.join(", ")}`, h.name, h.name === keep, h.name === keep));
  select.replaceChildren(own, ...taught);
}

function addTeachClass(name) {
  const row = $("teach-class-template").content.firstElementChild.cloneNode(true);
  row.files = [];
  const input = row.querySelector(".class-files");
  const zone = row.querySelector(".class-drop");
  row.querySelector(".class-name").value = name || "";
  const add = (files) => {
    row.files.push(...Array.from(files || []));
    const n = row.files.length;
    row.querySelector(".class-count").textContent = n ? `${n} image${n === 1 ? "" : "s"}: ${row.files.map((f) => f.name).join(", ")}` : "No image yet.";
  };
  input.addEventListener("change", () => { add(input.files); input.value = ""; });
  zone.addEventListener("click", () => input.click());
  zone.addEventListener("keydown", (e) => {
    if (e.key === "Enter" || e.key === " ") {
      e.preventDefault();
      input.click();
    }
  });
  zone.addEventListener("dragover", (e) => { e.preventDefault(); zone.classList.add("dragging"); });
  zone.addEventListener("dragleave", () => zone.classList.remove("dragging"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("dragging");
    add(e.dataTransfer.files);
  });
  row.querySelector(".class-remove").addEventListener("click", () => row.remove());
  $("teach-classes").append(row);
  return row;
}

async function teach() {
  const status = $("teach-status");
  const error = $("teach-error");
  error.hidden = true;
  const model = chosenModel() || defaultModel;
  const head = $("head-name").value.trim();
  const body = new FormData();
  for (const row of $("teach-classes").children) {
    const name = row.querySelector(".class-name").value.trim();
    if (!name && !row.files.length) continue;  // an empty row
    if (!name) {
      error.textContent = "Each class with images needs a name.";
      error.hidden = false;
      return;
    }
    if (!row.files.length) body.append(name, "");  // the service says which class has no image
    row.files.forEach((f) => body.append(name, f, f.name));
  }
  status.textContent = `Teaching head ${head} on ${model}…`;
  try {
    const query = $("teach-replace").checked ? "?replace=true" : "";
    const url = `/v1/models/${encodeURIComponent(model)}/heads/${encodeURIComponent(head)}${query}`;
    const response = await fetch(url, { method: "POST", body, headers: apiHeaders() });
    if (response.status === 401) showApiKeyField();
    if (!response.ok) throw new Error(await errorText(response));
    const taught = await response.json();
    const counts = taught.classes.map((c) => `${c} ${taught.examples[c]}`).join(", ");
    const held = taught.estimate
      ? `${(taught.estimate.accuracy * 100).toFixed(0)} % of examples held out answered right (${taught.estimate.method})`
      : "no held-out estimate (a class has one example)";
    status.textContent = `Taught head ${taught.name} on ${taught.model.name}: ${counts}; ${held}. New images now answer with its classes.`;
    await loadHeads(taught.model.name, taught.name);
  } catch (e) {
    status.textContent = "";
    error.textContent = e instanceof TypeError ? `Could not reach the service: ${e.message}` : e.message;
    error.hidden = false;
  }
}

function showApiKeyField() {
  const row = $("api-key-row");
  if (row.hidden) {
    row.hidden = false;
    $("api-key").focus();
  }
}

function classifyAll(files) {
  const images = Array.from(files || []);
  if (!images.length) {
    $("results-empty").hidden = false;
    $("results-empty").textContent = "Choose or drop at least one image first.";
    return;
  }
  const before = $("results").firstElementChild;
  images.forEach((f) => classify(f, before));
}

function wireEvents() {
  const zone = $("drop-zone");
  const input = $("files");
  $("upload-form").addEventListener("submit", (e) => {
    e.preventDefault();
    classifyAll(input.files);
  });
  zone.addEventListener("click", () => input.click());
  zone.addEventListener("keydown", (e) => {
    if (e.key === "Enter" || e.key === " ") {
      e.preventDefault();
      input.click();
    }
  });
  zone.addEventListener("dragover", (e) => {
    e.preventDefault();
    zone.classList.add("dragging");
  });
  zone.addEventListener("dragleave", () => zone.classList.remove("dragging"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("dragging");
    classifyAll(e.dataTransfer.files);
  });
  document.addEventListener("paste", (e) => {
    const files = Array.from(e.clipboardData ? e.clipboardData.files : []);
    if (files.length) classifyAll(files);
  });
  $("model-select").addEventListener("change", (e) => showModel(models.get(e.target.value)));
  $("teach-add").addEventListener("click", () => addTeachClass().querySelector(".class-name").focus());
  $("teach-form").addEventListener("submit", (e) => {
    e.preventDefault();
    teach();
  });
  addTeachClass();
  addTeachClass();
  const key = $("api-key");
  key.value = sessionStorage.getItem(API_KEY_STORAGE) || "";
  if (key.value) $("api-key-row").hidden = false;
  key.addEventListener("change", () => sessionStorage.setItem(API_KEY_STORAGE, key.value.trim()));
}

wireEvents();
loadModel();
loadMethods();
