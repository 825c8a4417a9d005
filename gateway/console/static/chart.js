// The tenant page's live usage chart: every 2 s it fetches the console's usage.json for the
// tenant (the admin API's tenant usage) and redraws two inline SVG charts (cache blocks against
// quota and reservation; hit ratio per sample) and the numbers above them. No library, no inline
// script: the CSP allows scripts from this origin only, and every visual property is an SVG
// attribute or a CSS class.
(function () {
  "use strict";
  var SVG = "http://www.w3.org/2000/svg";
  var WIDTH = 640, LEFT = 48, RIGHT = 12, TOP = 12, BOTTOM = 24;
  var MIN_SPAN_S = 30; // a young history still reads as a timeline, not a cliff at the edge

  function element(name, attributes, text) {
    var node = document.createElementNS(SVG, name);
    Object.keys(attributes).forEach(function (key) { node.setAttribute(key, attributes[key]); });
    if (text !== undefined) { node.textContent = text; }
    return node;
  }

  function clear(svg) {
    // Keep the <title>: it names the chart for screen readers.
    Array.prototype.slice.call(svg.childNodes).forEach(function (child) {
      if (child.nodeName.toLowerCase() !== "title") { svg.removeChild(child); }
    });
  }

  function niceMax(value) {
    if (value <= 4) { return 4; }
    var power = Math.pow(10, Math.floor(Math.log10(value)));
    var steps = [1, 2, 2.5, 5, 10];
    for (var i = 0; i < steps.length; i++) {
      if (steps[i] * power >= value) { return steps[i] * power; }
    }
    return 10 * power;
  }

  function frame(svg, height, yMax, yLabel, tStart, tEnd) {
    var plotHeight = height - TOP - BOTTOM;
    for (var i = 0; i <= 4; i++) {
      var y = TOP + plotHeight - (plotHeight * i) / 4;
      svg.appendChild(element("line", { x1: LEFT, x2: WIDTH - RIGHT, y1: y, y2: y, "class": "gridline" }));
      svg.appendChild(element("text", { x: LEFT - 6, y: y + 4, "text-anchor": "end", "class": "tick" }, yLabel((yMax * i) / 4)));
    }
    svg.appendChild(element("line", { x1: LEFT, x2: LEFT, y1: TOP, y2: TOP + plotHeight, "class": "axis" }));
    svg.appendChild(element("line", { x1: LEFT, x2: WIDTH - RIGHT, y1: TOP + plotHeight, y2: TOP + plotHeight, "class": "axis" }));
    var span = Math.max(1, tEnd - tStart);
    svg.appendChild(element("text", { x: LEFT, y: height - 6, "class": "tick" }, "−" + ago(span)));
    svg.appendChild(element("text", { x: WIDTH - RIGHT, y: height - 6, "text-anchor": "end", "class": "tick" }, "now"));
  }

  function ago(seconds) {
    return seconds >= 120 ? Math.round(seconds / 60) + " min" : Math.round(seconds) + " s";
  }

  function scaler(height, yMax, tStart, tEnd) {
    var plotHeight = height - TOP - BOTTOM, plotWidth = WIDTH - LEFT - RIGHT;
    var span = Math.max(1, tEnd - tStart);
    return function (t, value) {
      var x = LEFT + (plotWidth * (t - tStart)) / span;
      var y = TOP + plotHeight - (plotHeight * Math.min(value, yMax)) / yMax;
      return x.toFixed(1) + "," + y.toFixed(1);
    };
  }

  function line(svg, samples, scale, pick, className) {
    var points = [];
    samples.forEach(function (sample) {
      var value = pick(sample);
      if (value !== null && value !== undefined) { points.push(scale(sample.t, value)); }
    });
    var attributes = { points: points.join(" "), "class": className };
    attributes["data-points"] = String(points.length);
    svg.appendChild(element("polyline", attributes));
    return points;
  }

  function drawBlocks(svg, samples) {
    var height = 220;
    clear(svg);
    var tEnd = samples.length ? samples[samples.length - 1].t : 0;
    var tStart = samples.length ? Math.min(samples[0].t, tEnd - MIN_SPAN_S) : -MIN_SPAN_S;
    var top = 1;
    samples.forEach(function (s) {
      top = Math.max(top, s.quota_blocks, s.cached_blocks + s.active_blocks, s.reserved_blocks);
    });
    var yMax = niceMax(top * 1.05);
    frame(svg, height, yMax, function (v) { return String(Math.round(v)); }, tStart, tEnd);
    var scale = scaler(height, yMax, tStart, tEnd);
    line(svg, samples, scale, function (s) { return s.quota_blocks; }, "series-quota");
    line(svg, samples, scale, function (s) { return s.reserved_blocks; }, "series-reserved");
    line(svg, samples, scale, function (s) { return s.active_blocks; }, "series-active");
    line(svg, samples, scale, function (s) { return s.cached_blocks; }, "series-cached");
    if (!samples.length) {
      svg.appendChild(element("text", { x: WIDTH / 2, y: height / 2, "text-anchor": "middle", "class": "empty-note" }, "No samples yet"));
    }
    svg.setAttribute("data-samples", String(samples.length));
  }

  function drawRatio(svg, samples) {
    var height = 140;
    clear(svg);
    var tEnd = samples.length ? samples[samples.length - 1].t : 0;
    var tStart = samples.length ? Math.min(samples[0].t, tEnd - MIN_SPAN_S) : -MIN_SPAN_S;
    frame(svg, height, 1, function (v) { return Math.round(v * 100) + "%"; }, tStart, tEnd);
    var scale = scaler(height, 1, tStart, tEnd);
    var points = line(svg, samples, scale, function (s) { return s.hit_ratio; }, "series-ratio");
    points.forEach(function (point) {
      var xy = point.split(",");
      svg.appendChild(element("circle", { cx: xy[0], cy: xy[1], r: 2.5, "class": "point-ratio" }));
    });
    svg.setAttribute("data-samples", String(points.length));
  }

  function setText(id, text) {
    var node = document.getElementById(id);
    if (node) { node.textContent = text; }
  }

  function number(value) { return Number(value).toLocaleString("en-US"); }

  function percent(ratio) { return (100 * ratio).toFixed(1) + "%"; }

  function showNow(now, window) {
    setText("live-cached-blocks", number(now.cached_blocks));
    setText("live-active-blocks", number(now.active_blocks));
    setText("live-reserved-blocks", number(now.reserved_blocks));
    setText("live-quota-blocks", number(now.quota_blocks));
    setText("live-hit-ratio", percent(now.hit_ratio));
    setText("live-window-hit-ratio", percent(window.hit_ratio));
    setText("live-window-requests", number(window.requests));
    setText("live-window-saved", number(window.prefill_tokens_saved));
    setText("live-prompt-tokens", number(now.prompt_tokens));
    setText("live-cached-tokens", number(now.cached_tokens));
    setText("live-evicted-own", number(now.evicted_own_blocks));
    setText("live-evicted-pressure", number(now.evicted_pressure_blocks));
  }

  function start() {
    var blocks = document.getElementById("usage-chart");
    var ratio = document.getElementById("hit-chart");
    if (!blocks || !ratio) { return; }
    var source = blocks.getAttribute("data-source");
    var interval = Number(blocks.getAttribute("data-interval-ms")) || 2000;
    var busy = false, timer = null;

    function refresh() {
      if (busy || timer === "stopped") { return; }
      busy = true;
      fetch(source, { credentials: "same-origin", headers: { Accept: "application/json" }, redirect: "manual" })
        .then(function (response) {
          if (!response.ok) { throw new Error(response.status === 0 || response.type === "opaqueredirect" ? "session" : String(response.status)); }
          return response.json();
        })
        .then(function (usage) {
          usage.samples.forEach(function (sample) { sample.t = Date.parse(sample.time) / 1000; });
          drawBlocks(blocks, usage.samples);
          drawRatio(ratio, usage.samples);
          showNow(usage.cache, usage.summary);
          setText("chart-status", "Live: refreshed every " + interval / 1000 + " seconds; last at " + new Date().toLocaleTimeString() + ".");
        })
        .catch(function (error) {
          if (error.message === "session" || error.message === "404") {
            // Polling on would only add a refused-login audit event every 2 s.
            window.clearInterval(timer);
            timer = "stopped";
            setText("chart-status", error.message === "session"
              ? "Your session has ended: reload the page to log in again."
              : "This tenant is gone: the chart has stopped.");
            return;
          }
          setText("chart-status", "Could not refresh the chart (" + error.message + "); retrying.");
        })
        .then(function () { busy = false; });
    }

    refresh();
    timer = window.setInterval(refresh, interval);
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
