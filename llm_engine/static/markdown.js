// A small Markdown subset rendered as DOM nodes. Text only ever becomes Text nodes: nothing is parsed as HTML.
const el = (tag) => document.createElement(tag);
const FENCE = /^\s*```\s*([\w+#.-]*)\s*$/;
const BULLET = /^\s*[-*+]\s+/;
const NUMBER = /^\s*\d+[.)]\s+/;
const QUOTE = /^\s*>\s?/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const INLINE = /(`+)([\s\S]*?)\1|\*\*([\s\S]+?)\*\*|\*([^*\s][^*]*?)\*|\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g;

export function renderInline(text, parent) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    if (m[1]) { const c = el("code"); c.textContent = m[2]; parent.append(c); }
    else if (m[3] !== undefined) { const b = el("strong"); renderInline(m[3], b); parent.append(b); }
    else if (m[4] !== undefined) { const e = el("em"); renderInline(m[4], e); parent.append(e); }
    else { const a = el("a"); a.href = m[6]; a.rel = "noopener noreferrer"; a.target = "_blank"; a.textContent = m[5]; parent.append(a); }
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.append(text.slice(last));
}

function takeWhile(lines, i, re) {
  const out = [];
  while (i < lines.length && re.test(lines[i])) out.push(lines[i++].replace(re, ""));
  return out;
}

function list(tag, items) {
  const l = el(tag);
  for (const it of items) { const li = el("li"); renderInline(it, li); l.append(li); }
  return l;
}

export function renderMarkdown(src, root) {
  root.replaceChildren();
  const lines = src.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = line.match(FENCE))) {          // an unclosed fence (mid-stream) runs to the end
      const code = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
      i++;
      const pre = el("pre"), c = el("code");
      if (m[1]) c.dataset.lang = m[1];
      c.textContent = code.join("\n");
      pre.append(c); root.append(pre);
    } else if ((m = line.match(HEADING))) {
      const h = el("h" + Math.min(m[1].length + 2, 6)); renderInline(m[2], h); root.append(h); i++;
    } else if (BULLET.test(line)) {
      const items = takeWhile(lines, i, BULLET); i += items.length; root.append(list("ul", items));
    } else if (NUMBER.test(line)) {
      const items = takeWhile(lines, i, NUMBER); i += items.length; root.append(list("ol", items));
    } else if (QUOTE.test(line)) {
      const q = takeWhile(lines, i, QUOTE); i += q.length;
      const b = el("blockquote"); renderInline(q.join("\n"), b); root.append(b);
    } else if (!line.trim()) {
      i++;
    } else {
      const para = [];
      while (i < lines.length && lines[i].trim() && ![FENCE, HEADING, BULLET, NUMBER, QUOTE].some((r) => r.test(lines[i]))) para.push(lines[i++]);
      const p = el("p"); renderInline(para.join("\n"), p); root.append(p);
    }
  }
}
