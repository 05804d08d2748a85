// A task's output text in a <pre>: written as it streams, at most once an animation frame, in
// blocks, so a long task's page keeps up with its stream (task.js).

import { h } from "./dom.js";

const CHUNK = 8192; // chars of a block of an output before the next block starts (at a line's end)

/** Text for `pre`, written at most once an animation frame (appendText), not per event: a text
 *  node per event, with scrollHeight read around each, laid out the whole <pre> per token and a
 *  long task's page fell behind its stream. The view sticks to the bottom when it was there. */
export function textSink(pre) {
  let pending = "", frame = 0;
  const write = () => {
    frame = 0;
    if (!pending) return;
    const atBottom = pre.scrollHeight - pre.scrollTop - pre.clientHeight < 40; // laid out last frame
    appendText(pre, pending);
    pending = "";
    if (atBottom) pre.scrollTop = pre.scrollHeight; // one layout a frame, of the last block only
  };
  return {
    add(text) {
      pending += text;
      if (!frame) frame = requestAnimationFrame(write);
    },
    flush() {
      cancelAnimationFrame(frame);
      write();
    },
  };
}

/** Appends `text` to `pre`'s blocks (span.chunk, display: block), each one text node grown with
 *  appendData. A block ends at the first line end after CHUNK chars, so the blocks render and copy
 *  as the text does, and a write lays out the last block, not the whole output. (task.js
 *  re-exports it for test_webui_tasks.py.) */
export function appendText(pre, text) {
  const block = () => pre.appendChild(h("span", { class: "chunk" }, document.createTextNode(""))).firstChild;
  let node = pre.lastElementChild ? pre.lastElementChild.firstChild : block();
  for (;;) {
    const cut = text.indexOf("\n", Math.max(0, CHUNK - node.length));
    if (cut < 0 || cut === text.length - 1) return node.appendData(text);
    node.appendData(text.slice(0, cut + 1));
    text = text.slice(cut + 1);
    node = block();
  }
}
