// Conversations and settings, kept in the browser's localStorage (nothing is stored server-side).
//
// A conversation is {id, title, messages, updatedAt}; a message is {role, content} plus, for the
// user's, the {images} attached (data: URLs) and, for replies, {reasoning, stats, finishReason,
// stopped, error}. Only role, content and images go back to the API (see historyOf in main.js).

const CONVERSATIONS_KEY = "runtime-ui.conversations";
const ACTIVE_KEY = "runtime-ui.active";
const SETTINGS_KEY = "runtime-ui.settings";
const TITLE_LENGTH = 48;

export const DEFAULT_SETTINGS = Object.freeze({
  systemPrompt: "",
  temperature: "",
  topP: "",
  topK: "",
  maxTokens: "",
  apiKey: "",
});

export class StorageError extends Error {}

function read(key, fallback) {
  const text = localStorage.getItem(key);
  if (text === null) return fallback;
  try {
    return JSON.parse(text);
  } catch (error) {
    console.error(`ignoring unreadable ${key} in localStorage`, error);
    return fallback;
  }
}

function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch (error) {
    throw new StorageError(`Could not save to this browser's storage: ${error.message}`);
  }
}

function newId() {
  // crypto.randomUUID exists only on secure origins (https or localhost).
  const random = Math.random().toString(36).slice(2, 10);
  return globalThis.crypto?.randomUUID?.() ?? `${Date.now().toString(36)}-${random}`;
}

function titleOf(text) {
  const line = text.trim().split("\n")[0];
  return line.length > TITLE_LENGTH ? `${line.slice(0, TITLE_LENGTH - 1)}…` : line || "New chat";
}

export class ConversationStore {
  constructor() {
    const saved = read(CONVERSATIONS_KEY, []);
    this.conversations = Array.isArray(saved) ? saved : [];
    const active = read(ACTIVE_KEY, null);
    this.activeId = this.get(active) ? active : null;
  }

  get(id) {
    return this.conversations.find((conversation) => conversation.id === id) ?? null;
  }

  active() {
    return this.get(this.activeId);
  }

  /** Most recently used first. */
  list() {
    return [...this.conversations].sort((a, b) => b.updatedAt - a.updatedAt);
  }

  /** A new conversation that starts with the user's first message; it becomes the active one. */
  create(firstMessage) {
    const conversation = {
      id: newId(),
      title: titleOf(firstMessage),
      messages: [],
      updatedAt: Date.now(),
    };
    this.conversations.push(conversation);
    this.activeId = conversation.id;
    return conversation;
  }

  select(id) {
    this.activeId = this.get(id) ? id : null;
  }

  remove(id) {
    this.conversations = this.conversations.filter((conversation) => conversation.id !== id);
    if (this.activeId === id) this.activeId = null;
  }

  /** Persist everything (throws StorageError); `touched` moves to the top of the list. */
  save(touched = null) {
    if (touched) touched.updatedAt = Date.now();
    write(CONVERSATIONS_KEY, this.conversations);
    write(ACTIVE_KEY, this.activeId);
  }
}

export function loadSettings() {
  const saved = read(SETTINGS_KEY, {});
  const settings = { ...DEFAULT_SETTINGS };
  for (const key of Object.keys(DEFAULT_SETTINGS)) {
    if (typeof saved?.[key] === "string") settings[key] = saved[key];
  }
  return settings;
}

export function saveSettings(settings) {
  write(SETTINGS_KEY, settings);
}
