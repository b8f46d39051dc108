// The chat page: wires the sidebar, the message list, the parameters panel and the composer to
// the API, and keeps conversations in localStorage.
//
// 1. At load: find the API (ui/config.json: this origin, or another port of this host), list
//    the conversations, show the active one, and ask GET /v1/models for the model's name.
// 2. Send: the user's message (its text and any attached images, attachments.js) joins the
//    conversation (created on the first message), and the reply streams from
//    POST /v1/chat/completions into a new assistant message.
// 3. Stop aborts the fetch; the partial reply is kept and marked stopped. Regenerate replaces
//    the last reply. Every change is saved to localStorage.

import { ApiClient } from "./api.js";
import { Attachments, isImageDataUrl } from "./attachments.js";
import { ChatView } from "./chat_view.js";
import { SettingsPanel, samplingFields } from "./settings_panel.js";
import { Sidebar } from "./sidebar.js";
import { SpeedMeter } from "./speed.js";
import { ConversationStore, loadSettings } from "./store.js";

const $ = (id) => document.getElementById(id);

const store = new ConversationStore();
const settings = loadSettings();
const view = new ChatView($("messages"), () => regenerate());
const sidebar = new Sidebar($("conversations"), $("new-chat"), {
  onSelect: select,
  onDelete: remove,
  onNew: startNew,
});
const panel = new SettingsPanel($("settings"), $("toggle-settings"), settings, connect, notify);
const prompt = $("prompt");
const attachments = new Attachments($("attachments"), notify);
let api = null;
let model = null;
let streaming = null; // {conversation, controller} while a reply streams

function notify(error) {
  $("notice").textContent = error ? error.message : "";
  $("notice").hidden = !error;
}

function save(conversation = null) {
  try {
    store.save(conversation);
  } catch (error) {
    notify(error);
  }
}

function refreshSidebar() {
  sidebar.render(store.list(), store.activeId);
}

function setState(state) {
  document.body.dataset.state = state; // "idle" or "streaming"; the tests wait on it too
  $("send").hidden = state === "streaming";
  $("stop").hidden = state !== "streaming";
}

function setStatus(kind, text) {
  $("status").dataset.kind = kind;
  $("model-name").textContent = text;
}

async function apiBase() {
  const response = await fetch("ui/config.json");
  const { api_port: apiPort } = await response.json();
  if (apiPort === null) return new URL("v1/", location.href);
  return new URL(`${location.protocol}//${location.hostname}:${apiPort}/v1/`);
}

async function connect() {
  api.apiKey = settings.apiKey.trim();
  setStatus("connecting", "Connecting…");
  try {
    model = (await api.models())[0] ?? null;
    setStatus("ready", model ?? "no model");
  } catch (error) {
    model = null;
    if (error.status === 401) {
      setStatus("error", "API key needed");
      panel.show(true, "apiKey");
    } else {
      setStatus("error", `Server unreachable (${error.message})`);
    }
  }
}

function describe(error) {
  if (error.status === 401) {
    panel.show(true, "apiKey");
    return "The server needs an API key: enter it under Parameters, then regenerate.";
  }
  if (error instanceof TypeError) return `Could not reach the server: ${error.message}`;
  return error.message;
}

/** A message's content for the API: its text, or with images OpenAI's content parts (the
 *  images first, then the text). */
function contentOf({ content, images }) {
  const urls = (images ?? []).filter(isImageDataUrl);
  if (urls.length === 0) return content;
  const parts = urls.map((url) => ({ type: "image_url", image_url: { url } }));
  return content ? [...parts, { type: "text", text: content }] : parts;
}

/** What goes to the API: the system prompt, then each message's role and content. */
function historyOf(conversation) {
  const messages = conversation.messages
    .filter((message) => !message.error && (message.role === "user" || message.content))
    .map((message) => ({ role: message.role, content: contentOf(message) }));
  const system = settings.systemPrompt.trim();
  return system ? [{ role: "system", content: system }, ...messages] : messages;
}

async function generate(conversation) {
  const request = { messages: historyOf(conversation), ...samplingFields(settings) };
  if (model) request.model = model;
  const reply = { role: "assistant", content: "", reasoning: "", streaming: true };
  conversation.messages.push(reply);
  const replyView = view.append(reply);
  view.scrollToEnd(true);
  const controller = new AbortController();
  streaming = { conversation, controller };
  setState("streaming");
  const meter = new SpeedMeter($("speed"));
  try {
    for await (const chunk of api.streamChat(request, controller.signal)) {
      if (chunk.usage) meter.usageTokens = chunk.usage.completion_tokens;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      const { content, reasoning_content: reasoning } = choice.delta ?? {};
      if (reasoning) reply.reasoning += reasoning;
      if (content) reply.content += content;
      if (content || reasoning) meter.count();
      if (choice.finish_reason) reply.finishReason = choice.finish_reason;
      replyView.scheduleRender();
      view.scrollToEnd();
    }
  } catch (error) {
    if (error.name === "AbortError") reply.stopped = true;
    else reply.error = describe(error);
  } finally {
    delete reply.streaming;
    reply.stats = meter.finish();
    streaming = null;
    setState("idle");
    replyView.render();
    save(conversation);
    refreshSidebar();
  }
}

function stop() {
  streaming?.controller.abort();
}

async function send(text, images) {
  const conversation = store.active() ?? store.create(text || "Image");
  const message = { role: "user", content: text };
  if (images.length) message.images = images;
  conversation.messages.push(message);
  view.append(message);
  save(conversation);
  refreshSidebar();
  await generate(conversation);
}

async function regenerate() {
  const conversation = store.active();
  if (!conversation || streaming) return;
  while (conversation.messages.at(-1)?.role === "assistant") conversation.messages.pop();
  if (conversation.messages.length === 0) return;
  view.show(conversation.messages);
  await generate(conversation);
}

function select(id) {
  document.body.classList.remove("sidebar-open");
  if (id === store.activeId && id !== null) return; // already shown (maybe streaming)
  if (streaming) stop(); // the reply ends in its own conversation, kept as far as it got
  store.select(id);
  save();
  view.show(store.active()?.messages ?? []);
  refreshSidebar();
}

function remove(id) {
  if (streaming?.conversation.id === id) stop();
  const wasActive = store.activeId === id;
  store.remove(id);
  save();
  if (wasActive) view.show([]);
  refreshSidebar();
}

function startNew() {
  select(null);
  prompt.focus();
}

function fitPrompt() {
  prompt.style.height = "auto";
  prompt.style.height = `${Math.min(prompt.scrollHeight, 240)}px`;
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = prompt.value.trim();
  if ((!text && attachments.urls.length === 0) || streaming || !api) return;
  prompt.value = "";
  fitPrompt();
  send(text, attachments.take());
});
$("attach").addEventListener("click", () => $("attach-input").click());
$("attach-input").addEventListener("change", async (event) => {
  await attachments.add(event.target.files);
  event.target.value = ""; // picking the same file again fires change again
});
prompt.addEventListener("paste", (event) => {
  const files = event.clipboardData?.files;
  if (files?.length) {
    event.preventDefault();
    attachments.add(files);
  }
});
for (const type of ["dragenter", "dragover"]) {
  $("composer").addEventListener(type, (event) => {
    if (!event.dataTransfer?.types.includes("Files")) return;
    event.preventDefault();
    $("composer").classList.add("dropping");
  });
}
$("composer").addEventListener("dragleave", () => $("composer").classList.remove("dropping"));
$("composer").addEventListener("drop", (event) => {
  $("composer").classList.remove("dropping");
  if (!event.dataTransfer?.files.length) return;
  event.preventDefault();
  attachments.add(event.dataTransfer.files);
});
prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
prompt.addEventListener("input", fitPrompt);
$("stop").addEventListener("click", stop);
$("toggle-sidebar").addEventListener("click", () => {
  document.body.classList.toggle("sidebar-open");
});

setState("idle");
refreshSidebar();
view.show(store.active()?.messages ?? []);
prompt.focus();
try {
  api = new ApiClient(await apiBase(), settings.apiKey.trim());
  await connect();
} catch (error) {
  setStatus("error", `Cannot load the page's settings (${error.message})`);
}
