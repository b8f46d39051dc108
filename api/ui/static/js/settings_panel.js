// The parameters panel: system prompt, sampling fields and the API key. Every field is saved as
// it changes; a blank sampling field leaves the value to the server's defaults.

import { saveSettings } from "./store.js";

export class SettingsPanel {
  /** `onApiKeyChange()`: the user changed the API key (on blur or Enter, not per keystroke). */
  constructor(panel, toggle, settings, onApiKeyChange, onError) {
    this.panel = panel;
    this.toggle = toggle;
    this.inputs = new Map();
    for (const input of panel.querySelectorAll("[data-setting]")) {
      const key = input.dataset.setting;
      this.inputs.set(key, input);
      input.value = settings[key];
      input.addEventListener("input", () => {
        settings[key] = input.value;
        try {
          saveSettings(settings);
        } catch (error) {
          onError(error);
        }
      });
    }
    this.inputs.get("apiKey").addEventListener("change", onApiKeyChange);
    // Enter in a field applies it (the API key's change event fires on blur) instead of submitting.
    panel.querySelector("form").addEventListener("submit", (event) => {
      event.preventDefault();
      document.activeElement?.blur();
    });
    toggle.addEventListener("click", () => this.show(this.panel.hidden));
  }

  /** Open or close the panel; `focusKey` names the field to focus when opening. */
  show(open, focusKey = null) {
    this.panel.hidden = !open;
    this.toggle.setAttribute("aria-expanded", String(open));
    if (open && focusKey) this.inputs.get(focusKey).focus();
  }
}

function number(text) {
  return text.trim() === "" ? undefined : Number(text);
}

/** The request fields the settings set (blank fields are left out). */
export function samplingFields(settings) {
  const fields = {
    temperature: number(settings.temperature),
    top_p: number(settings.topP),
    top_k: number(settings.topK),
    max_tokens: number(settings.maxTokens),
  };
  return Object.fromEntries(Object.entries(fields).filter(([, value]) => value !== undefined));
}
