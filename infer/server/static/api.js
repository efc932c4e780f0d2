// The server's HTTP API as the playground uses it: JSON calls with the user's API key, and
// the native event stream read with fetch (EventSource cannot POST), resumed with
// Last-Event-ID when the connection drops.

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }

  static async from(response) {
    let code = "http_" + response.status;
    let message = response.statusText || "request failed";
    try {
      const body = await response.json();
      if (body && body.error) ({ code, message } = body.error);
    } catch {
      // not JSON: keep the status line
    }
    return new ApiError(response.status, code, message);
  }
}

export class Api {
  // key(): the API key to send, or "" for none.
  constructor(key) {
    this.key = key;
  }

  headers(extra = {}) {
    const headers = { "Content-Type": "application/json", ...extra };
    const key = this.key();
    if (key) headers["Authorization"] = `Bearer ${key}`;
    return headers;
  }

  // signal: an AbortSignal that ends the request (the server drops its work when the
  // connection closes).
  async call(method, path, body, signal) {
    const response = await fetch(path, {
      method,
      headers: this.headers(),
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
    });
    if (!response.ok) throw await ApiError.from(response);
    const type = response.headers.get("Content-Type") || "";
    return type.includes("json") ? response.json() : response.text();
  }

  get(path) {
    return this.call("GET", path);
  }

  post(path, body, signal) {
    return this.call("POST", path, body, signal);
  }

  // Read POST /v1/generate to its terminal event, calling onEvent({id, event, data}) for
  // each event. A dropped connection is resumed with the same body (it carries a
  // request_id) and Last-Event-ID; onResume(lastId) is called before each attempt.
  // Returns the terminal event; throws ApiError for a refusal, or when aborted.
  async generate(body, { onEvent, onResume = () => {}, signal, retries = 8 }) {
    let lastId = null;
    let failures = 0;
    for (;;) {
      const extra = lastId === null ? {} : { "Last-Event-ID": String(lastId) };
      try {
        const response = await fetch("/v1/generate", {
          method: "POST",
          headers: this.headers(extra),
          body: JSON.stringify(body),
          signal,
        });
        if (!response.ok) throw await ApiError.from(response);
        for await (const event of events(response.body)) {
          if (event.id !== null) lastId = event.id;
          failures = 0;
          onEvent(event);
          if (event.event === "done" || event.event === "error") return event;
        }
      } catch (error) {
        if (signal && signal.aborted) throw error;
        if (error instanceof ApiError) throw error;
      }
      // The stream ended without its terminal event: the connection was lost.
      if (++failures > retries) throw new ApiError(0, "connection_lost", "connection lost");
      await new Promise((resolve) => setTimeout(resolve, Math.min(2000, 100 * 2 ** failures)));
      onResume(lastId);
    }
  }
}

// The events of a text/event-stream body, as {id, event, data} (data parsed as JSON).
export async function* events(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const event = parse(block);
        if (event) yield event;
      }
    }
  } finally {
    reader.releaseLock();
  }
}

function parse(block) {
  let id = null;
  let name = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue; // a comment: the heartbeat
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "id") id = Number(value);
    else if (field === "event") name = value;
    else if (field === "data") data.push(value);
  }
  if (!data.length) return null;
  return { id, event: name, data: JSON.parse(data.join("\n")) };
}

// Prometheus text exposition → {name: value} (labelled samples keep their labels in the name).
export function parseMetrics(text) {
  // Every series is labelled with its model; a server of several sums them.
  const values = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const space = line.lastIndexOf(" ");
    const key = line
      .slice(0, space)
      .replace(/model="(?:[^"\\]|\\.)*",?/, "")
      .replace(",}", "}")
      .replace("{}", "");
    values[key] = (values[key] ?? 0) + Number(line.slice(space + 1));
  }
  return values;
}
