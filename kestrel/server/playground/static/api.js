// Talking to the server: the API key, JSON calls, and server-sent event streams.
// Every failure becomes an ApiError whose message is the server's own, for the page to show.

export class ApiError extends Error {
  constructor(status, type, message) {
    super(message);
    this.status = status;
    this.type = type;
  }
  toString() {
    const where = this.status ? `${this.status} ${this.type}` : this.type;
    return `${where}: ${this.message}`;
  }
}

let apiKey = "";
export function setApiKey(key) {
  apiKey = key.trim();
}

function headers(json) {
  const out = json ? { "Content-Type": "application/json" } : {};
  if (apiKey) out.Authorization = `Bearer ${apiKey}`;
  return out;
}

async function send(method, path, body, signal) {
  let response;
  try {
    response = await fetch(path, {
      method,
      headers: headers(body !== undefined),
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
    });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, "network_error", `the server cannot be reached (${err.message})`);
  }
  if (!response.ok) throw await errorOf(response);
  return response;
}

// The API's error body is {"error": {"type", "message"}}; anything else still says something.
async function errorOf(response) {
  const text = await response.text().catch(() => "");
  try {
    const { error } = JSON.parse(text);
    if (error && error.message) return new ApiError(response.status, error.type, error.message);
  } catch (_) { /* not JSON: fall through */ }
  const detail = text.trim().slice(0, 200) || response.statusText || "no details";
  return new ApiError(response.status, "http_error", detail);
}

export async function getJson(path) {
  return (await send("GET", path)).json();
}

export async function postJson(path, body, signal) {
  return (await send("POST", path, body, signal)).json();
}

// POST with "stream": true; calls onEvent(payload) for each `data:` event as it arrives and
// returns when the stream ends. The `data: [DONE]` tail of the chat stream is skipped.
export async function postStream(path, body, onEvent, signal) {
  const response = await send("POST", path, body, signal);
  const type = response.headers.get("content-type") || "";
  if (!type.startsWith("text/event-stream")) {  // a server that answered in one piece
    onEvent(await response.json());
    return;
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (data && data !== "[DONE]") onEvent(JSON.parse(data));
    }
    if (done) return;
  }
}

// An error event inside a stream that had already started (its status was already sent).
export function streamError(payload) {
  const { type, message } = payload.error;
  return new ApiError(0, type || "error", message || "the request failed");
}
