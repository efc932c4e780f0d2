// The code pane: an editor in which the model's completion appears as grey ghost text at the
// caret when typing pauses; Tab accepts it, Escape or any other key dismisses it. Each pause
// asks POST /infill (llama.cpp's code completion) with the text split around the caret as
// llama.vim splits it, and a new keystroke aborts the request in flight: the server drops
// its work when the connection closes.
//
// The editor is a <textarea> whose text is transparent, over a <pre> that draws the same
// text with the ghost text inserted at the caret: the textarea keeps the caret, selection,
// undo and accessibility; the <pre> lets the ghost push the rest of the line aside (or take
// its place, when the completion writes it again).

import { ApiError } from "./api.js";

const DEBOUNCE_MS = 200;
const TAB_STOP = 4;
// llama.vim's: with more than this after the caret on its line, no completion is asked for
// (the caret is inside code, not at the end of what is being written).
const MAX_LINE_SUFFIX = 8;

const $ = (id) => document.getElementById(id);

// The request's text fields, split as llama.vim splits them: the lines before the caret's
// line, that line up to the caret (empty when it is only indentation), and the rest of the
// line with the lines after it; n_indent is the line's indentation before the caret.
export function split(text, caret) {
  const start = caret === 0 ? 0 : text.lastIndexOf("\n", caret - 1) + 1;
  let end = text.indexOf("\n", caret);
  if (end < 0) end = text.length;
  const before = text.slice(start, caret);
  return {
    input_prefix: text.slice(0, start),
    prompt: before.trim() ? before : "",
    input_suffix: text.slice(caret, end) + "\n" + text.slice(end + 1),
    n_indent: before.length - before.trimStart().length,
  };
}

// What is shown of a completion: without trailing whitespace, and on a line that holds only
// indentation (left out of the prompt) without the indentation the model wrote again.
export function ghostOf(content, before) {
  let ghost = content.trimEnd();
  if (!before.trim()) {
    const lead = /^[ \t]*/.exec(ghost)[0].length;
    ghost = ghost.slice(Math.min(lead, before.length));
  }
  return ghost;
}

export class CodePane {
  constructor(api) {
    this.api = api;
    this.editor = $("code-editor");
    this.mirror = $("code-mirror");
    this.pane = $("code");
    this.controller = null; // the /infill request in flight
    this.timer = 0;
    this.ghost = ""; // shown at the caret
    this.seen = null; // the editor as last handled: {value, start, end}
    this.escaped = false; // Escape, then Tab: the focus leaves the editor
    const editor = this.editor;
    editor.addEventListener("input", (e) => e.isComposing || this.changed());
    editor.addEventListener("compositionend", () => this.changed());
    editor.addEventListener("keydown", (e) => this.key(e));
    editor.addEventListener("scroll", () => this.scroll());
    editor.addEventListener("blur", () => this.dismiss());
    document.addEventListener("selectionchange", () => {
      if (document.activeElement === editor) this.changed();
    });
    this.render();
    this.setState("idle");
  }

  // The text or the caret changed (a keystroke, a click, a paste, an accepted completion).
  changed() {
    const editor = this.editor;
    const now = { value: editor.value, start: editor.selectionStart, end: editor.selectionEnd };
    const seen = this.seen;
    if (seen && now.value === seen.value && now.start === seen.start && now.end === seen.end) {
      return;
    }
    this.seen = now;
    this.cancel();
    // A typed character that is the ghost's next one keeps the rest of it, as editors do.
    const typed = seen && typedOne(seen, now);
    this.ghost = typed && this.ghost.startsWith(typed) ? this.ghost.slice(typed.length) : "";
    this.render();
    const wanted = now.value.trim() && now.start === now.end;
    if (wanted && this.lineSuffix().trim().length <= MAX_LINE_SUFFIX) {
      this.timer = setTimeout(() => this.complete(), DEBOUNCE_MS);
      this.setState("pending");
    } else {
      this.setState("idle");
    }
  }

  key(e) {
    if (e.key === "Escape") {
      this.dismiss();
      this.escaped = true;
      return;
    }
    const plain = !(e.shiftKey || e.ctrlKey || e.altKey || e.metaKey);
    if (e.key === "Tab" && plain) {
      if (this.ghost) {
        e.preventDefault();
        this.accept();
      } else if (!this.escaped) {
        e.preventDefault();
        const column = this.editor.selectionStart - this.lineStart();
        this.insert(" ".repeat(TAB_STOP - (column % TAB_STOP)));
      }
    }
    this.escaped = false;
  }

  // Tab: the ghost text goes into the editor (one undo step) and the caret after it.
  accept() {
    const ghost = this.ghost;
    const caret = this.editor.selectionStart;
    this.editor.setSelectionRange(caret, caret + this.covered());
    this.ghost = "";
    this.insert(ghost);
  }

  // How much of the caret's line after it the ghost text takes the place of: all of it when
  // the ghost's first line starts or ends with it (it closes the brackets already there,
  // perhaps with a comment after them), else none.
  covered() {
    const rest = this.lineSuffix().trimEnd();
    const first = this.ghost.split("\n", 1)[0];
    const repeats = rest && (first.startsWith(rest) || first.endsWith(rest));
    return repeats ? this.lineSuffix().length : 0;
  }

  insert(text) {
    // execCommand keeps the browser's undo history; setRangeText is the fallback.
    if (!document.execCommand("insertText", false, text)) {
      const { selectionStart, selectionEnd } = this.editor;
      this.editor.setRangeText(text, selectionStart, selectionEnd, "end");
      this.changed();
    }
  }

  // Escape, leaving the editor: no ghost, and no request running or about to be sent (an
  // error stays shown).
  dismiss() {
    this.cancel();
    this.ghost = "";
    this.render();
    if (this.state !== "error") this.setState("idle");
  }

  cancel() {
    clearTimeout(this.timer);
    if (this.controller) this.controller.abort();
    this.controller = null;
  }

  lineStart() {
    const caret = this.editor.selectionStart;
    return caret === 0 ? 0 : this.editor.value.lastIndexOf("\n", caret - 1) + 1;
  }

  lineSuffix() {
    const { value, selectionEnd } = this.editor;
    const end = value.indexOf("\n", selectionEnd);
    return value.slice(selectionEnd, end < 0 ? value.length : end);
  }

  settings() {
    const number = (id, fallback) => {
      const value = Number($(id).value);
      return $(id).value.trim() === "" || !Number.isFinite(value) ? fallback : value;
    };
    const budget = number("code-budget", 1000);
    return {
      n_predict: Math.max(1, number("code-max-tokens", 64)),
      t_max_predict_ms: budget > 0 ? budget : -1,
    };
  }

  async complete() {
    const { value, selectionStart: caret } = this.editor;
    const body = {
      ...split(value, caret),
      ...this.settings(),
      temperature: 0, // greedy: the likeliest completion, the same every time
      cache_prompt: true,
    };
    const controller = new AbortController();
    this.controller = controller;
    this.setState("waiting");
    const sent = performance.now();
    let answer;
    try {
      answer = await this.api.post("/infill", body, controller.signal);
    } catch (error) {
      if (controller.signal.aborted) return;
      this.controller = null;
      this.fail(error);
      return;
    }
    if (controller.signal.aborted) return;
    this.controller = null;
    this.ghost = ghostOf(answer.content, value.slice(this.lineStart(), caret));
    this.showNumbers(performance.now() - sent, answer);
    this.render();
    this.setState(this.ghost ? "shown" : "empty");
    if (this.ghost) {
      const lines = this.ghost.split("\n").length;
      const size = lines > 1 ? `${lines} lines` : JSON.stringify(this.ghost);
      $("code-status").textContent = `completion: ${size}. Tab accepts it, Esc dismisses it`;
    }
  }

  fail(error) {
    let message = error.message;
    if (error instanceof ApiError && error.status === 401) {
      message = "an API key is needed (the field on the left)";
    } else if (!(error instanceof ApiError)) {
      message = `the request failed: ${error.message}`;
    }
    $("code-status").textContent = message;
    $("code-status").dataset.kind = "error";
    this.setState("error");
  }

  showNumbers(latency, answer) {
    const t = answer.timings;
    const numbers = $("code-numbers");
    Object.assign(numbers.dataset, {
      latency: Math.round(latency),
      cached: t.cache_n,
      read: t.prompt_n,
      generated: t.predicted_n,
    });
    const parts = [
      `latency ${Math.round(latency)} ms`,
      `cached ${t.cache_n}`,
      `read ${t.prompt_n}`,
      `generated ${t.predicted_n}`,
      `stop: ${answer.stop_type}`,
    ];
    if (answer.truncated) parts.push("the prompt was cut to fit");
    numbers.textContent = parts.join(" · ");
  }

  // The pane's state (data-state: idle, pending, waiting, shown, empty or error) and its
  // line of text; an error stays while the next completion is asked for.
  setState(state) {
    this.state = state;
    this.pane.dataset.state = state;
    const status = $("code-status");
    if (state === "error") return; // fail() wrote it
    if (status.dataset.kind === "error" && (state === "pending" || state === "waiting")) return;
    status.textContent = HINTS[state] || "";
    status.dataset.kind = "note";
  }

  // The <pre> under the editor: its text, the ghost text at the caret.
  render() {
    const { value, selectionStart } = this.editor;
    // Blank lines at the end let the <pre> scroll as far as the textarea does.
    const tail = "\n\n\n";
    if (this.ghost) {
      const ghost = document.createElement("span");
      ghost.className = "ghost";
      ghost.textContent = this.ghost;
      this.mirror.replaceChildren(
        value.slice(0, selectionStart),
        ghost,
        value.slice(selectionStart + this.covered()) + tail,
      );
    } else {
      this.mirror.replaceChildren(value + tail);
    }
    this.scroll();
  }

  scroll() {
    this.mirror.scrollTop = this.editor.scrollTop;
    this.mirror.scrollLeft = this.editor.scrollLeft;
  }
}

const HINTS = {
  waiting: "completing…",
  empty: "no completion here",
};

// The character typed between two states of the editor, or "" when the change was not the
// typing of one character at a caret.
function typedOne(before, after) {
  if (before.start !== before.end || after.start !== after.end) return "";
  if (after.start !== before.start + 1) return "";
  if (after.value.length !== before.value.length + 1) return "";
  const char = after.value[before.start];
  const { value, start } = before;
  return after.value === value.slice(0, start) + char + value.slice(start) ? char : "";
}
