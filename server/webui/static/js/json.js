// JSON with integers beyond Number.MAX_SAFE_INTEGER kept exact: as BigInt values. A seed may be
// up to 2^63-1, which a Number rounds (9007199254740993 became ...992): the forms send what was
// typed (dom.js formFields), the task page shows what the server stored.

/** `value` as JSON text, as JSON.stringify writes it, with BigInt values as their digits. */
export function stringify(value) {
  if (typeof value === "bigint") return value.toString();
  if (Array.isArray(value)) {
    return `[${value.map((v) => (v === undefined || typeof v === "function" ? "null" : stringify(v))).join(",")}]`;
  }
  if (value && typeof value === "object" && typeof value.toJSON !== "function") {
    const parts = Object.entries(value).filter(([, v]) => v !== undefined && typeof v !== "function")
      .map(([k, v]) => `${JSON.stringify(k)}:${stringify(v)}`);
    return `{${parts.join(",")}}`;
  }
  return JSON.stringify(value);
}

const LONG_DIGITS = /\d{16}/; // an integer beyond 2^53 has 16 digits or more
const NUMBER = /-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null/y;
const SPACE = /[ \t\n\r]*/y;

/** JSON.parse, with each integer literal beyond Number.MAX_SAFE_INTEGER as a BigInt. */
export function parse(text) {
  if (!LONG_DIGITS.test(text)) return JSON.parse(text); // (the usual case: nothing to keep)
  let i = 0;
  const fail = () => { throw new SyntaxError(`bad JSON at position ${i}`); };
  const skip = () => { SPACE.lastIndex = i; SPACE.exec(text); i = SPACE.lastIndex; };
  const expect = (c) => { skip(); if (text[i] !== c) fail(); i++; };
  const string = () => {
    if (text[i] !== "\"") fail();
    let end = i + 1;
    for (;;) { // the closing quote: one after an even number of backslashes
      end = text.indexOf("\"", end);
      if (end < 0) fail();
      let slashes = 0;
      while (text[end - 1 - slashes] === "\\") slashes++;
      if (slashes % 2 === 0) break;
      end++;
    }
    const s = JSON.parse(text.slice(i, end + 1));
    i = end + 1;
    return s;
  };
  const value = () => {
    skip();
    const c = text[i];
    if (c === "\"") return string();
    if (c === "{" || c === "[") {
      i++;
      const object = c === "{", out = object ? {} : [];
      skip();
      if (text[i] === (object ? "}" : "]")) { i++; return out; }
      for (;;) {
        if (object) {
          skip();
          const key = string();
          expect(":");
          Object.defineProperty(out, key, { value: value(), enumerable: true, writable: true, configurable: true });
        } else {
          out.push(value());
        }
        skip();
        if (text[i] === ",") { i++; continue; }
        expect(object ? "}" : "]");
        return out;
      }
    }
    NUMBER.lastIndex = i;
    const m = NUMBER.exec(text);
    if (!m) fail();
    i = NUMBER.lastIndex;
    const n = JSON.parse(m[0]);
    return typeof n === "number" && /^-?\d+$/.test(m[0]) && !Number.isSafeInteger(n) ? BigInt(m[0]) : n;
  };
  const out = value();
  skip();
  if (i !== text.length) fail();
  return out;
}
