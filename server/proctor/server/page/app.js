// The live page of the proctor dataserver: polls GET /dashboard every 2 s and draws it, charts as inline SVG.
// Plain ES2020 with no dependencies and no build step. Every string that comes from the server passes through
// esc() before it reaches innerHTML (sample ids and grader errors are user data), or is set as textContent.
"use strict";

(() => {
  const POLL_MS = 2000;
  const FETCH_TIMEOUT_MS = 8000;
  const RECENT = 10; // iterations summarised by the tiles, and the moving average's window
  const STAGE_COLOURS = 8; // .st-0 … .st-7 in style.css
  const MAX_ERROR_CHARS = 2000;

  const $ = (id) => document.getElementById(id);

  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const esc = (value) => String(value).replace(/[&<>"']/g, (c) => ESCAPES[c]);

  const st = (index) => `st-${((Number(index) % STAGE_COLOURS) + STAGE_COLOURS) % STAGE_COLOURS}`;
  const int = (n) => (n == null ? "–" : Number(n).toLocaleString("en-US"));
  const fixed = (x, digits = 3) => (x == null ? "–" : Number(x).toFixed(digits));
  const pct = (x) => (x == null ? "–" : `${Math.round(x * 100)}%`);
  const clock = (date) => date.toLocaleTimeString("en-GB", { hour12: false });
  const plural = (n, one, many) => `${int(n)} ${n === 1 ? one : many}`;

  const state = {
    data: null, // the latest /dashboard answer
    text: null, // its text: an unchanged answer is not drawn again
    updatedAt: null, // when the latest answer arrived
    timer: 0,
    inflight: false,
  };

  // --- fetching -----------------------------------------------------------------------------------------

  function fragmentKey() {
    return new URLSearchParams(location.hash.replace(/^#/, "")).get("key") || null;
  }

  async function detailOf(response) {
    try {
      const body = await response.json();
      return body && typeof body.detail === "string" ? `: ${body.detail.slice(0, 200)}` : "";
    } catch {
      return "";
    }
  }

  async function poll() {
    clearTimeout(state.timer);
    if (state.inflight) return;
    state.inflight = true;
    const key = fragmentKey();
    const controller = new AbortController();
    const abort = setTimeout(() => controller.abort(), FETCH_TIMEOUT_MS);
    try {
      let response;
      let text;
      try {
        response = await fetch("dashboard", {
          headers: key ? { Authorization: `Bearer ${key}` } : {},
          cache: "no-store",
          signal: controller.signal,
        });
        if (response.status === 401) {
          showAuthNeeded(key);
          return;
        }
        if (!response.ok) throw new Error(`HTTP ${response.status}${await detailOf(response)}`);
        text = await response.text();
      } catch (err) {
        const why = err.name === "AbortError" ? `no answer within ${FETCH_TIMEOUT_MS / 1000} s` : err.message;
        showFailure(`Could not load <code>/dashboard</code> (${esc(why)}).`);
        return;
      }
      try {
        if (text !== state.text) {
          state.data = JSON.parse(text);
          state.text = text;
          render();
        }
      } catch (err) {
        console.error(err);
        state.text = null;
        showFailure(`Could not draw the answer of <code>/dashboard</code> (${esc(err.message)}).`);
        return;
      }
      state.updatedAt = new Date();
      setState("ok");
      notice(null);
      tick();
    } finally {
      clearTimeout(abort);
      state.inflight = false;
      state.timer = setTimeout(poll, POLL_MS);
    }
  }

  function setState(name) {
    document.body.dataset.state = name;
  }

  function notice(html) {
    const el = $("notice");
    if (html == null) {
      el.hidden = true;
      el.innerHTML = "";
    } else {
      el.innerHTML = html;
      el.hidden = false;
    }
  }

  function showFailure(html) {
    setState("error");
    const kept = state.updatedAt ? ` The page shows the data of ${clock(state.updatedAt)}.` : "";
    notice(`${html} Retrying every ${POLL_MS / 1000} s.${kept}`);
    tick();
  }

  function showAuthNeeded(key) {
    setState("auth");
    const how = `<code>${esc(location.pathname)}#key=&lt;PROCTOR_API_KEY&gt;</code>`;
    notice(
      key
        ? `The server refused the key in this page's address (401). Open the page as ${how} with the server's key.`
        : `This server requires its API key (401). Open the page as ${how}: the key stays in the browser.`,
    );
    tick();
  }

  function tick() {
    const el = $("updated");
    if (!state.updatedAt) {
      el.textContent = document.body.dataset.state === "loading" ? "connecting…" : "no data yet";
      return;
    }
    const ago = Math.max(0, Math.round((Date.now() - state.updatedAt.getTime()) / 1000));
    el.textContent = `updated ${clock(state.updatedAt)} · ${ago < 2 ? "just now" : `${ago} s ago`}`;
  }

  // --- drawing helpers --------------------------------------------------------------------------------------

  function scale(d0, d1, r0, r1) {
    const k = d1 === d0 ? 0 : (r1 - r0) / (d1 - d0);
    const f = (v) => r0 + (v - d0) * k;
    f.invert = (p) => (k === 0 ? d0 : d0 + (p - r0) / k);
    return f;
  }

  // Round tick values over [lo, hi], about `count` of them (integers only when `integer`).
  function ticks(lo, hi, count, integer = false) {
    const span = hi - lo;
    if (!(span > 0) || !Number.isFinite(span)) return [lo];
    let step = 10 ** Math.floor(Math.log10(span / Math.max(1, count)));
    const ratio = span / Math.max(1, count) / step;
    if (ratio >= 7.5) step *= 10;
    else if (ratio >= 3.5) step *= 5;
    else if (ratio >= 1.5) step *= 2;
    if (integer) step = Math.max(1, Math.round(step));
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toFixed(10)));
    return out;
  }

  const n2 = (v) => (Math.round(v * 10) / 10).toString();

  function xAxis(x, values, y, format = int) {
    const [r0, r1] = [x(x.lo), x(x.hi)];
    const labels = values
      .map((v) => `<text x="${n2(x(v))}" y="${n2(y + 15)}" text-anchor="middle">${esc(format(v))}</text>`)
      .join("");
    const marks = values.map((v) => `<line x1="${n2(x(v))}" x2="${n2(x(v))}" y1="${n2(y)}" y2="${n2(y + 4)}"/>`).join("");
    return `<g class="axis"><line class="domain" x1="${n2(r0)}" x2="${n2(r1)}" y1="${n2(y)}" y2="${n2(y)}"/>${marks}${labels}</g>`;
  }

  function yGrid(y, values, x0, x1, format) {
    return `<g class="grid">${values
      .map(
        (v) =>
          `<line x1="${n2(x0)}" x2="${n2(x1)}" y1="${n2(y(v))}" y2="${n2(y(v))}"/>` +
          `<text x="${n2(x0 - 6)}" y="${n2(y(v) + 4)}" text-anchor="end">${esc(format(v))}</text>`,
      )
      .join("")}</g>`;
  }

  function svg(width, height, body) {
    return `<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}">${body}</svg>`;
  }

  const widthOf = (el, least = 280) => Math.max(least, Math.floor(el.clientWidth || 0));
  const empty = (text) => `<div class="empty">${esc(text)}</div>`;

  function stageLabel(index, name) {
    return `<span class="stage-name ${st(index)}"><span class="swatch"></span><span>${esc(name)}</span></span>`;
  }

  function stageIndexOf(d, name) {
    const found = d.stages.find((s) => s.name === name);
    return found ? found.index : 0;
  }

  // Contiguous runs of one stage in the iterations list: [{index, name, first, last}].
  function stageRuns(points) {
    const runs = [];
    for (const p of points) {
      const run = runs[runs.length - 1];
      if (run && run.index === p.stage_index) run.last = p.iteration;
      else runs.push({ index: p.stage_index, name: p.stage, first: p.iteration, last: p.iteration });
    }
    return runs;
  }

  // Each reached stage's span of iterations, [start, end), in the order they were reached.
  function stageSpans(d) {
    const reached = d.stages
      .filter((s) => s.started_at != null)
      .sort((a, b) => a.started_at - b.started_at || a.index - b.index);
    const after = d.last_iteration == null ? 0 : d.last_iteration + 1;
    return reached.map((s, i) => {
      const next = reached[i + 1];
      const end = next ? next.started_at : Math.max(after, s.started_at + 1);
      return { stage: s, start: s.started_at, end: Math.max(end, s.started_at) };
    });
  }

  // The trailing mean of `value` over the latest `window` points, weighted by `weight`.
  function movingAverage(points, value, weight, window) {
    const out = [];
    let num = 0;
    let den = 0;
    for (let i = 0; i < points.length; i += 1) {
      num += value(points[i]) * weight(points[i]);
      den += weight(points[i]);
      if (i >= window) {
        num -= value(points[i - window]) * weight(points[i - window]);
        den -= weight(points[i - window]);
      }
      out.push(den > 0 ? num / den : null);
    }
    return out;
  }

  // The moving average of `value` (weighted by `weight`) as an SVG path over `points`; none for fewer than two.
  function averageLine(points, value, weight, x, y) {
    if (points.length < 2) return "";
    const avg = movingAverage(points, value, weight, RECENT);
    const line = points.map((p, i) => `${i ? "L" : "M"}${n2(x(p.iteration))} ${n2(y(avg[i]))}`).join("");
    return `<path class="avg" d="${line}"/>`;
  }

  // The iteration in `points` (sorted by iteration) nearest to `value`.
  function nearest(points, value) {
    let lo = 0;
    let hi = points.length - 1;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (points[mid].iteration < value) lo = mid + 1;
      else hi = mid;
    }
    if (lo > 0 && Math.abs(points[lo - 1].iteration - value) <= Math.abs(points[lo].iteration - value)) lo -= 1;
    return points[lo];
  }

  function iterationTip(p) {
    const share = p.groups ? ` (${pct(p.zero_variance_groups / p.groups)})` : "";
    return (
      `<b>iteration ${int(p.iteration)}</b> · ${stageLabel(p.stage_index, p.stage)}<br>` +
      `mean reward <b>${fixed(p.mean_reward)}</b> over ${plural(p.graded, "completion", "completions")}` +
      `${p.errors ? `, ${plural(p.errors, "error", "errors")}` : ""}<br>` +
      `${plural(p.groups, "group", "groups")}, ${int(p.zero_variance_groups)} with zero variance${share}` +
      (p.refill_rounds
        ? `<br>refilled ${plural(p.refilled_groups, "group", "groups")} in ${plural(p.refill_rounds, "round", "rounds")}`
        : "")
    );
  }

  // --- the sections ------------------------------------------------------------------------------------------

  function render() {
    const d = state.data;
    hideTip();
    renderHeader(d);
    renderStages(d);
    renderTimeline(d);
    renderTransitions(d);
    renderReward(d);
    renderZeroVariance(d);
    renderMix(d);
    renderPassRates(d);
    renderErrors(d);
  }

  function renderHeader(d) {
    $("curriculum").textContent = d.curriculum;
    document.title = `${d.curriculum} · proctor`;
    const current = d.stages.find((s) => s.name === d.current_stage);
    $("current-stage").innerHTML = stageLabel(current ? current.index : 0, d.current_stage);
    $("current-sampler").innerHTML = current
      ? `sampler <b>${esc(current.sampler)}</b> · until step ${int(current.until_step)}`
      : "&nbsp;";
    const last = $("last-iteration");
    last.textContent = d.last_iteration == null ? "none yet" : int(d.last_iteration);
    last.dataset.value = d.last_iteration == null ? "" : String(d.last_iteration);
    $("total-iterations").textContent = int(d.total_iterations);
    const done = d.last_iteration == null ? 0 : (d.last_iteration + 1) / Math.max(1, d.total_iterations);
    $("run-progress").style.width = `${Math.min(100, done * 100).toFixed(1)}%`;

    const recent = d.iterations.slice(-RECENT);
    const graded = recent.reduce((n, p) => n + (p.mean_reward == null ? 0 : p.graded), 0);
    const rewardSum = recent.reduce((n, p) => n + (p.mean_reward == null ? 0 : p.mean_reward * p.graded), 0);
    $("recent-reward").textContent = graded ? fixed(rewardSum / graded) : "–";
    $("recent-reward-sub").textContent = graded ? `${plural(graded, "graded completion", "graded completions")}` : "nothing graded yet";
    const groups = recent.reduce((n, p) => n + p.groups, 0);
    const flat = recent.reduce((n, p) => n + p.zero_variance_groups, 0);
    $("recent-zero-variance").textContent = groups ? pct(flat / groups) : "–";
    $("recent-zero-variance-sub").textContent = groups ? `${int(flat)} of ${plural(groups, "group", "groups")}` : "no groups yet";
    const errors = $("error-count");
    errors.textContent = int(d.grader_errors);
    errors.classList.toggle("bad", d.grader_errors > 0);
  }

  function renderStages(d) {
    const spans = new Map(stageSpans(d).map((s) => [s.stage.name, s]));
    $("stages").innerHTML = d.stages
      .map((s) => {
        const status = s.name === d.current_stage ? "current" : s.started_at == null ? "upcoming" : "done";
        const span = spans.get(s.name);
        const range = span
          ? `${spanText(span)}${s.iterations ? ` (${int(s.iterations)})` : ""} · `
          : "";
        const gate = s.advance ? gateText(s.advance) : `none: runs until step ${int(s.until_step)}`;
        const rolling = s.rolling_reward == null ? "–" : `${fixed(s.rolling_reward)} over ${int(s.rolling_count)}`;
        const errors = s.errors ? ` <span class="bad">+ ${plural(s.errors, "error", "errors")}</span>` : "";
        return (
          `<article class="stage ${st(s.index)} ${status}" data-stage="${esc(s.name)}">` +
          `<header><span class="swatch"></span><h3 title="${esc(s.name)}">${esc(s.name)}</h3>` +
          `<span class="badge">${status}</span></header>` +
          `<span class="chip sampler" title="How the stage chooses records within each source">sampler <b>${esc(s.sampler)}</b></span>` +
          `<dl class="facts">` +
          `<dt>iterations</dt><dd>${range}until ${int(s.until_step)}</dd>` +
          `<dt>prompts</dt><dd>${int(s.samples)}</dd>` +
          `<dt>graded</dt><dd>${int(s.graded)}${errors}</dd>` +
          `<dt>mean reward</dt><dd>${fixed(s.mean_reward)}</dd>` +
          `<dt>rolling reward</dt><dd>${rolling}</dd>` +
          `</dl><div class="gate"><span>gate</span> ${gate}</div></article>`
        );
      })
      .join("");
  }

  const spanText = (span) =>
    span.end - 1 > span.start ? `${int(span.start)}–${int(span.end - 1)}` : int(span.start);

  // An advance gate in a few words: "rolling reward ≥ 0.8 over 64 grades · after 10 steps" (keys it does not know
  // as "key value").
  function gateText(advance) {
    const known = {
      threshold: (v) => `rolling reward ≥ ${v}`,
      window: (v) => `over ${v} grades`,
      min_steps: (v) => `· after ${v} steps`,
    };
    return Object.entries(advance)
      .map(([k, v]) => (Object.prototype.hasOwnProperty.call(known, k) ? known[k](esc(v)) : `· ${esc(k)} ${esc(v)}`))
      .join(" ")
      .replace(/^· /, "");
  }

  function renderTimeline(d) {
    const el = $("timeline");
    const W = widthOf(el);
    const H = 92;
    const m = { l: 14, r: 14 };
    const top = 26;
    const bandH = 36;
    const end = Math.max(d.total_iterations, d.last_iteration == null ? 0 : d.last_iteration + 1, 1);
    const x = scale(0, end, m.l, W - m.r);
    x.lo = 0;
    x.hi = end;
    const spans = stageSpans(d);
    const parts = [];

    // The plan ahead: the rest of the current stage up to its until_step, then each stage not reached yet.
    const planned = [];
    const current = d.stages.find((s) => s.name === d.current_stage);
    let from = spans.length ? spans[spans.length - 1].end : 0;
    for (const s of d.stages) {
      const ahead = s.started_at == null && (!current || s.index > current.index);
      if ((s === current || ahead) && s.until_step > from) {
        planned.push({ stage: s, start: from, end: s.until_step });
        from = s.until_step;
      }
    }
    planned.forEach((p, i) => {
      const x0 = x(p.start);
      const w = Math.max(1, x(p.end) - x0);
      parts.push(
        `<rect class="planned ${st(p.stage.index)}" data-hover="planned:${i}" x="${n2(x0)}" y="${top}" ` +
          `width="${n2(w)}" height="${bandH}" rx="4"/>`,
      );
      parts.push(fitLabel(p.stage.name, x0, w, top + bandH / 2 + 4, "planned-label"));
    });
    spans.forEach((span, i) => {
      const x0 = x(span.start);
      const w = Math.max(2, x(span.end) - x0);
      parts.push(
        `<rect class="band ${st(span.stage.index)}" data-stage="${esc(span.stage.name)}" data-hover="band:${i}" ` +
          `x="${n2(x0)}" y="${top}" width="${n2(w)}" height="${bandH}" rx="4"/>`,
      );
      parts.push(fitLabel(span.stage.name, x0, w, top + bandH / 2 + 4, "band-label"));
    });
    if (d.last_iteration != null) {
      const xn = x(d.last_iteration + 1);
      parts.push(`<line class="now" x1="${n2(xn)}" x2="${n2(xn)}" y1="${top - 4}" y2="${top + bandH + 4}"/>`);
    }
    d.transitions.forEach((t, i) => {
      const xt = x(t.iteration);
      parts.push(
        `<line class="tr-line" x1="${n2(xt)}" x2="${n2(xt)}" y1="${top - 6}" y2="${top + bandH + 4}"/>` +
          `<g class="tr-badge" data-hover="tr:${i}"><circle cx="${n2(xt)}" cy="11" r="9"/>` +
          `<text x="${n2(xt)}" y="11.5">${i + 1}</text></g>`,
      );
    });
    parts.push(xAxis(x, ticks(0, end, Math.max(2, Math.floor(W / 90)), true), top + bandH + 8));
    el.innerHTML = svg(W, H, parts.join(""));
    el.hover = (px, py, target) => {
      const hit = target.closest && target.closest("[data-hover]");
      if (hit) {
        const [kind, i] = hit.dataset.hover.split(":");
        if (kind === "tr") return transitionTip(d, d.transitions[Number(i)], Number(i));
        if (kind === "band") {
          const span = spans[Number(i)];
          const isCurrent = span.stage.name === d.current_stage;
          return (
            `${stageLabel(span.stage.index, span.stage.name)} · sampler <b>${esc(span.stage.sampler)}</b><br>` +
            `iterations ${spanText(span)}${isCurrent ? " (current)" : ""}, ` +
            `mean reward ${fixed(span.stage.mean_reward)}`
          );
        }
        if (kind === "planned") {
          const p = planned[Number(i)];
          return `${stageLabel(p.stage.index, p.stage.name)} · planned until step ${int(p.end)}`;
        }
      }
      const at = Math.floor(x.invert(px));
      return at >= 0 && at < end ? `iteration ${int(at)}` : null;
    };
  }

  // A stage's name inside its band, cut to fit (none when the band is too narrow).
  function fitLabel(name, x0, width, y, cls) {
    const room = Math.floor((width - 12) / 7);
    if (room < 3) return "";
    const text = name.length > room ? `${name.slice(0, room - 1)}…` : name;
    return `<text class="${cls}" x="${n2(x0 + 6)}" y="${n2(y)}">${esc(text)}</text>`;
  }

  function rollingNote(t) {
    if (t.rolling_reward == null) return "";
    const over = t.rolling_count == null ? "" : ` over ${plural(t.rolling_count, "grade", "grades")}`;
    return `rolling reward ${fixed(t.rolling_reward)}${over}`;
  }

  function transitionTip(d, t, i) {
    const note = rollingNote(t);
    return (
      `<b>${i + 1}. iteration ${int(t.iteration)}</b>: ${stageLabel(stageIndexOf(d, t.from_stage), t.from_stage)} → ` +
      `${stageLabel(stageIndexOf(d, t.to_stage), t.to_stage)}<br>${esc(t.reason)}${note ? `<br>${note}` : ""}`
    );
  }

  function renderTransitions(d) {
    const el = $("transitions");
    if (!d.transitions.length) {
      el.innerHTML = `<li class="none">No transitions yet: the run is in its first stage.</li>`;
      return;
    }
    el.innerHTML = d.transitions
      .map((t, i) => {
        const note = rollingNote(t);
        return (
          `<li class="transition" data-iteration="${esc(t.iteration)}"><span class="num">${i + 1}</span><div class="body">` +
          `<span class="when">iteration ${int(t.iteration)} · ${stageLabel(stageIndexOf(d, t.from_stage), t.from_stage)}` +
          `<span class="arrow"> → </span>${stageLabel(stageIndexOf(d, t.to_stage), t.to_stage)}</span>` +
          `<span class="reason">${clamped(`tr:${t.iteration}`, t.reason, 240)}` +
          `${note ? ` <span class="rolling">(${note})</span>` : ""}</span></div></li>`
        );
      })
      .join("");
  }

  // Shared by the two per-iteration charts: the x scale over the listed iterations, the stage shading and the
  // transition guides.
  function iterationFrame(d, W, H, m) {
    const points = d.iterations;
    const first = points[0].iteration;
    const last = points[points.length - 1].iteration;
    const x = scale(first - 0.5, last + 0.5, m.l, W - m.r);
    x.lo = first - 0.5;
    x.hi = last + 0.5;
    const shades = stageRuns(points)
      .map((run) => {
        const x0 = x(run.first - 0.5);
        return `<rect class="shade ${st(run.index)}" x="${n2(x0)}" y="${m.t}" width="${n2(x(run.last + 0.5) - x0)}" height="${H - m.t - m.b}"/>`;
      })
      .join("");
    const guides = d.transitions
      .filter((t) => t.iteration > first && t.iteration <= last)
      .map((t) => {
        const xt = n2(x(t.iteration - 0.5));
        return `<line class="tr-guide" x1="${xt}" x2="${xt}" y1="${m.t}" y2="${H - m.b}"/>`;
      })
      .join("");
    const axis = xAxis(x, ticks(first, last, Math.max(2, Math.floor(W / 90)), true), H - m.b);
    const hover = `<line class="hover-line" visibility="hidden" y1="${m.t}" y2="${H - m.b}"/><circle class="hover-dot" r="4.5" visibility="hidden"/>`;
    return { x, shades, guides, axis, hover };
  }

  // Point the hover guide (and dot) of a per-iteration chart at the nearest iteration; its tooltip text.
  function iterationHover(el, d, x, yOf) {
    el.hover = (px) => {
      const p = nearest(d.iterations, x.invert(px));
      const line = el.querySelector(".hover-line");
      const dot = el.querySelector(".hover-dot");
      const xp = n2(x(p.iteration));
      line.setAttribute("x1", xp);
      line.setAttribute("x2", xp);
      line.setAttribute("visibility", "visible");
      const y = yOf(p);
      if (y == null) dot.setAttribute("visibility", "hidden");
      else {
        dot.setAttribute("cx", xp);
        dot.setAttribute("cy", n2(y));
        dot.setAttribute("visibility", "visible");
      }
      return iterationTip(p);
    };
    el.unhover = () => {
      for (const node of el.querySelectorAll(".hover-line, .hover-dot")) node.setAttribute("visibility", "hidden");
    };
  }

  function legend(d) {
    const seen = new Map();
    for (const p of d.iterations) seen.set(p.stage_index, p.stage);
    const stages = [...seen].map(([index, name]) => stageLabel(index, name)).join("");
    return `${stages}<span><span class="line"></span>moving average (${RECENT})</span>`;
  }

  function renderReward(d) {
    const el = $("reward");
    $("reward-legend").innerHTML = d.iterations.length ? legend(d) : "";
    if (!d.iterations.length) {
      el.innerHTML = empty("No iterations sampled yet: the chart fills in as the trainer's completions are graded.");
      el.hover = null;
      return;
    }
    const W = widthOf(el);
    const H = 240;
    const m = { l: 46, r: 14, t: 10, b: 24 };
    const f = iterationFrame(d, W, H, m);
    const graded = d.iterations.filter((p) => p.mean_reward != null);
    let lo = 0;
    let hi = 1;
    for (const p of graded) {
      lo = Math.min(lo, p.mean_reward);
      hi = Math.max(hi, p.mean_reward);
    }
    const yt = ticks(lo, hi, 5);
    lo = Math.min(lo, yt[0]);
    hi = Math.max(hi, yt[yt.length - 1]);
    const y = scale(lo, hi, H - m.b, m.t);
    const parts = [f.shades, yGrid(y, yt, m.l, W - m.r, (v) => String(v)), f.guides];
    if (lo < 0) parts.push(`<line class="zero" x1="${m.l}" x2="${W - m.r}" y1="${n2(y(0))}" y2="${n2(y(0))}"/>`);

    // One line per run of a stage, broken where an iteration has no graded completion.
    let path = "";
    let pathStage = null;
    const flush = () => {
      if (path) parts.push(`<path class="seg ${st(pathStage)}" d="${path}"/>`);
      path = "";
    };
    for (const p of d.iterations) {
      if (p.mean_reward == null || p.stage_index !== pathStage) flush();
      pathStage = p.stage_index;
      if (p.mean_reward != null) path += `${path ? "L" : "M"}${n2(f.x(p.iteration))} ${n2(y(p.mean_reward))}`;
    }
    flush();
    parts.push(averageLine(graded, (p) => p.mean_reward, (p) => p.graded, f.x, y));
    const r = graded.length <= 60 ? 3.5 : graded.length <= 400 ? 2.4 : 1.6;
    parts.push(
      graded
        .map(
          (p) =>
            `<circle class="pt ${st(p.stage_index)}" data-iteration="${p.iteration}" cx="${n2(f.x(p.iteration))}" ` +
            `cy="${n2(y(p.mean_reward))}" r="${r}"/>`,
        )
        .join(""),
    );
    if (!graded.length) {
      parts.push(`<text x="${n2((m.l + W - m.r) / 2)}" y="${n2(H / 2)}" text-anchor="middle">No completion graded yet.</text>`);
    }
    parts.push(f.axis, f.hover);
    el.innerHTML = svg(W, H, parts.join(""));
    iterationHover(el, d, f.x, (p) => (p.mean_reward == null ? null : y(p.mean_reward)));
  }

  function renderZeroVariance(d) {
    const el = $("zero-variance");
    if (!d.iterations.length) {
      el.innerHTML = empty("No iterations sampled yet.");
      el.hover = null;
      return;
    }
    const W = widthOf(el);
    const H = 160;
    const m = { l: 46, r: 14, t: 10, b: 24 };
    const f = iterationFrame(d, W, H, m);
    const y = scale(0, 1, H - m.b, m.t);
    const withGroups = d.iterations.filter((p) => p.groups > 0);
    const parts = [f.shades, yGrid(y, [0, 0.5, 1], m.l, W - m.r, pct), f.guides];
    const bw = Math.min(28, Math.max(1, (f.x(1) - f.x(0)) * 0.78));
    parts.push(
      withGroups
        .map((p) => {
          const share = p.zero_variance_groups / p.groups;
          const h = Math.max(1.5, y(0) - y(share));
          return (
            `<rect class="bar ${st(p.stage_index)}" data-iteration="${p.iteration}" data-share="${share}" ` +
            `x="${n2(f.x(p.iteration) - bw / 2)}" y="${n2(y(0) - h)}" width="${n2(bw)}" height="${n2(h)}"/>`
          );
        })
        .join(""),
    );
    parts.push(averageLine(withGroups, (p) => p.zero_variance_groups / p.groups, (p) => p.groups, f.x, y));
    // Iterations whose trainer replaced groups (POST /refill): a mark above the bar, its rounds in data-rounds.
    const refilled = d.iterations.filter((p) => p.refill_rounds > 0);
    parts.push(
      refilled
        .map(
          (p) =>
            `<circle class="refill" data-iteration="${p.iteration}" data-rounds="${p.refill_rounds}" ` +
            `data-groups="${p.refilled_groups}" cx="${n2(f.x(p.iteration))}" cy="${n2(m.t + 3)}" r="3"/>`,
        )
        .join(""),
    );
    $("refill-legend").hidden = !refilled.length;
    if (!withGroups.length) {
      parts.push(
        `<text x="${n2((m.l + W - m.r) / 2)}" y="${n2(H / 2)}" text-anchor="middle">No group has two graded completions yet.</text>`,
      );
    }
    parts.push(f.axis, f.hover);
    el.innerHTML = svg(W, H, parts.join(""));
    iterationHover(el, d, f.x, (p) => (p.groups ? y(p.zero_variance_groups / p.groups) : null));
  }

  // A learning_progress stage's source weights, one line per source; the panel shows only when a stage has them.
  function renderMix(d) {
    const el = $("mix");
    const mixed = d.iterations.filter((p) => p.mix_weights);
    $("mix-panel").hidden = !mixed.length;
    if (!mixed.length) {
      el.innerHTML = "";
      el.hover = null;
      return;
    }
    const sources = [];
    for (const p of mixed) for (const s of Object.keys(p.mix_weights)) if (!sources.includes(s)) sources.push(s);
    $("mix-legend").innerHTML = sources
      .map((s, i) => `<span class="stage-name ${st(i)}"><span class="swatch"></span><span>${esc(s)}</span></span>`)
      .join("");
    const W = widthOf(el);
    const H = 180;
    const m = { l: 46, r: 14, t: 10, b: 24 };
    const f = iterationFrame(d, W, H, m);
    const y = scale(0, 1, H - m.b, m.t);
    const parts = [f.shades, yGrid(y, [0, 0.25, 0.5, 0.75, 1], m.l, W - m.r, pct), f.guides];
    sources.forEach((source, i) => {
      // Broken where an iteration has no weight for the source (a fixed stage, or a stage without it).
      let path = "";
      let previous = null;
      for (const p of d.iterations) {
        const w = p.mix_weights ? p.mix_weights[source] : undefined;
        if (w == null) {
          previous = null;
          continue;
        }
        path += `${previous == null ? "M" : "L"}${n2(f.x(p.iteration))} ${n2(y(w))}`;
        previous = p.iteration;
      }
      parts.push(`<path class="wline ${st(i)}" data-source="${esc(source)}" d="${path}"/>`);
    });
    parts.push(f.axis, f.hover);
    el.innerHTML = svg(W, H, parts.join(""));
    el.hover = (px) => {
      const p = nearest(d.iterations, f.x.invert(px));
      const line = el.querySelector(".hover-line");
      const xp = n2(f.x(p.iteration));
      line.setAttribute("x1", xp);
      line.setAttribute("x2", xp);
      line.setAttribute("visibility", "visible");
      const head = `<b>iteration ${int(p.iteration)}</b> · ${esc(p.stage)}`;
      if (!p.mix_weights) return `${head}<br>fixed mix`;
      const rows = Object.entries(p.mix_weights).map(([s, w]) => `${esc(s)} ${pct(w)}`);
      return `${head}<br>${rows.join(" · ")}`;
    };
    el.unhover = () => el.querySelector(".hover-line").setAttribute("visibility", "hidden");
  }

  function renderPassRates(d) {
    const el = $("pass-rates");
    if (!d.pass_rates.length) {
      el.innerHTML = empty("The curriculum has no sources.");
      return;
    }
    const tracked = d.pass_rates.filter((h) => h.records != null);
    const endless = d.pass_rates.filter((h) => h.records == null);
    const cards = tracked
      .map((h) => {
        const mean = h.mean_pass_rate == null ? "" : ` · mean ${fixed(h.mean_pass_rate, 2)}`;
        return (
          `<div class="hist" data-source="${esc(h.source)}"><h3 title="${esc(h.source)}">${esc(h.source)}</h3>` +
          `<div class="sub">${int(h.graded_records)} of ${plural(h.records, "record", "records")} graded${mean}</div>` +
          `<div class="chart"></div></div>`
        );
      })
      .join("");
    const chips = endless
      .map(
        (h) =>
          `<div class="hist untracked" data-source="${esc(h.source)}" title="An endless generator has no fixed records">` +
          `<h3>${esc(h.source)}</h3><span class="untracked-note">not tracked</span></div>`,
      )
      .join("");
    el.innerHTML =
      (tracked.length ? `<div class="hist-grid">${cards}</div>` : "") +
      (endless.length ? `<div class="untracked-list"><span class="label">Endless generators:</span>${chips}</div>` : "");
    // Drawn once the cards are laid out, at their width.
    el.querySelectorAll(".hist .chart").forEach((chart, i) => histogram(chart, tracked[i]));
  }

  function histogram(el, h) {
    const W = widthOf(el, 120);
    const H = 112;
    const m = { l: 2, r: 2, t: 14, b: 16 };
    const bins = h.bins;
    const n = bins.length || 10;
    const most = Math.max(1, ...bins);
    const bw = (W - m.l - m.r) / n;
    const y = scale(0, most, H - m.b, m.t);
    const parts = [];
    bins.forEach((count, i) => {
      const x0 = m.l + i * bw + 1.5;
      const w = Math.max(1, bw - 3);
      const top = y(count);
      parts.push(`<rect class="hbar-bg" x="${n2(x0)}" y="${m.t}" width="${n2(w)}" height="${n2(H - m.b - m.t)}" rx="2"/>`);
      parts.push(
        `<rect class="hbar" data-bin="${i}" data-count="${count}" style="--bin: var(--bin-${Math.min(9, Math.floor((i * 10) / n))})" ` +
          `x="${n2(x0)}" y="${n2(top)}" width="${n2(w)}" height="${n2(H - m.b - top)}" rx="2"/>`,
      );
      if (count > 0) {
        parts.push(`<text class="count" data-bin="${i}" x="${n2(x0 + w / 2)}" y="${n2(top - 3)}">${int(count)}</text>`);
      }
    });
    if (h.mean_pass_rate != null) {
      const xm = n2(m.l + h.mean_pass_rate * (W - m.l - m.r));
      parts.push(`<line class="mean-line" x1="${xm}" x2="${xm}" y1="${m.t - 4}" y2="${H - m.b}"/>`);
    }
    if (!h.graded_records) {
      parts.push(`<text class="hist-empty" x="${n2(W / 2)}" y="${n2((H - m.b + m.t) / 2)}">no graded groups yet</text>`);
    }
    for (const [v, anchor] of [[0, "start"], [0.5, "middle"], [1, "end"]]) {
      parts.push(`<text x="${n2(m.l + v * (W - m.l - m.r))}" y="${H - 3}" text-anchor="${anchor}">${v}</text>`);
    }
    el.innerHTML = svg(W, H, parts.join(""));
    el.hover = (px, py, target) => {
      const hit = target.closest && target.closest("[data-bin]");
      const i = hit ? Number(hit.dataset.bin) : Math.floor((px - m.l) / bw);
      if (!(i >= 0 && i < n)) return null;
      const range = `[${fixed(i / n, 1)}, ${fixed((i + 1) / n, 1)}${i === n - 1 ? "]" : ")"}`;
      return `<b>${esc(h.source)}</b><br>pass rate ${range}: ${plural(bins[i], "record", "records")}`;
    };
  }

  function renderErrors(d) {
    const el = $("errors");
    const byStage = d.stages
      .filter((s) => s.errors > 0)
      .map((s) => `<span class="chip ${st(s.index)}"><span class="swatch"></span> ${esc(s.name)}: ${int(s.errors)}</span>`)
      .join(" ");
    const head =
      `<div class="errors-head"><span class="errors-total${d.grader_errors ? " bad" : ""}" id="errors-total">` +
      `${int(d.grader_errors)}</span><span>${d.grader_errors === 1 ? "completion" : "completions"} failed grading over the run</span>` +
      `<span class="errors-by-stage">${byStage}</span></div>`;
    if (!d.recent_errors.length) {
      el.innerHTML = head + empty(d.grader_errors ? "The latest errors are not kept." : "No grader errors.");
      return;
    }
    const rows = d.recent_errors
      .map((e) => {
        const text = e.error.length > MAX_ERROR_CHARS ? `${e.error.slice(0, MAX_ERROR_CHARS)}…` : e.error;
        return (
          `<tr class="error"><td class="it">${int(e.iteration)}</td><td class="sid">${esc(e.sample_id)}</td>` +
          `<td class="msg">${clamped(`err:${e.iteration}:${e.sample_id}`, text, 300)}</td></tr>`
        );
      })
      .join("");
    el.innerHTML =
      `${head}<table class="errors"><colgroup><col class="c-it"><col class="c-sid"><col></colgroup>` +
      `<thead><tr><th>iteration</th><th>sample</th><th>error</th></tr></thead><tbody>${rows}</tbody></table>`;
  }

  // Long text, cut to a few lines until it is clicked (which the next redraw remembers).
  const opened = new Set();

  function clamped(key, text, longer) {
    if (text.length <= longer) return `<span class="text">${esc(text)}</span>`;
    const open = opened.has(key) ? " open" : "";
    return `<span class="text clamp${open}" data-key="${esc(key)}" title="Click to show all or less">${esc(text)}</span>`;
  }

  document.addEventListener("click", (event) => {
    const el = event.target.closest ? event.target.closest(".clamp") : null;
    if (!el) return;
    const open = el.classList.toggle("open");
    if (open) opened.add(el.dataset.key);
    else opened.delete(el.dataset.key);
  });

  // --- tooltip ---------------------------------------------------------------------------------------------

  let hovered = null;

  function hideTip() {
    $("tooltip").hidden = true;
    if (hovered && hovered.unhover) hovered.unhover();
    hovered = null;
  }

  document.addEventListener("mousemove", (event) => {
    const chart = event.target.closest ? event.target.closest(".chart") : null;
    const svgEl = chart && chart.querySelector("svg");
    if (!chart || !chart.hover || !svgEl) {
      hideTip();
      return;
    }
    if (hovered && hovered !== chart) hideTip();
    hovered = chart;
    const box = svgEl.getBoundingClientRect();
    const html = chart.hover(event.clientX - box.left, event.clientY - box.top, event.target);
    const tip = $("tooltip");
    if (!html) {
      tip.hidden = true;
      return;
    }
    tip.innerHTML = html;
    tip.hidden = false;
    const gap = 14;
    const left = Math.min(event.clientX + gap, window.innerWidth - tip.offsetWidth - 8);
    const top = event.clientY + gap + tip.offsetHeight > window.innerHeight ? event.clientY - gap - tip.offsetHeight : event.clientY + gap;
    tip.style.left = `${Math.max(4, left)}px`;
    tip.style.top = `${Math.max(4, top)}px`;
  });
  document.addEventListener("mouseleave", hideTip);

  // --- start -------------------------------------------------------------------------------------------------

  let resizing = 0;
  window.addEventListener("resize", () => {
    cancelAnimationFrame(resizing);
    resizing = requestAnimationFrame(() => {
      if (state.data) render();
    });
  });
  window.addEventListener("hashchange", () => {
    if (!state.inflight) poll();
  });
  setInterval(tick, 1000);
  poll();
})();
