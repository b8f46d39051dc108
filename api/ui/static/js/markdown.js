// Markdown to sanitized HTML with highlighted code blocks, using the vendored marked, DOMPurify
// and highlight.js (loaded by index.html as globals before this module runs).

const { marked, DOMPurify, hljs } = globalThis;

marked.use({ gfm: true, breaks: false });
hljs.configure({ ignoreUnescapedHTML: true });

// Links in replies open in a new tab and tell the target nothing about this page.
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

function languageOf(code) {
  const name = [...code.classList].find((c) => c.startsWith("language-"));
  return name ? name.slice("language-".length) : null;
}

/** Copy `text` to the clipboard, saying on `button` whether it worked. */
export async function copyText(button, text) {
  const label = button.textContent;
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch (error) {
    button.textContent = "Copy failed";
    console.warn("clipboard write refused", error);
  }
  setTimeout(() => (button.textContent = label), 1500);
}

function copyButton(text) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "copy-code";
  button.textContent = "Copy";
  button.addEventListener("click", () => copyText(button, text));
  return button;
}

function decorateCodeBlock(code) {
  const language = languageOf(code);
  // A language highlight.js does not know is shown as plain text (and not logged each frame).
  if (language && !hljs.getLanguage(language)) code.className = "language-plaintext";
  hljs.highlightElement(code);
  const pre = code.parentElement;
  const bar = document.createElement("div");
  bar.className = "code-bar";
  const label = document.createElement("span");
  label.textContent = language ?? code.result?.language ?? "";
  bar.append(label);
  if (navigator.clipboard) bar.append(copyButton(code.textContent));
  pre.prepend(bar);
}

/** Replace `element`'s children with `text` rendered as Markdown (sanitized, highlighted). */
export function renderMarkdown(element, text) {
  const html = marked.parse(text, { async: false });
  element.innerHTML = DOMPurify.sanitize(html, { USE_PROFILE: { html: true } });
  for (const code of element.querySelectorAll("pre > code")) decorateCodeBlock(code);
}
