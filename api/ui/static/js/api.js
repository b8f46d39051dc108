// The OpenAI-compatible API the page talks to: the model list and streamed chat completions.
//
// Streams are server-sent events read by hand from the response body: each event is
// `data: <json>` and the stream ends with `data: [DONE]`; an error after the first byte arrives
// as an event holding the usual `{"error": {...}}` envelope. Aborting the fetch (the stop button)
// closes the connection, and the server then aborts the generation.

export class ApiError extends Error {
  constructor(message, status = 0, code = null) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
  }
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    message = body?.error?.message ?? message;
    code = body?.error?.code ?? null;
  } catch {
    // Not the JSON envelope (e.g. a proxy's error page): the status line says enough.
  }
  return new ApiError(message, response.status, code);
}

/** The `data:` payloads of a server-sent event stream, as they arrive. */
async function* eventData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replaceAll("\r\n", "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (data) yield data;
      }
    }
  } finally {
    reader.releaseLock();
  }
}

export class ApiClient {
  /** `baseUrl`: the API root ending in `/v1/`; `apiKey`: sent as a Bearer token when set. */
  constructor(baseUrl, apiKey = "") {
    this.baseUrl = baseUrl;
    this.apiKey = apiKey;
  }

  headers() {
    const headers = { "Content-Type": "application/json" };
    if (this.apiKey) headers.Authorization = `Bearer ${this.apiKey}`;
    return headers;
  }

  /** The served model names, the default one first. */
  async models() {
    const response = await fetch(new URL("models", this.baseUrl), { headers: this.headers() });
    if (!response.ok) throw await errorOf(response);
    const body = await response.json();
    return body.data.map((model) => model.id);
  }

  /**
   * Stream a chat completion: yields each chunk object (the last one carries `usage` and no
   * choices). Throws ApiError for a refused request or an error event, and the fetch's
   * AbortError when `signal` aborts.
   */
  async *streamChat(request, signal) {
    const body = { ...request, stream: true, stream_options: { include_usage: true } };
    const response = await fetch(new URL("chat/completions", this.baseUrl), {
      method: "POST",
      headers: this.headers(),
      body: JSON.stringify(body),
      signal,
    });
    if (!response.ok) throw await errorOf(response);
    for await (const data of eventData(response.body)) {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(chunk.error.message, 0, chunk.error.code);
      yield chunk;
    }
    throw new ApiError("The stream ended before [DONE]: the connection was lost.");
  }
}
