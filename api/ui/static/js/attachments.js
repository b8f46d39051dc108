// Images attached to the next message: picked with the button, pasted into the prompt or dropped
// on the composer. Each is read as a data: URL and shown as a thumbnail that can be removed until
// the message is sent; the server decides whether the model takes images (a text-only model
// answers 400, shown like any other error).

export const MAX_IMAGES = 4; // the server's default --limit-mm-per-prompt
export const MAX_BYTES = 8 * 1024 * 1024;
const TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"];

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

export class Attachments {
  /** `container`: where thumbnails go; `notify(error)` shows a refused file. */
  constructor(container, notify) {
    this.container = container;
    this.notify = notify;
    this.urls = [];
  }

  /** Add the image files among `files` (a FileList or array); others are refused by name. */
  async add(files) {
    for (const file of Array.from(files)) {
      if (!TYPES.includes(file.type)) {
        this.notify(new Error(`${file.name || "The file"} is not a PNG, JPEG, WebP or GIF image.`));
        continue;
      }
      if (file.size > MAX_BYTES) {
        this.notify(new Error(`${file.name || "The image"} is larger than 8 MB.`));
        continue;
      }
      if (this.urls.length >= MAX_IMAGES) {
        this.notify(new Error(`At most ${MAX_IMAGES} images per message.`));
        break;
      }
      this.urls.push(await readAsDataUrl(file));
    }
    this.render();
  }

  /** The attached images' data: URLs, and an empty composer. */
  take() {
    const urls = this.urls;
    this.urls = [];
    this.render();
    return urls;
  }

  render() {
    this.container.replaceChildren();
    this.container.hidden = this.urls.length === 0;
    this.urls.forEach((url, index) => {
      const item = document.createElement("figure");
      item.className = "attachment";
      const image = document.createElement("img");
      image.src = url;
      image.alt = `attached image ${index + 1}`;
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "remove";
      remove.textContent = "×";
      remove.setAttribute("aria-label", `Remove image ${index + 1}`);
      remove.addEventListener("click", () => {
        this.urls.splice(index, 1);
        this.render();
      });
      item.append(image, remove);
      this.container.append(item);
    });
  }
}

/** Only images the page itself read may be shown or sent again (no remote URLs). */
export function isImageDataUrl(url) {
  return typeof url === "string" && /^data:image\/(png|jpeg|webp|gif);base64,/.test(url);
}
