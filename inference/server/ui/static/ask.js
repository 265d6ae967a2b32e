// The Ask page (templates/ask.html): sends the question to POST /ui/ask/stream once per checked
// method (the API's streaming query: `event: token` per decoded token, then `event: answer` with
// the answer JSON of `coinrag query --json`, or `event: error`), shows the tokens as they come,
// then the timings waterfall, the KV reuse map and the evidence. No library; text is only ever
// set with textContent, never parsed as HTML.
"use strict";

const STAGES = ["retrieval", "kv_load", "assembly", "prefill", "decode"];

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

// Server-sent events of a fetch response body: calls onEvent(name, data) per event.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trim());
      }
      if (data.length) onEvent(name, JSON.parse(data.join("\n")));
    }
  }
}

function waterfall(box, timings) {
  const total = STAGES.reduce((sum, s) => sum + (timings[s] || 0), 0) || 1;
  let at = 0;
  for (const stage of STAGES) {
    const ms = timings[stage] || 0;
    const row = el("div", "bar-row");
    row.dataset.stage = stage;
    row.append(el("span", "bar-label", stage));
    const track = el("span", "bar-track");
    const bar = el("span", "bar " + stage);
    bar.style.marginLeft = (100 * at / total) + "%";
    bar.style.width = Math.max(0.5, 100 * ms / total) + "%";
    track.append(bar);
    row.append(track, el("span", "bar-value", ms.toFixed(1) + " ms"));
    box.append(row);
    at += ms;
  }
  if (timings.ttft !== undefined) box.append(el("p", "muted", "TTFT " + timings.ttft.toFixed(1) + " ms"));
}

function kvMap(box, answer, reusesKv, bytesPerToken) {
  const table = el("table", "kv");
  const head = el("tr");
  for (const h of ["context piece", "tokens", "loaded from store", "computed now", "bytes read"]) head.append(el("th", "", h));
  table.append(head);
  let loaded = 0;
  answer.evidence.forEach((ev, i) => {
    const tokens = (ev.tok_end || 0) - (ev.tok_start || 0);
    const fromStore = reusesKv ? tokens : 0;
    loaded += fromStore;
    const row = el("tr");
    row.append(el("td", "", (i + 1) + ". " + ev.doc_id), el("td", "", String(tokens)),
      el("td", "loaded", String(fromStore)), el("td", "computed", String(tokens - fromStore)),
      el("td", "", String(fromStore * bytesPerToken)));
    table.append(row);
  });
  box.append(table);
  const computed = Math.max(0, answer.active_tokens - loaded);
  const summary = el("p", "kv-summary");
  summary.dataset.loaded = String(loaded);
  summary.dataset.computed = String(computed);
  summary.textContent = loaded + " context tokens loaded from the store, " + computed +
    " computed now; prefill tokens saved against standard RAG: " + loaded +
    " (" + (loaded * bytesPerToken / 1048576).toFixed(2) + " MiB of KV read)";
  box.append(summary);
}

// What an evidence's score is, per search mode (the weight and the normalisation come from
// the server).
function scoreFormula(mode, denseWeight) {
  const lexicalWeight = (1 - denseWeight).toFixed(2);
  const rule = document.querySelector("#ask").dataset.fusionNormaliser;
  return {
    dense: "score: cosine similarity to the question (a chunk: the mean of its own and its best nugget's)",
    lexical: "score: BM25 of the question's terms",
    hybrid: "score: " + Number(denseWeight).toFixed(2) + " × dense + " + lexicalWeight +
      " × lexical, each ranking " + rule + " (relative score fusion)",
  }[mode] || "score: the search mode's";
}

// A hybrid hit's score parts: each ranking's rank and own score, and the fused sum.
function partsText(p) {
  const part = (name, rank, score, unit) =>
    rank === null ? name + ": not in its top rows" : name + " #" + rank + " " + unit + " " + score.toFixed(3);
  const lexicalWeight = 1 - p.dense_weight;
  return part("dense", p.dense_rank, p.dense_score, "cosine") + " · " +
    part("lexical", p.lexical_rank, p.lexical_score, "BM25") + " · fused " +
    p.dense_weight.toFixed(2) + " × " + p.dense_norm.toFixed(3) + " + " +
    lexicalWeight.toFixed(2) + " × " + p.lexical_norm.toFixed(3);
}

// The best dense cosine among the evidence (hybrid: its parts; dense: its score), or null.
function bestCosine(answer) {
  const cosines = answer.evidence.map((ev) =>
    ev.score_parts ? ev.score_parts.dense_score : (answer.retrieval === "dense" ? ev.score : null))
    .filter((c) => typeof c === "number");
  return cosines.length ? Math.max(...cosines) : null;
}

function evidenceList(list, answer) {
  for (const ev of answer.evidence) {
    const item = el("li");
    item.dataset.chunk = ev.chunk_id || "";
    item.dataset.doc = ev.doc_id || "";
    const link = el("a", "id", ev.citation || ev.doc_id);
    const cite = (ev.chunk_id || "") + ":" + ev.tok_start + "-" + ev.tok_end;
    link.href = "/ui/documents/" + encodeURIComponent(ev.doc_id) + "?cite=" +
      encodeURIComponent(cite) + "#cited";
    item.dataset.score = String(ev.score);
    const score = typeof ev.score === "number" ? " · score " + ev.score.toFixed(3) : "";
    item.append(link, el("span", "muted", " tokens " + ev.tok_start + "–" + ev.tok_end + score), el("br"));
    if (ev.score_parts) item.append(el("span", "parts muted", partsText(ev.score_parts)), el("br"));
    item.append(el("mark", "evidence-text", ev.text || ""));
    list.append(item);
  }
}

async function askOne(card, body, reusesKv, bytesPerToken, denseWeight, weakCosine) {
  const answerBox = card.querySelector(".answer");
  const status = card.querySelector(".status");
  status.textContent = "waiting for the model…";
  const response = await fetch("/ui/ask/stream", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    credentials: "same-origin",
    body: JSON.stringify(body),
  });
  if (!response.ok) {
    const text = await response.text();
    status.textContent = "error " + response.status + ": " + text;
    card.dataset.state = "error";
    return;
  }
  await readEvents(response, (name, data) => {
    if (name === "token") {
      answerBox.textContent += data.text;
      status.textContent = "streaming…";
    } else if (name === "answer") {
      answerBox.textContent = data.answer;
      status.textContent = data.evidence.length + " evidence pieces, retrieval " + data.retrieval;
      waterfall(card.querySelector(".waterfall"), data.timings);
      kvMap(card.querySelector(".kvmap"), data, reusesKv, bytesPerToken);
      evidenceList(card.querySelector(".evidence"), data);
      const parts = data.evidence.find((ev) => ev.score_parts);
      const weight = parts ? parts.score_parts.dense_weight : denseWeight;
      card.querySelector(".scores").textContent = scoreFormula(data.retrieval, weight);
      const best = bestCosine(data);
      if (best !== null && best < weakCosine) {
        const warning = card.querySelector(".weak");
        warning.textContent = "Nothing scored well: the best evidence's cosine similarity to the " +
          "question is " + best.toFixed(3) + " (under " + weakCosine + "); the store may not " +
          "hold an answer.";
        warning.hidden = false;
      }
      card.dataset.state = "done";
    } else if (name === "error") {
      status.textContent = "error " + data.status + ": " + data.error;
      card.dataset.state = "error";
    }
  });
}

async function onSubmit(event) {
  event.preventDefault();
  const form = event.target;
  const button = document.getElementById("ask-button");
  const answers = document.getElementById("answers");
  const template = document.getElementById("method-template");
  const bytesPerToken = Number(form.dataset.kvBytesPerToken) || 0;
  answers.replaceChildren();
  button.disabled = true;
  const question = form.elements.question.value;
  const checked = [...form.querySelectorAll("input[name=method]:checked")];
  const jobs = checked.map((box) => {
    const card = template.content.firstElementChild.cloneNode(true);
    card.dataset.method = box.value;
    card.querySelector(".method-name").textContent = box.value;
    answers.append(card);
    const body = { question, method: box.value, kc: Number(form.elements.kc.value), k: Number(form.elements.k.value) };
    if (form.elements.retrieval.value) body.retrieval = form.elements.retrieval.value;
    return [card, body, box.dataset.reusesKv === "true"];
  });
  try {
    const denseWeight = Number(form.dataset.hybridDenseWeight);
    const weakCosine = Number(form.dataset.weakCosine);
    for (const [card, body, reuses] of jobs) {
      await askOne(card, body, reuses, bytesPerToken, denseWeight, weakCosine);
    }
  } finally {
    button.disabled = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("ask").addEventListener("submit", onSubmit);
});
