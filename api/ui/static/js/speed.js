// Tokens per second of one streaming reply: live in the top bar, final in the reply's footer.
//
// Each streamed chunk carries about one token; the final usage chunk gives the exact count. The
// rate is over the time between the first and the last token, so the prompt's prefill does not
// count against it.

export class SpeedMeter {
  constructor(display) {
    this.display = display;
    this.first = null;
    this.last = null;
    this.chunks = 0;
    this.usageTokens = null;
    display.textContent = "";
  }

  /** A chunk with new text arrived. */
  count() {
    const now = performance.now();
    this.first ??= now;
    this.last = now;
    this.chunks += 1;
    const rate = this.rate(this.chunks);
    if (rate !== null) this.display.textContent = `${rate.toFixed(1)} tok/s`;
  }

  rate(tokens) {
    const seconds = (this.last - this.first) / 1000;
    return tokens > 1 && seconds > 0 ? (tokens - 1) / seconds : null;
  }

  /** The reply's stats once it ended: {tokens, tokensPerSecond}, or null without any token. */
  finish() {
    const tokens = this.usageTokens ?? this.chunks;
    if (!tokens) return null;
    const tokensPerSecond = this.rate(tokens);
    if (tokensPerSecond !== null) this.display.textContent = `${tokensPerSecond.toFixed(1)} tok/s`;
    return { tokens, tokensPerSecond };
  }
}
