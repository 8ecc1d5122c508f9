// One turn of the log per request: chat (streamed, over /v1/chat/completions), caption
// (streamed), point and detect (drawn over the image). Each shows its TTFT and how much of
// its prompt came from the prefix cache; a failure shows the server's message in the turn.
import { ApiError, postJson, postStream, streamError } from "./api.js";

function addTurn(mode, text) {
  const li = document.createElement("li");
  li.className = `turn ${mode}`;
  const you = document.createElement("p");
  you.className = "you";
  const tag = document.createElement("span");
  tag.className = "tag";
  tag.textContent = mode;
  you.append(tag, text ? ` ${text}` : "");
  const answer = document.createElement("p");
  answer.className = "answer";
  answer.setAttribute("aria-busy", "true");
  const meta = document.createElement("p");
  meta.className = "meta";
  li.append(you, answer, meta);
  document.getElementById("log").append(li);
  li.scrollIntoView({ block: "end" });
  return { li, answer, meta };
}

// TTFT in ms; `cached` of `prompt` positions came from the prefix cache.
function showMeta(turn, { ttft, cached, prompt }) {
  const share = prompt ? cached / prompt : 0;
  Object.assign(turn.meta.dataset, { ttftMs: ttft.toFixed(1), cached, prompt, share });
  turn.meta.textContent = `TTFT ${Math.round(ttft)} ms · cached ${cached} of ${prompt} ` +
    `prompt tokens (${Math.round(100 * share)}%)`;
  turn.meta.title = "cached: prompt positions (the image's block included) reused from the " +
    "prefix cache instead of being computed again";
}

function fail(turn, err) {
  turn.li.classList.add("failed");
  turn.answer.removeAttribute("aria-busy");
  const text = err.name === "AbortError" ? "stopped" : String(err);
  const p = document.createElement("p");
  p.className = "error";
  p.setAttribute("role", "alert");
  p.textContent = text;
  turn.answer.after(p);
}

function withAdapter(body, request) {
  return request.adapter ? { ...body, adapter: request.adapter } : body;
}

async function chat(request, state, signal, turn, hooks) {
  const pending = state.images.filter((image) => image.pending);
  const parts = pending.map((image) => ({ type: "image_url", image_url: { url: image.url } }));
  const content = parts.length ? [...parts, { type: "text", text: request.text }] : request.text;
  const user = { role: "user", content };
  const body = withAdapter({
    model: "kestrel", messages: [...state.messages, user], stream: true,
    stream_options: { include_usage: true },
  }, request);
  const started = performance.now();
  let ttft = null;
  let usage = null;
  try {
    await postStream("/v1/chat/completions", body, (event) => {
      if (event.error) throw streamError(event);
      if (event.usage) usage = event.usage;
      const delta = event.choices?.[0]?.delta?.content;
      if (delta) {
        ttft ??= performance.now() - started;
        turn.answer.textContent += delta;
      }
    }, signal);
  } catch (err) {
    if (pending.length && err instanceof ApiError && err.status === 400 &&
        /image/i.test(err.message)) {
      pending.forEach((image) => { image.pending = false; });  // do not resend it every turn
      hooks.renderThumbs();
      err.message += " (the image stays here for caption, point and detect)";
    }
    throw err;
  }
  state.messages.push(user, { role: "assistant", content: turn.answer.textContent });
  pending.forEach((image) => { image.pending = false; });
  hooks.renderThumbs();
  const cached = usage?.prompt_tokens_details?.cached_tokens ?? 0;
  showMeta(turn, { ttft: ttft ?? performance.now() - started, cached,
    prompt: usage?.prompt_tokens ?? 0 });
}

async function caption(request, image, signal, turn) {
  const body = withAdapter({ image_url: image.url, length: request.length, stream: true },
    request);
  let metrics = null;
  await postStream("/v1/caption", body, (event) => {
    if (event.error) throw streamError(event);
    if (event.chunk) turn.answer.textContent += event.chunk;
    if (event.completed) metrics = event.metrics;
    if (event.caption !== undefined) {  // answered in one piece
      turn.answer.textContent = event.caption;
      metrics = event.metrics;
    }
  }, signal);
  return metrics;
}

async function locate(request, image, signal, turn, hooks) {
  const kind = request.mode === "point" ? "point" : "box";
  const body = withAdapter({ image_url: image.url, object: request.text }, request);
  const result = await postJson(`/v1/${request.mode}`, body, signal);
  const items = kind === "point" ? result.points : result.objects;
  const noun = kind === "point" ? "point" : "box";
  turn.answer.textContent = items.length
    ? `${items.length} ${noun}${items.length > 1 ? (kind === "box" ? "es" : "s") : ""} for ` +
      `"${request.text}": ${items.map((it) => format(it)).join(", ")}`
    : `nothing found for "${request.text}"`;
  hooks.showMarks(image, { kind, items, name: request.text });
  return result.metrics;
}

function format(item) {
  const f = (v) => v.toFixed(3);
  return "x" in item ? `(${f(item.x)}, ${f(item.y)})`
    : `[${f(item.x_min)}, ${f(item.y_min)}, ${f(item.x_max)}, ${f(item.y_max)}]`;
}

function check(request, image) {
  if (request.mode !== "chat" && !image) return "add an image first";
  if ((request.mode === "chat" || request.mode === "point" || request.mode === "detect") &&
      !request.text) {
    return request.mode === "chat" ? "type a message first" : "say what to look for first";
  }
  return null;
}

// Runs one request as a turn of the log; true when it succeeded.
export async function runTurn(request, state, signal, hooks) {
  const image = state.images[state.current];
  const problem = check(request, image);
  const turn = addTurn(request.mode, request.text);
  if (problem) {
    fail(turn, new ApiError(0, "not sent", problem));
    return false;
  }
  try {
    if (request.mode === "chat") {
      await chat(request, state, signal, turn, hooks);
    } else {
      const metrics = request.mode === "caption"
        ? await caption(request, image, signal, turn)
        : await locate(request, image, signal, turn, hooks);
      if (metrics) {
        showMeta(turn, { ttft: metrics.ttft_ms, cached: metrics.cached_tokens,
          prompt: metrics.input_tokens });
      }
    }
  } catch (err) {
    fail(turn, err);
    return false;
  } finally {
    turn.answer.removeAttribute("aria-busy");
    turn.li.scrollIntoView({ block: "end" });
  }
  turn.li.classList.add("done");
  if (!turn.answer.textContent) turn.answer.classList.add("empty");
  return true;
}
