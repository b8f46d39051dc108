// The conversation list: select one, delete one, start a new chat.

export class Sidebar {
  /** `handlers`: {onSelect(id), onDelete(id), onNew()}. */
  constructor(list, newButton, handlers) {
    this.list = list;
    this.handlers = handlers;
    newButton.addEventListener("click", () => handlers.onNew());
  }

  /** Show `conversations` (newest first), marking the one with `activeId`. */
  render(conversations, activeId) {
    this.list.replaceChildren(
      ...conversations.map((conversation) => this.item(conversation, activeId)),
    );
  }

  item(conversation, activeId) {
    const item = document.createElement("li");
    item.className = "conversation";
    item.dataset.id = conversation.id;
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = conversation.title;
    open.title = conversation.title;
    if (conversation.id === activeId) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => this.handlers.onSelect(conversation.id));
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "delete";
    remove.textContent = "×";
    remove.title = "Delete this conversation";
    remove.setAttribute("aria-label", `Delete conversation: ${conversation.title}`);
    remove.addEventListener("click", () => this.handlers.onDelete(conversation.id));
    item.append(open, remove);
    return item;
  }
}
