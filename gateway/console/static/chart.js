// The tenant page's live parts: every 2 s it fetches the console's usage.json for the tenant
// (the admin API's tenant usage, the server's time and its keys' last use) and redraws two
// inline SVG charts (cache blocks against quota and reservation; hit ratio per sample), the
// numbers above them, the table of the tenant's usage in each model's pool and the keys table's
// "Last used" column. No library, no inline script: the CSP allows scripts from this origin
// only, and every visual property is an SVG attribute or a CSS class.
//
// The charts' time axis ends at the server's "now", and the blocks chart's lines end there at
// the blocks, quota and reservation of now (what the numbers above say), so a quota saved a
// moment ago is drawn at once, not when the usage history takes its next sample. The blocks
// chart's y-axis (in blocks, as its title says) fits what the operator needs to see: the
// largest cached, active or reserved count in the window, or the quota now, whichever is
// higher, rounded up to a 1-2-5 step (so the ticks are round numbers). An older, larger quota
// does not stretch the axis (its line comes down from above the plot, which clips it). Quota
// and reservation change at a moment, so they are drawn as steps (level, then straight down or
// up), not as slanted ramps. Times are shown in UTC, as everywhere in the console.
(function () {
  "use strict";
  var SVG = "http://www.w3.org/2000/svg";
  var WIDTH = 640, LEFT = 64, RIGHT = 12, TOP = 12, BOTTOM = 24;
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

  // The axis for values up to `top`: a 1-2-5 step of at least `minStep`, at most 6 intervals.
  function niceAxis(top, minStep) {
    top = Math.max(top, minStep);
    var rough = top / 6;
    var power = Math.pow(10, Math.floor(Math.log10(rough)));
    var step = [1, 2, 5, 10].map(function (m) { return m * power; })
      .filter(function (candidate) { return candidate >= rough; })[0];
    step = Math.max(step, minStep);
    return { max: Math.ceil(top / step - 1e-9) * step, step: step };
  }

  // The grid, the axes and their labels; `unit` names what the y-axis counts.
  function frame(svg, height, axis, yLabel, unit, tStart, tEnd) {
    var plotHeight = height - TOP - BOTTOM;
    var intervals = Math.round(axis.max / axis.step);
    for (var i = 0; i <= intervals; i++) {
      var value = axis.step * i;
      var y = TOP + plotHeight - (plotHeight * value) / axis.max;
      svg.appendChild(element("line", { x1: LEFT, x2: WIDTH - RIGHT, y1: y, y2: y, "class": "gridline" }));
      svg.appendChild(element("text", { x: LEFT - 6, y: y + 4, "text-anchor": "end", "class": "tick tick-y" }, yLabel(value)));
    }
    svg.appendChild(element("line", { x1: LEFT, x2: LEFT, y1: TOP, y2: TOP + plotHeight, "class": "axis" }));
    // Written up the y-axis (rotated about the origin, so x runs along the axis, upwards).
    var middle = TOP + plotHeight / 2;
    svg.appendChild(element("text", { x: -middle, y: 14, transform: "rotate(-90)", "text-anchor": "middle", "class": "axis-title" }, unit));
    svg.appendChild(element("line", { x1: LEFT, x2: WIDTH - RIGHT, y1: TOP + plotHeight, y2: TOP + plotHeight, "class": "axis" }));
    var span = Math.max(1, tEnd - tStart);
    svg.appendChild(element("text", { x: LEFT, y: height - 6, "class": "tick" }, "−" + ago(span)));
    svg.appendChild(element("text", { x: WIDTH - RIGHT, y: height - 6, "text-anchor": "end", "class": "tick" }, "now"));
    svg.setAttribute("data-y-max", String(axis.max));
    // Series are clipped to the plot (a little above it, for a line drawn at the top).
    var clipId = svg.id + "-plot";
    var defs = element("defs", {});
    var clip = element("clipPath", { id: clipId });
    clip.appendChild(element("rect", { x: LEFT, y: TOP - 3, width: WIDTH - RIGHT - LEFT, height: plotHeight + 6 }));
    defs.appendChild(clip);
    svg.appendChild(defs);
    return "url(#" + clipId + ")";
  }

  function ago(seconds) {
    return seconds >= 120 ? Math.round(seconds / 60) + " min" : Math.round(seconds) + " s";
  }

  function scaler(height, yMax, tStart, tEnd) {
    var plotHeight = height - TOP - BOTTOM, plotWidth = WIDTH - LEFT - RIGHT;
    var span = Math.max(1, tEnd - tStart);
    return function (t, value) {
      var x = LEFT + (plotWidth * (t - tStart)) / span;
      var y = TOP + plotHeight - (plotHeight * value) / yMax;
      return x.toFixed(1) + "," + y.toFixed(1);
    };
  }

  // A polyline through the samples' values; as `steps`, each value holds until the next sample
  // (level to its time, then straight to its value). `data-points` counts the samples drawn
  // (not the point of now that ends a line).
  function line(svg, samples, scale, pick, className, clip, steps) {
    var points = [], drawn = 0, previous = null;
    samples.forEach(function (sample) {
      var value = pick(sample);
      if (value === null || value === undefined) { return; }
      if (steps && previous !== null && previous !== value) { points.push(scale(sample.t, previous)); }
      points.push(scale(sample.t, value));
      previous = value;
      if (!sample.now) { drawn += 1; }
    });
    var attributes = { points: points.join(" "), "class": className, "clip-path": clip };
    attributes["data-points"] = String(drawn);
    svg.appendChild(element("polyline", attributes));
    return points;
  }

  // The time axis: from the oldest sample (or at least MIN_SPAN_S back) to the server's now.
  function timeSpan(samples, tEnd) {
    return samples.length ? Math.min(samples[0].t, tEnd - MIN_SPAN_S) : tEnd - MIN_SPAN_S;
  }

  // `now`: the tenant's blocks at the server's time `now.t`, where the lines end.
  function drawBlocks(svg, samples, now) {
    var height = 220;
    clear(svg);
    var tEnd = now.t, tStart = timeSpan(samples, tEnd);
    var top = now.quota_blocks;
    samples.concat([now]).forEach(function (s) {
      top = Math.max(top, s.cached_blocks, s.active_blocks, s.reserved_blocks);
    });
    var axis = niceAxis(top, 1);
    var clip = frame(svg, height, axis, number, "blocks", tStart, tEnd);
    var scale = scaler(height, axis.max, tStart, tEnd);
    var series = samples.length ? samples.concat([now]) : [];
    line(svg, series, scale, function (s) { return s.quota_blocks; }, "series-quota", clip, true);
    line(svg, series, scale, function (s) { return s.reserved_blocks; }, "series-reserved", clip, true);
    line(svg, series, scale, function (s) { return s.active_blocks; }, "series-active", clip, false);
    line(svg, series, scale, function (s) { return s.cached_blocks; }, "series-cached", clip, false);
    if (!samples.length) {
      svg.appendChild(element("text", { x: WIDTH / 2, y: height / 2, "text-anchor": "middle", "class": "empty-note" }, "No samples yet"));
    }
    svg.setAttribute("data-samples", String(samples.length));
  }

  function drawRatio(svg, samples, tEnd) {
    var height = 140;
    clear(svg);
    var tStart = timeSpan(samples, tEnd);
    var percent = function (v) { return Math.round(v * 100) + "%"; };
    var clip = frame(svg, height, { max: 1, step: 0.25 }, percent, "hit ratio", tStart, tEnd);
    var scale = scaler(height, 1, tStart, tEnd);
    var points = line(svg, samples, scale, function (s) { return s.hit_ratio; }, "series-ratio", clip, false);
    points.forEach(function (point) {
      var xy = point.split(",");
      svg.appendChild(element("circle", { cx: xy[0], cy: xy[1], r: 2.5, "class": "point-ratio" }));
    });
    svg.setAttribute("data-samples", String(points.length));
  }

  // The keys table's "Last used" column (the server writes the time as the page does, in UTC).
  function showKeys(keys) {
    var lastUsed = {};
    keys.forEach(function (key) { lastUsed[key.key_id] = key.last_used; });
    Array.prototype.forEach.call(document.querySelectorAll("#keys-table tr[data-key-id]"), function (row) {
      var cell = row.querySelector("td.last-used");
      var id = row.getAttribute("data-key-id");
      if (cell && Object.prototype.hasOwnProperty.call(lastUsed, id)) { cell.textContent = lastUsed[id]; }
    });
  }

  function setText(id, text) {
    var node = document.getElementById(id);
    if (node) { node.textContent = text; }
  }

  function number(value) { return Number(value).toLocaleString("en-US"); }

  // A ratio of a whole (a hit ratio of prompt tokens, a share of service), or "—" when the
  // whole was nothing (as the page renders it).
  function percentOf(value, whole) {
    return whole > 0 ? (100 * value).toFixed(1) + "%" : "—";
  }

  function showNow(now, window) {
    setText("live-cached-blocks", number(now.cached_blocks));
    setText("live-active-blocks", number(now.active_blocks));
    setText("live-reserved-blocks", number(now.reserved_blocks));
    setText("live-quota-blocks", number(now.quota_blocks));
    setText("live-hit-ratio", percentOf(now.hit_ratio, now.prompt_tokens));
    setText("live-window-hit-ratio", percentOf(window.hit_ratio, window.prompt_tokens));
    setText("live-window-requests", number(window.requests));
    setText("live-window-saved", number(window.prefill_tokens_saved));
    setText("live-window-service-share", percentOf(window.service_share, window.service));
    setText("live-prompt-tokens", number(now.prompt_tokens));
    setText("live-cached-tokens", number(now.cached_tokens));
    setText("live-evicted-own", number(now.evicted_own_blocks));
    setText("live-evicted-pressure", number(now.evicted_pressure_blocks));
    showPools(now.pools || []);
  }

  // The per-pool table's rows, by model; a model served since the page loaded waits for a reload.
  function showPools(pools) {
    var table = document.getElementById("pool-cache");
    if (!table) { return; }
    var rows = Array.prototype.slice.call(table.querySelectorAll("tbody tr"));
    pools.forEach(function (pool) {
      var row = rows.filter(function (tr) { return tr.getAttribute("data-model") === pool.model; })[0];
      if (!row) { return; }
      Array.prototype.forEach.call(row.querySelectorAll("[data-field]"), function (cell) {
        var name = cell.getAttribute("data-field");
        cell.textContent = name === "hit_ratio" ? percentOf(pool.hit_ratio, pool.prompt_tokens) : number(pool[name]);
      });
    });
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
          var now = {
            now: true,
            t: Date.parse(usage.now) / 1000,
            cached_blocks: usage.cache.cached_blocks,
            active_blocks: usage.cache.active_blocks,
            reserved_blocks: usage.cache.reserved_blocks,
            quota_blocks: usage.cache.quota_blocks
          };
          drawBlocks(blocks, usage.samples, now);
          drawRatio(ratio, usage.samples, now.t);
          showNow(usage.cache, usage.summary);
          showKeys(usage.keys);
          // The server's time of the data (ISO 8601, UTC), as hh:mm:ss.
          var at = new Date(now.t * 1000).toISOString().slice(11, 19);
          setText("chart-status", "Live: refreshed every " + interval / 1000 + " seconds; last at " + at + " UTC.");
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
