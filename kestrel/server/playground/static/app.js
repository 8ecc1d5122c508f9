// The playground page: images, the conversation, and one turn per request.
import { ApiError, getJson, setApiKey } from "./api.js";
import { drawMarks } from "./overlay.js";
import { runTurn } from "./turns.js";

const $ = (id) => document.getElementById(id);
const state = {
  images: [],      // {url, name, pending: not yet sent in the chat, marks}
  current: -1,     // the image shown, which caption / point / detect use
  messages: [],    // the chat so far, in the OpenAI shape
  busy: null,      // the AbortController of the request in flight
};

function showBanner(text) {
  const banner = $("banner");
  banner.textContent = text;
  banner.hidden = !text;
}

// ---------------------------------------------------------------- images
function addImage(file) {
  if (!file.type.startsWith("image/")) {
    showBanner(`${file.name || "that"} is not an image`);
    return;
  }
  const reader = new FileReader();
  reader.onload = () => {
    state.images.push({ url: reader.result, name: file.name || "pasted image", pending: true });
    select(state.images.length - 1);
    showBanner("");
  };
  reader.onerror = () => showBanner(`could not read ${file.name}`);
  reader.readAsDataURL(file);
}

function select(index) {
  state.current = index;
  const image = state.images[index];
  const img = $("picture");
  $("stage").hidden = false;
  $("drop-hint").hidden = true;
  img.onload = () => {
    fit(img);
    drawMarks($("overlay"), img, image.marks || null);
  };
  img.src = image.url;
  img.alt = image.name;
  renderThumbs();
}

// Fill the image column, small images scaled up too (pixelated when far from their size).
function fit(img) {
  if (!img.naturalWidth) return;
  const room = $("drop").clientWidth - 24;
  const tall = Math.max(240, window.innerHeight * 0.62);
  const scale = Math.min(room / img.naturalWidth, tall / img.naturalHeight);
  img.style.width = `${Math.floor(img.naturalWidth * scale)}px`;
  img.style.height = `${Math.floor(img.naturalHeight * scale)}px`;
  img.classList.toggle("pixelated", scale >= 2);
}

function renderThumbs() {
  const thumbs = $("thumbs");
  thumbs.replaceChildren(...state.images.map((image, i) => {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "thumb";
    button.setAttribute("role", "option");
    button.setAttribute("aria-selected", String(i === state.current));
    button.title = image.pending ? `${image.name} (goes with your next chat message)` : image.name;
    const img = document.createElement("img");
    img.src = image.url;
    img.alt = image.name;
    button.append(img);
    if (image.pending) button.classList.add("pending");
    button.onclick = () => select(i);
    return button;
  }));
}

function showMarks(image, marks) {
  image.marks = marks;
  const index = state.images.indexOf(image);
  if (index !== state.current) select(index);
  else drawMarks($("overlay"), $("picture"), marks);
}

function wireImages() {
  const file = $("file");
  file.onchange = () => {
    [...file.files].forEach(addImage);
    file.value = "";
  };
  $("pick").onkeydown = (e) => {
    if (e.key === "Enter" || e.key === " ") {
      e.preventDefault();
      file.click();
    }
  };
  const drop = $("drop");
  drop.ondragover = (e) => {
    e.preventDefault();
    drop.classList.add("over");
  };
  drop.ondragleave = () => drop.classList.remove("over");
  drop.ondrop = (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    [...e.dataTransfer.files].forEach(addImage);
  };
  document.onpaste = (e) => {
    const files = [...(e.clipboardData?.files || [])].filter((f) => f.type.startsWith("image/"));
    files.forEach(addImage);
  };
  window.onresize = () => {
    fit($("picture"));
    const image = state.images[state.current];
    if (image) drawMarks($("overlay"), $("picture"), image.marks || null);
  };
}

// ---------------------------------------------------------------- server, key, adapters
async function loadHealth() {
  try {
    const health = await getJson("/v1/health");
    $("model").textContent = `${health.model || "model"} · kestrel ${health.version}`;
    const adapters = health.adapters || [];
    $("adapter-field").hidden = adapters.length === 0;
    const select = $("adapter");
    for (const name of adapters) select.append(new Option(name, name));
  } catch (err) {
    $("model").textContent = "server unreachable";
    showBanner(String(err));
  }
}

// /v1/stats is behind the key when the server has one: asking it tells the page which it is.
async function checkKey() {
  const key = $("api-key").value.trim();
  setApiKey(key);
  sessionStorage.setItem("kestrel-api-key", key);
  const stateEl = $("key-state");
  try {
    await getJson("/v1/stats");
    stateEl.textContent = key ? "key accepted" : "";
    stateEl.className = "muted";
  } catch (err) {
    const refused = err instanceof ApiError && err.status === 401;
    stateEl.textContent = refused ? (key ? "key refused" : "this server needs a key") : "";
    stateEl.className = refused ? "warn" : "muted";
  }
}

function wireKey() {
  const input = $("api-key");
  input.value = sessionStorage.getItem("kestrel-api-key") || "";
  input.onchange = checkKey;
  input.onkeydown = (e) => {
    if (e.key === "Enter") checkKey();
  };
  checkKey();
}

// ---------------------------------------------------------------- asking
function mode() {
  return document.querySelector('input[name="mode"]:checked').value;
}

async function ask() {
  if (state.busy) return;
  const prompt = $("prompt");
  const text = prompt.value.trim();
  const request = { mode: mode(), text, length: $("length").value, adapter: $("adapter").value };
  state.busy = new AbortController();
  $("send").textContent = "Stop";  // the button stops the answer in progress
  try {
    const done = await runTurn(request, state, state.busy.signal, { showMarks, renderThumbs });
    if (done) prompt.value = "";
  } finally {
    state.busy = null;
    $("send").textContent = "Send";
    prompt.focus();
  }
}

function wireAsk() {
  $("ask").onsubmit = (e) => {
    e.preventDefault();
    if (state.busy) state.busy.abort();
    else ask();
  };
  $("prompt").onkeydown = (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      ask();
    } else if (e.key === "Escape" && state.busy) {
      state.busy.abort();
    }
  };
  for (const radio of document.querySelectorAll('input[name="mode"]')) {
    radio.onchange = () => {
      $("length-field").hidden = mode() !== "caption";
      const hints = {
        chat: "Ask about the image (Enter sends, Shift+Enter for a new line)",
        caption: "Optional: press Enter to caption the image",
        point: "What to point at, e.g. circle",
        detect: "What to find, e.g. red square",
      };
      $("prompt").placeholder = hints[mode()];
    };
  }
  $("reset").onclick = () => {
    state.messages = [];
    // The next conversation is about the image shown.
    state.images.forEach((image, i) => { image.pending = i === state.current; });
    const divider = document.createElement("li");
    divider.className = "divider";
    divider.textContent = "new conversation";
    $("log").append(divider);
    renderThumbs();
    $("prompt").focus();
  };
}

window.addEventListener("error", (e) => showBanner(`page error: ${e.message}`));
window.addEventListener("unhandledrejection", (e) => showBanner(`page error: ${e.reason}`));
wireImages();
wireKey();
wireAsk();
loadHealth();
document.body.dataset.ready = "true";
