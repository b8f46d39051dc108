// The message list: one <article> per message; replies are re-rendered as they stream, at most
// once per animation frame.

import { isImageDataUrl } from "./attachments.js";
import { copyText, renderMarkdown } from "./markdown.js";

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function statsText(message) {
  const parts = [];
  const stats = message.stats;
  if (stats?.tokens) parts.push(`${stats.tokens} tokens`);
  if (stats?.tokensPerSecond) parts.push(`${stats.tokensPerSecond.toFixed(1)} tok/s`);
  if (message.stopped) parts.push("stopped");
  else if (message.finishReason === "length") parts.push("cut at the token limit");
  return parts.join(" · ");
}

/** One reply's element, updated in place while it streams. */
class ReplyView {
  constructor(message, onRegenerate) {
    this.message = message;
    this.root = element("article", "message assistant");
    this.reasoning = element("details", "reasoning");
    this.reasoningTitle = element("summary", "", "Reasoning");
    this.reasoningBody = element("div", "reasoning-body");
    this.reasoning.append(this.reasoningTitle, this.reasoningBody);
    this.content = element("div", "content markdown");
    this.error = element("div", "error");
    this.stats = element("span", "stats");
    const copy = element("button", "action copy", "Copy");
    copy.type = "button";
    copy.hidden = !navigator.clipboard;
    copy.addEventListener("click", () => copyText(copy, this.message.content));
    const regenerate = element("button", "action regenerate", "Regenerate");
    regenerate.type = "button";
    regenerate.addEventListener("click", onRegenerate);
    const meta = element("footer", "meta");
    meta.append(this.stats, copy, regenerate);
    this.root.append(this.reasoning, this.content, this.error, meta);
    this.pending = false;
    this.render();
  }

  /** Re-render on the next animation frame (many chunks may arrive within one). */
  scheduleRender() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.render();
    });
  }

  render() {
    const { message } = this;
    const streaming = Boolean(message.streaming);
    this.root.classList.toggle("streaming", streaming);
    this.reasoning.hidden = !message.reasoning;
    if (message.reasoning) {
      const thinking = streaming && !message.content;
      this.reasoningTitle.textContent = thinking ? "Thinking…" : "Reasoning";
      // Open while the model thinks; closed once the answer starts (the user may reopen it).
      if (thinking) this.reasoning.open = true;
      else if (this.wasThinking) this.reasoning.open = false;
      this.wasThinking = thinking;
      this.reasoningBody.textContent = message.reasoning;
    }
    renderMarkdown(this.content, message.content);
    this.error.hidden = !message.error;
    this.error.textContent = message.error ?? "";
    this.stats.textContent = statsText(message);
  }
}

export class ChatView {
  /** `onRegenerate()`: the user asked for a new version of the last reply. */
  constructor(container, onRegenerate) {
    this.container = container;
    this.onRegenerate = onRegenerate;
  }

  /** Show `messages` (an empty list shows the greeting). */
  show(messages) {
    this.container.replaceChildren();
    if (messages.length === 0) {
      const empty = element("div", "empty");
      empty.append(element("h1", "", "How can I help?"));
      empty.append(element("p", "", "Conversations stay in this browser."));
      this.container.append(empty);
      return;
    }
    for (const message of messages) this.append(message);
    this.scrollToEnd(true);
  }

  /** Add one message at the end; returns the reply's view for an assistant message. */
  append(message) {
    this.container.querySelector(".empty")?.remove();
    if (message.role !== "assistant") {
      const article = element("article", `message ${message.role}`);
      const urls = (message.images ?? []).filter(isImageDataUrl);
      if (urls.length) {
        const images = element("div", "images");
        urls.forEach((url, index) => {
          const image = element("img");
          image.src = url;
          image.alt = `image ${index + 1}`;
          images.append(image);
        });
        article.append(images);
      }
      article.append(element("div", "content", message.content));
      this.container.append(article);
      return null;
    }
    const view = new ReplyView(message, this.onRegenerate);
    this.container.append(view.root);
    return view;
  }

  /** Keep the newest text in view, unless the user scrolled up to read (or `force`). */
  scrollToEnd(force = false) {
    const { container } = this;
    const nearEnd = container.scrollHeight - container.scrollTop - container.clientHeight < 120;
    if (force || nearEnd) container.scrollTop = container.scrollHeight;
  }
}
