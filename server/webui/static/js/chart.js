// A live line chart on a canvas: a fixed time window ending now, one line per series, a legend
// with each series' latest value. Missing values (null) leave a gap.

import { h } from "./dom.js";

const COLORS = ["#2f7ed8", "#e4572e", "#17a589", "#a05195", "#f0a202", "#5d6d7e", "#c0392b", "#1abc9c"];
const PAD = { left: 48, right: 10, top: 10, bottom: 20 };

export class LineChart {
  /** `id` names the figure (tests and links); `format` renders a value for the legend and axis. */
  constructor(id, title, { windowS = 300, format = (v) => v.toFixed(1), yMax = null } = {}) {
    this.windowS = windowS;
    this.format = format;
    this.yMax = yMax;
    this.canvas = h("canvas", { class: "chart", id: `chart-${id}`, width: 600, height: 180 });
    this.legend = h("div", { class: "legend" });
    this.el = h("figure", { class: "card chart-card" }, h("figcaption", {}, title), this.canvas, this.legend);
  }

  /** times: epoch seconds; series: {name: [values aligned with times]}. */
  draw(times, series) {
    const names = Object.keys(series);
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 600, height = canvas.clientHeight || 180;
    if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
    if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const now = times.length ? times[times.length - 1] : Date.now() / 1000;
    const values = names.flatMap((n) => series[n]).filter((v) => Number.isFinite(v));
    const top = this.yMax ?? niceMax(Math.max(0, ...values));
    const x = (t) => PAD.left + ((t - (now - this.windowS)) / this.windowS) * (width - PAD.left - PAD.right);
    const y = (v) => height - PAD.bottom - (v / (top || 1)) * (height - PAD.top - PAD.bottom);
    this.axes(ctx, width, height, top, y);
    names.forEach((name, i) => {
      ctx.strokeStyle = ctx.fillStyle = COLORS[i % COLORS.length];
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      const shown = series[name].map((v, j) => Number.isFinite(v) && times[j] >= now - this.windowS);
      series[name].forEach((v, j) => {
        if (!shown[j]) return;
        shown[j - 1] ? ctx.lineTo(x(times[j]), y(v)) : ctx.moveTo(x(times[j]), y(v));
        // a value with gaps on both sides (a latency seen in one interval only) is a dot, not nothing
        if (!shown[j - 1] && !shown[j + 1]) ctx.fillRect(x(times[j]) - 2, y(v) - 2, 4, 4);
      });
      ctx.stroke();
    });
    canvas.dataset.points = times.length;
    canvas.dataset.max = values.length ? Math.max(...values) : 0;
    this.legend.replaceChildren(...names.map((name, i) => {
      const last = [...series[name]].reverse().find((v) => Number.isFinite(v));
      return h("span", { class: "key" }, h("i", { style: `background:${COLORS[i % COLORS.length]}` }),
        `${name}: ${last === undefined ? "–" : this.format(last)}`);
    }));
  }

  axes(ctx, width, height, top, y) {
    const style = getComputedStyle(document.body);
    ctx.strokeStyle = style.getPropertyValue("--grid") || "#ddd";
    ctx.fillStyle = style.getPropertyValue("--muted") || "#777";
    ctx.font = "11px system-ui, sans-serif";
    ctx.lineWidth = 1;
    for (const f of [0, 0.5, 1]) {
      const v = top * f;
      ctx.beginPath();
      ctx.moveTo(PAD.left, y(v));
      ctx.lineTo(width - PAD.right, y(v));
      ctx.stroke();
      ctx.fillText(this.format(v), 4, y(v) + 4);
    }
    ctx.fillText(`-${Math.round(this.windowS / 60)} min`, PAD.left, height - 4);
    ctx.fillText("now", width - PAD.right - 24, height - 4);
  }
}

/** 1, 2 or 5 times a power of ten, at least `v` (and at least 1). */
export function niceMax(v) {
  if (!(v > 1)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 5, 10].map((m) => m * p).find((m) => m >= v);
}
