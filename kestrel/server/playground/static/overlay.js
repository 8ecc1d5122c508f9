// Points and boxes over the image: an SVG in the image's own pixel coordinates (its viewBox is
// the natural size), stretched over the displayed picture, so marks stay put at any zoom.

const SVG = "http://www.w3.org/2000/svg";

function element(name, attrs, text) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

function label(svg, x, y, text, size) {
  const group = element("g", { class: "label" });
  const t = element("text", { x, y, "font-size": size }, text);
  group.append(t);
  svg.append(group);
  // A backing plate sized to the text, so labels read on any background.
  const b = t.getBBox();
  const pad = size * 0.2;
  group.insertBefore(element("rect", {
    x: b.x - pad, y: b.y - pad, width: b.width + 2 * pad, height: b.height + 2 * pad,
  }), t);
}

// Replace the marks with `marks` = {kind: "point" | "box", items, name} ([0, 1] coordinates);
// null clears them.
export function drawMarks(svg, img, marks) {
  svg.replaceChildren();
  const w = img.naturalWidth;
  const h = img.naturalHeight;
  if (!w || !h) return;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.setAttribute("preserveAspectRatio", "none");
  if (!marks) return;
  // Labels 13 screen pixels tall, whatever the image's size on screen.
  const size = 13 / ((img.clientWidth || w) / w);
  marks.items.forEach((item, i) => {
    const name = `${marks.name} ${i + 1}`;
    if (marks.kind === "point") {
      const x = item.x * w;
      const y = item.y * h;
      svg.append(element("circle", { class: "point", cx: x, cy: y, r: size * 0.45 },
        undefined));
      svg.lastChild.append(element("title", {}, name));
      label(svg, x + size * 0.6, y - size * 0.5, name, size);
    } else {
      const x = item.x_min * w;
      const y = item.y_min * h;
      const box = element("rect", {
        class: "box", x, y, width: (item.x_max - item.x_min) * w,
        height: (item.y_max - item.y_min) * h,
      });
      box.append(element("title", {}, name));
      svg.append(box);
      label(svg, x + size * 0.2, y + size * 1.0, name, size);
    }
  });
}
