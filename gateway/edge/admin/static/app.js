// shapegate ops dashboard. Polls admin/dashboard.json and renders it; no framework, no build step.
// Every string from the server goes through textContent (request ids and model names come from
// clients), never innerHTML.
'use strict';

(() => {
  const POLL_MS = 1000;
  const STALE_MS = 5000;
  const TOKEN_KEY = 'shapegate.admin_token';
  const LANE_COLORS = ['#5cc8ff', '#b48cff', '#3ddc97', '#ff9f5a', '#f06fb4', '#e6d45c'];
  const FAILED = new Set(['upstream_error', 'timeout', 'error']);
  const OUTCOME_FILTERS = [
    ['all', 'all'], ['ok', 'ok'], ['in_flight', 'in flight'], ['failed', 'failed'],
    ['rejected', 'rejected'], ['client_disconnect', 'disconnect'],
  ];

  const ui = {
    data: null, paused: false, lastOk: 0, error: null, inFlight: false,
    filters: { lane: 'all', outcome: 'all', q: '' },
    laneColor: new Map(), laneCards: new Map(), charts: [],
  };

  // ---------- small helpers ----------
  const $ = (id) => document.getElementById(id);
  function h(tag, props, ...kids) {
    const el = document.createElement(tag);
    if (props) {
      for (const [k, v] of Object.entries(props)) {
        if (v === undefined || v === null || v === false) continue;
        if (k === 'class') el.className = v;
        else if (k === 'text') el.textContent = v;
        else if (k === 'title') el.title = v;
        else if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
        else if (k.startsWith('--')) el.style.setProperty(k, v);
        else el.setAttribute(k, v);
      }
    }
    for (const kid of kids.flat()) {
      if (kid === null || kid === undefined || kid === false || kid === '') continue;
      el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
    return el;
  }
  const nf = new Intl.NumberFormat('en-US');
  const num = (v) => (v === null || v === undefined ? '—' : nf.format(Math.round(v)));
  function dur(s) {
    if (s === null || s === undefined || Number.isNaN(s)) return '—';
    if (s < 0.001) return '<1 ms';
    if (s < 1) return `${(s * 1000).toFixed(s < 0.01 ? 1 : 0)} ms`;
    if (s < 60) return `${s.toFixed(s < 10 ? 2 : 1)} s`;
    if (s < 3600) return `${Math.floor(s / 60)}m ${String(Math.round(s % 60)).padStart(2, '0')}s`;
    return `${Math.floor(s / 3600)}h ${String(Math.floor((s % 3600) / 60)).padStart(2, '0')}m`;
  }
  function bytes(b) {
    if (b === null || b === undefined) return '—';
    if (b < 1024) return `${b} B`;
    if (b < 1048576) return `${(b / 1024).toFixed(b < 10240 ? 1 : 0)} KiB`;
    return `${(b / 1048576).toFixed(1)} MiB`;
  }
  const rate = (r) => (r >= 100 ? r.toFixed(0) : r >= 10 ? r.toFixed(1) : r.toFixed(2));
  function clock(ts) {
    const d = new Date(ts * 1000);
    const p = (n, w = 2) => String(n).padStart(w, '0');
    return `${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}.${p(d.getMilliseconds(), 3)}`;
  }
  function ago(offset, compact) {
    const s = Math.round(-offset);
    if (s <= 0) return 'now';
    if (s < 60) return `-${s}s`;
    if (compact) return `-${Math.round(s / 60)}m`;
    return `-${Math.floor(s / 60)}m${s % 60 ? ` ${s % 60}s` : ''}`;
  }
  const present = (...xs) => xs.filter((x) => x !== null && x !== undefined && x !== false);
  function level(used, limit) {
    if (!limit || used === null || used === undefined) return '';
    const f = used / limit;
    return f >= 0.9 ? 'bad' : f >= 0.7 ? 'warn' : '';
  }
  function laneColor(name) {
    if (!ui.laneColor.has(name)) {
      ui.laneColor.set(name, name === 'none' ? '#8592a3' : LANE_COLORS[ui.laneColor.size % LANE_COLORS.length]);
    }
    return ui.laneColor.get(name);
  }
  function outcomeClass(o) {
    if (o === 'ok') return 'ok';
    if (o === 'in_flight') return 'info';
    if (FAILED.has(o)) return 'bad';
    return 'warn';
  }

  // ---------- token (URL fragment -> sessionStorage -> bearer header) ----------
  function token() {
    const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
    if (m) {
      sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
      history.replaceState(null, '', location.pathname + location.search);
    }
    return sessionStorage.getItem(TOKEN_KEY);
  }
  $('auth-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const value = $('auth-token').value.trim();
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    $('auth-token').value = '';
    poll();
  });

  // ---------- charts ----------
  // A chart is a canvas plus a spec; drawing is pure over (spec, hover index).
  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = 10 ** Math.floor(Math.log10(v));
    for (const m of [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }
  function makeChart(title, fmt) {
    const canvas = h('canvas');
    const keys = h('span', { class: 'keys' });
    const last = h('span', { class: 'last' });
    const el = h('div', { class: 'chart' },
      h('div', { class: 'chart-head' }, h('span', { class: 't', text: title }), keys, h('span', { class: 'spacer' }), last),
      canvas);
    const chart = { el, canvas, keys, last, fmt, spec: null, hover: null };
    canvas.addEventListener('mousemove', (ev) => {
      const r = canvas.getBoundingClientRect();
      chart.hover = { x: ev.clientX - r.left, cx: ev.clientX, cy: ev.clientY };
      drawChart(chart);
    });
    canvas.addEventListener('mouseleave', () => { chart.hover = null; $('tip').hidden = true; drawChart(chart); });
    ui.charts.push(chart);
    return chart;
  }
  function setChart(chart, spec) {
    const sig = spec.series.map((s) => s.label).join('|');
    if (chart.keysSig !== sig) {
      chart.keys.replaceChildren(...spec.series.map((s) => {
        const sw = h('i'); sw.style.background = s.color;
        return h('span', { class: 'key' }, sw, s.label);
      }));
      chart.keysSig = sig;
    }
    chart.spec = spec;
    const main = spec.series[0].values;
    let lastV = null;
    for (let i = main.length - 1; i >= 0; i--) if (main[i] !== null) { lastV = main[i]; break; }
    chart.last.textContent = lastV === null ? '' : chart.fmt(lastV);
    drawChart(chart);
  }
  function drawChart(chart) {
    const { canvas, spec } = chart;
    if (!spec) return;
    const dpr = window.devicePixelRatio || 1;
    const W = canvas.clientWidth, H = canvas.clientHeight;
    if (!W || !H) return;
    if (canvas.width !== Math.round(W * dpr) || canvas.height !== Math.round(H * dpr)) {
      canvas.width = Math.round(W * dpr); canvas.height = Math.round(H * dpr);
    }
    const ctx = canvas.getContext('2d');
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, W, H);
    const L = 44, R = 4, T = 6, B = 14;
    const pw = W - L - R, ph = H - T - B;
    const t = spec.t, n = t.length;
    let ymax = spec.limit || 0;
    for (const s of spec.series) for (const v of s.values) if (v !== null && v > ymax) ymax = v;
    ymax = niceMax(ymax * 1.05);
    const x = (i) => L + (n <= 1 ? pw : (i / (n - 1)) * pw);
    const y = (v) => T + ph - (v / ymax) * ph;
    ctx.font = '10px ui-monospace, "DejaVu Sans Mono", monospace';
    ctx.textBaseline = 'middle';
    for (const f of [0, 0.5, 1]) {
      const yy = Math.round(y(ymax * f)) + 0.5;
      ctx.strokeStyle = f === 0 ? '#2d3949' : '#1c2431';
      ctx.beginPath(); ctx.moveTo(L, yy); ctx.lineTo(W - R, yy); ctx.stroke();
      ctx.fillStyle = '#6b7788'; ctx.textAlign = 'right';
      ctx.fillText(chart.fmt(ymax * f), L - 5, yy);
    }
    // Time ticks at round offsets from now (-30s, -1m, -5m ...), at most four.
    ctx.textBaseline = 'alphabetic'; ctx.textAlign = 'center';
    if (n > 1) {
      const t0 = t[0], t1 = t[n - 1], span = t1 - t0;
      const step = [5, 10, 15, 30, 60, 120, 300, 600].find((st) => span / st <= 4) || 600;
      const xt = (v) => L + ((v - t0) / span) * pw;
      for (let v = Math.ceil(t0 / step) * step; v <= t1 + 1e-9; v += step) {
        const xx = Math.round(xt(v)) + 0.5;
        ctx.strokeStyle = '#1c2431';
        ctx.beginPath(); ctx.moveTo(xx, T); ctx.lineTo(xx, T + ph); ctx.stroke();
        ctx.fillStyle = '#566274';
        ctx.fillText(ago(v, true), Math.min(Math.max(xx, L + 12), W - R - 12), H - 2);
      }
    }
    if (spec.limit) {
      ctx.setLineDash([4, 3]); ctx.strokeStyle = 'rgba(255,95,95,.55)';
      const yy = Math.round(y(spec.limit)) + 0.5;
      ctx.beginPath(); ctx.moveTo(L, yy); ctx.lineTo(W - R, yy); ctx.stroke();
      ctx.setLineDash([]);
    }
    spec.series.forEach((s, k) => {
      ctx.strokeStyle = s.color; ctx.lineWidth = k === 0 ? 1.6 : 1.2;
      ctx.globalAlpha = s.dim ? 0.75 : 1;
      ctx.setLineDash(s.dash ? [3, 2] : []);
      // Contiguous runs of samples; a gap (no sample) is never bridged by a ramp. A gauge
      // (s.step) holds its value until the next sample: drawn as steps, not slopes.
      const runs = [];
      let run = null;
      for (let i = 0; i < n; i++) {
        const v = s.values[i];
        if (v === null || v === undefined) { run = null; continue; }
        if (!run) { run = []; runs.push(run); }
        run.push([x(i), y(v)]);
      }
      const trace = (pts) => {
        ctx.moveTo(pts[0][0], pts[0][1]);
        for (let j = 1; j < pts.length; j++) {
          if (s.step) ctx.lineTo(pts[j][0], pts[j - 1][1]);
          ctx.lineTo(pts[j][0], pts[j][1]);
        }
      };
      ctx.beginPath();
      for (const pts of runs) trace(pts);
      ctx.stroke();
      ctx.fillStyle = s.color;
      for (const pts of runs) {
        if (pts.length === 1) { ctx.beginPath(); ctx.arc(pts[0][0], pts[0][1], 1.8, 0, 7); ctx.fill(); }
      }
      if (k === 0 && s.fill) {
        ctx.globalAlpha = 0.12;
        for (const pts of runs) {
          if (pts.length < 2) continue;
          ctx.beginPath(); trace(pts);
          ctx.lineTo(pts[pts.length - 1][0], y(0)); ctx.lineTo(pts[0][0], y(0)); ctx.fill();
        }
      }
      ctx.globalAlpha = 1; ctx.setLineDash([]); ctx.lineWidth = 1;
    });
    const tip = $('tip');
    if (chart.hover && n > 0) {
      const i = Math.max(0, Math.min(n - 1, Math.round(((chart.hover.x - L) / pw) * (n - 1))));
      const xx = Math.round(x(i)) + 0.5;
      ctx.strokeStyle = 'rgba(215,222,232,.35)';
      ctx.beginPath(); ctx.moveTo(xx, T); ctx.lineTo(xx, T + ph); ctx.stroke();
      const rows = [h('div', { class: 'dim', text: `${clock(spec.at + t[i])}  (${ago(t[i])})` })];
      for (const s of spec.series) {
        const v = s.values[i];
        if (v !== null && v !== undefined) {
          ctx.fillStyle = s.color; ctx.beginPath(); ctx.arc(x(i), y(v), 2.5, 0, 7); ctx.fill();
        }
        const sw = h('i'); sw.style.background = s.color;
        rows.push(h('div', { class: 'row' }, h('span', null, sw, s.label), h('b', { text: v === null || v === undefined ? '—' : chart.fmt(v) })));
      }
      tip.replaceChildren(...rows);
      tip.hidden = false;
      const tw = tip.offsetWidth;
      tip.style.left = `${Math.min(window.innerWidth - tw - 8, chart.hover.cx + 14)}px`;
      tip.style.top = `${chart.hover.cy + 14}px`;
    }
  }
  window.addEventListener('resize', () => ui.charts.forEach(drawChart));

  // ---------- header ----------
  function pill(label, value, cls, title) {
    return h('span', { class: `pill ${cls || ''}`, title }, label, h('b', { text: value }));
  }
  function renderHeader(d) {
    const up = d.generated_at - d.started_at;
    const sw = Object.values(d.totals.swallowed).reduce((a, b) => a + b, 0);
    const wd = Object.values(d.totals.watchdog).reduce((a, b) => a + b, 0);
    const unrouted = Object.values(d.unrouted || {}).reduce((a, b) => a + b, 0);
    const down = d.clusters.flatMap((c) => c.endpoints).filter((e) => e.state === 'down').length;
    const slow = d.clusters.flatMap((c) => c.endpoints).filter((e) => e.state === 'slow').length;
    const wrong = d.clusters.flatMap((c) => c.endpoints).filter((e) => e.state === 'misconfigured').length;
    const drifted = (d.count_drift || []).filter((x) => x.drifted > 0);
    const compared = (d.count_drift || []).reduce((a, x) => a + x.compared, 0);
    $('pills').replaceChildren(...present(
      pill('', d.accepting ? 'accepting' : 'draining', d.accepting ? 'ok' : 'bad'),
      pill('in flight', num(d.in_flight)),
      pill('state', d.state_backend + (d.state_degraded ? ' · DEGRADED' : ''), d.state_degraded ? 'bad' : '',
        'slot store backend'),
      pill('engines down', String(down), down ? 'bad' : 'ok'),
      slow ? pill('slow', String(slow), 'warn') : null,
      wrong ? pill('misconfigured', String(wrong), 'warn', "engines whose own context or models fall short of their lanes (see each one's evidence)") : null,
      drifted.length
        ? pill('count drift', drifted.map((x) => `${x.model} ${x.route} ${x.last_drift > 0 ? '+' : ''}${x.last_drift}`).join(' · '), 'bad',
          drifted.map((x) => `${x.model} ${x.route}: ours ${x.last_ours}, engine ${x.last_theirs} `
            + `(${x.drifted} of ${x.compared} requests; tokenizer ${x.tokenizer}, template ${x.template})`).join('\n'))
        : compared ? pill('count drift', '0', 'ok', `our prompt counts match the engines' usage on ${compared} requests`) : null,
      pill('swallowed', num(sw), sw ? 'warn' : ''),
      pill('watchdog', num(wd), wd ? 'warn' : ''),
      unrouted ? pill('no lane', num(unrouted), 'warn', 'requests rejected before a lane was chosen (5 min)') : null,
      d.policy_version !== null && d.policy_version !== undefined ? pill('policy', String(d.policy_version)) : null,
      d.workers ? pill('workers', String(d.workers.length), d.workers.every((w) => w.accepting) ? '' : 'warn',
        d.workers.map((w) => `worker ${w.index} (pid ${w.pid}): ${w.in_flight} in flight, policy ${w.policy_version}`).join('\n')) : null,
      pill('up', dur(up)),
    ));
  }

  // ---------- lanes ----------
  function laneCard(name) {
    const color = laneColor(name);
    const c = {};
    c.rate = h('span', { class: 'lane-rate' });
    c.range = h('span', { class: 'lane-range' });
    const stat = (k) => {
      const v = h('div', { class: 'v' }), sub = h('div', { class: 'sub' });
      return { el: h('div', { class: 'stat' }, h('div', { class: 'k', text: k }), v, sub), v, sub };
    };
    c.slots = stat('slots in use'); c.slotsBar = h('div', { class: 'bar' }, h('i'));
    c.slots.el.insertBefore(c.slotsBar, c.slots.sub);
    c.queue = stat('queue');
    c.ttft = stat('TTFT · 5 min'); c.e2e = stat('duration · 5 min');
    c.outcomes = h('div', { class: 'outcomes' });
    const fmtN = (v) => (v >= 10 ? v.toFixed(0) : v.toFixed(v >= 1 ? 1 : 2).replace(/\.?0+$/, '') || '0');
    c.charts = {
      slots: makeChart('slots · queue', fmtN),
      rate: makeChart('req/s', fmtN),
      ttft: makeChart('TTFT', dur),
      e2e: makeChart('duration', dur),
    };
    c.el = h('article', { class: 'lane', 'data-lane': name, '--lane': color },
      h('div', { class: 'lane-head' }, h('span', { class: 'lane-name', text: name }), c.range, c.rate),
      h('div', { class: 'stats' }, c.slots.el, c.queue.el, c.ttft.el, c.e2e.el),
      c.outcomes,
      h('div', { class: 'charts' }, ...Object.values(c.charts).map((x) => x.el)));
    return c;
  }
  function pctBlock(p) {
    return h('div', { class: 'pct' },
      h('span', { text: 'p50' }), h('span', { text: 'p95' }), h('span', { text: 'p99' }),
      h('b', { text: dur(p.p50) }), h('b', { text: dur(p.p95) }), h('b', { text: dur(p.p99) }));
  }
  // Borrowing (gateway/request/borrowing.py): what the lane borrows now, lends now, and holds back.
  function borrowLine(lane) {
    const parts = [];
    for (const [lender, n] of Object.entries(lane.borrowing || {})) if (n) parts.push(`borrowing ${n} on ${lender}`);
    for (const [borrower, n] of Object.entries(lane.lent || {})) if (n) parts.push(`lending ${n} to ${borrower}`);
    const reserved = Object.keys(lane.reserved_endpoints || {}).length;
    if (reserved) parts.push(`${reserved} engine(s) draining borrowers`);
    if (!parts.length && lane.lends) parts.push(`lends idle engines to ${lane.lends.to.join(', ')}`);
    return parts.length ? ` · ${parts.join(' · ')}` : '';
  }
  function renderLanes(d) {
    const root = $('lanes');
    const seen = new Set();
    for (const lane of d.lanes) {
      seen.add(lane.name);
      let c = ui.laneCards.get(lane.name);
      if (!c) { c = laneCard(lane.name); ui.laneCards.set(lane.name, c); root.append(c.el); }
      const color = laneColor(lane.name);
      c.range.textContent = `${num(lane.min_prompt_tokens)} – ${num(lane.max_prompt_tokens)} tokens · on full: ${lane.on_full}`;
      c.rate.replaceChildren(rate(lane.rate_rps), h('small', { text: 'req/s' }));
      const used = lane.slots_in_use;
      const lv = level(used, lane.slot_limit);
      c.slots.v.className = `v ${lv}`;
      c.slots.v.replaceChildren(used === null ? '?' : num(used), h('small', { text: ` / ${num(lane.slot_limit)}` }));
      c.slotsBar.className = `bar ${lv}`;
      c.slotsBar.firstChild.style.width = `${Math.min(100, ((used || 0) / lane.slot_limit) * 100)}%`;
      c.slots.sub.textContent = lane.clusters
        .map((cl) => `${cl.name}${cl.emergency ? ' (emergency)' : ''} ${num(cl.slots_in_use)}/${num(cl.slot_limit)}`)
        .join(' · ') + (d.slots_known ? '' : ' · shared store unreachable');
      c.slots.sub.textContent += borrowLine(lane);
      const qlv = lane.queue_depth > 0 ? (lane.slots_in_use >= lane.slot_limit ? 'bad' : 'warn') : '';
      c.queue.v.className = `v ${qlv}`;
      c.queue.v.replaceChildren(num(lane.queue_depth), h('small', { text: ` / ${num(lane.queue_limit)}` }));
      c.queue.sub.textContent = lane.queue_depth
        ? `oldest waiting ${dur(lane.oldest_wait_s)} (max ${dur(lane.queue_max_wait_s)})`
        : `max wait ${dur(lane.queue_max_wait_s)}`;
      c.ttft.v.replaceChildren(pctBlock(lane.ttft)); c.ttft.sub.textContent = `${num(lane.ttft.n)} samples`;
      c.e2e.v.replaceChildren(pctBlock(lane.e2e)); c.e2e.sub.textContent = `${num(lane.e2e.n)} samples`;
      const o = lane.outcomes || {};
      const failed = (o.upstream_error || 0) + (o.timeout || 0) + (o.error || 0);
      c.outcomes.replaceChildren(
        h('span', null, 'ok ', h('b', { text: num(o.ok || 0) })),
        h('span', { class: failed ? 'bad' : '' }, 'failed ', h('b', { text: num(failed) }),
          failed ? ` (upstream ${o.upstream_error || 0} · timeout ${o.timeout || 0} · error ${o.error || 0})` : ''),
        h('span', { class: o.rejected ? 'warn' : '' }, 'rejected ', h('b', { text: num(o.rejected || 0) })),
        h('span', null, 'client left ', h('b', { text: num(o.client_disconnect || 0) })),
        h('span', { class: 'faint', text: `last ${dur(d.window.span_s)}` }));
      // Show the series from the first bucket with data (at least the last minute).
      const all = lane.series, n = lane.series_t.length;
      let first = n - Math.max(2, Math.round(60 / d.window.bucket_s));
      for (let i = 0; i < first; i++) {
        if (all.rate[i] > 0 || all.slots[i] !== null) { first = i; break; }
      }
      first = Math.max(0, first);
      const s = Object.fromEntries(Object.entries(all).map(([k, v]) => [k, v.slice(first)]));
      const at = d.generated_at, t = lane.series_t.slice(first);
      setChart(c.charts.slots, { t, at, limit: lane.slot_limit, series: [
        { label: 'slots', values: s.slots, color, fill: true, step: true },
        { label: 'queue', values: s.queue, color: '#f5b83d', step: true }] });
      setChart(c.charts.rate, { t, at, series: [
        { label: 'done', values: s.rate, color, fill: true },
        { label: 'failed', values: s.failed, color: '#ff5f5f' }] });
      setChart(c.charts.ttft, { t, at, series: [
        { label: 'p50', values: s.ttft_p50, color, fill: true },
        { label: 'p95', values: s.ttft_p95, color: '#d7dee8', dash: true, dim: true }] });
      setChart(c.charts.e2e, { t, at, series: [
        { label: 'p50', values: s.e2e_p50, color, fill: true },
        { label: 'p95', values: s.e2e_p95, color: '#d7dee8', dash: true, dim: true }] });
    }
    for (const [name, c] of ui.laneCards) {
      if (!seen.has(name)) { c.el.remove(); ui.laneCards.delete(name); }
    }
  }

  // ---------- engines ----------
  function hostPort(url) {
    try { return new URL(url).host; } catch { return url; }
  }
  function renderEngines(d) {
    const rows = [];
    let up = 0, total = 0;
    for (const cl of d.clusters) {
      cl.endpoints.forEach((e, i) => {
        total++; if (e.state === 'up') up++;
        const cls = e.state === 'up' ? 'ok' : ['slow', 'misconfigured'].includes(e.state) ? 'warn' : 'bad';
        const kv = e.kv_usage;
        const kvEl = kv === null || kv === undefined ? h('span', { class: 'faint', text: '—' }) : (() => {
          const bar = h('span', { class: `kv ${kv >= 0.95 ? 'bad' : kv >= 0.8 ? 'warn' : ''}` }, h('i'));
          bar.firstChild.style.width = `${Math.min(100, kv * 100)}%`;
          return h('span', null, bar, ` ${(kv * 100).toFixed(0)}%`);
        })();
        const pair = (a, b) => `${num(a)} / ${num(b)}`;
        rows.push(h('tr', null,
          h('td', null, i === 0 ? h('b', { text: cl.name }) : '', i === 0 ? h('span', { class: 'faint', text: ` ${cl.kind}` }) : ''),
          h('td', { class: 'mono', text: hostPort(e.url), title: e.url }),
          h('td', { class: 'wrap' },
            h('span', { class: `chip ${cls}`, text: e.state }),
            e.since ? h('span', { class: 'faint', text: ` ${dur(d.generated_at - e.since)}`, title: 'since the last state change' }) : '',
            h('div', { class: 'evidence', text: e.evidence })),
          h('td', { class: 'n', text: pair(e.in_flight, e.slots_in_use), title: 'in flight / slots held' }),
          h('td', { class: 'n', text: pair(e.running, e.waiting), title: "the engine's running / waiting" }),
          h('td', null, kvEl),
          h('td', { class: `n ttft${e.slow_evidence ? ' warn' : ''}`, text: dur(e.ttft_p95_s), title: e.slow_evidence || undefined }),
          h('td', { class: 'n dim', text: e.load_age_s === null ? 'never' : dur(e.load_age_s) })));
      });
    }
    $('engines').tBodies[0].replaceChildren(...rows);
    $('engines-sum').textContent = `${up}/${total} up`;
  }

  // ---------- events ----------
  function renderEvents(d) {
    const sum = [];
    for (const [kind, totals] of [['swallowed', d.totals.swallowed], ['watchdog', d.totals.watchdog]]) {
      for (const [k, v] of Object.entries(totals)) {
        if (v > 0) sum.push(h('span', { class: `chip ${kind === 'swallowed' ? 'bad' : 'warn'}`, title: `${kind} · ${k}`, text: `${k} ${num(v)}` }));
      }
    }
    $('events-sum').replaceChildren(...sum);
    const list = $('events');
    if (!d.events.length) {
      list.replaceChildren(h('li', { class: 'none', text: 'No swallowed errors or watchdog events since start.' }));
      return;
    }
    list.replaceChildren(...d.events.map((ev) => {
      const fields = Object.entries(ev.fields || {}).filter(([, v]) => v !== null && v !== '')
        .map(([k, v]) => `${k}=${v}`).join('  ');
      return h('li', null,
        h('span', { class: 'when', text: clock(ev.at).slice(0, 8), title: new Date(ev.at * 1000).toISOString() }),
        h('span', null, h('span', { class: `chip ${ev.kind === 'swallowed' ? 'bad' : 'warn'}`, text: ev.kind })),
        h('span', { class: 'what' }, h('span', { class: 'where', text: ev.where }),
          ev.decision ? h('span', { class: 'dim', text: ` → ${ev.decision}` }) : ''),
        h('span', { class: 'msg', text: ev.message }),
        fields ? h('span', { class: 'fields', text: fields }) : '');
    }));
  }

  // ---------- decisions ----------
  function chips(rootId, options, key) {
    const root = $(rootId);
    const sig = options.map((o) => o[0]).join('|') + '#' + ui.filters[key];
    if (root.dataset.sig === sig) return;
    root.dataset.sig = sig;
    root.replaceChildren(...options.map(([value, label]) => h('button', {
      type: 'button', class: ui.filters[key] === value ? 'on' : '', 'data-value': value, text: label,
      onclick: () => { ui.filters[key] = value; if (ui.data) renderDecisions(ui.data); },
    })));
  }
  function keep(row) {
    const f = ui.filters;
    if (f.lane !== 'all' && row.lane !== f.lane) return false;
    if (f.outcome === 'failed' ? !FAILED.has(row.outcome) : f.outcome !== 'all' && row.outcome !== f.outcome) return false;
    if (f.q) {
      const hay = `${row.request_id} ${row.model} ${row.reason} ${row.cluster} ${row.endpoint} ${row.error || ''}`.toLowerCase();
      if (!hay.includes(f.q)) return false;
    }
    return true;
  }
  function why(row, lanes) {
    const known = row.prompt_tokens ?? row.prompt_tokens_bound;
    if (known === null || known === undefined) return row.error || '—';
    const lane = lanes.find((l) => l.name === row.lane);
    // The bound decided: "≤ bound" (in bytes, an upper bound on tokens), never called tokens.
    const tok = row.count_method === 'bound' ? `≤ ${num(row.prompt_tokens_bound)}` : num(known);
    if (!lane) return `${tok} tok: ${row.reason}`;
    const range = `[${num(lane.min_prompt_tokens)}, ${num(lane.max_prompt_tokens)})`;
    const reason = row.reason === 'borrowed' ? `borrowed from ${row.lender}` : row.reason;
    const cls = row.priority && row.priority !== 'standard' ? ` · ${row.priority}` : '';
    return `${tok} ∈ ${range}${reason && reason !== 'in_range' ? ` · ${reason}` : ''}${cls}`;
  }
  function renderDecisions(d) {
    const lanes = [...new Set([...d.lanes.map((l) => l.name), ...d.decisions.map((r) => r.lane || 'none')])];
    chips('f-lane', [['all', 'all'], ...lanes.map((l) => [l, l])], 'lane');
    chips('f-outcome', OUTCOME_FILTERS, 'outcome');
    const rows = d.decisions.filter(keep);
    const body = rows.map((r) => {
      const cls = r.outcome === 'in_flight' ? 'inflight' : FAILED.has(r.outcome) ? 'failed' : r.outcome === 'rejected' ? 'rejected' : '';
      const laneName = r.lane || 'none';
      const err = r.error ? `${r.error}${r.deadline ? ` (deadline: ${r.deadline})` : ''}` : '';
      return h('tr', { class: cls, 'data-id': r.request_id, title: err || undefined },
        h('td', { class: 'dim mono', text: clock(r.at) }),
        h('td', { class: 'id', text: r.request_id, title: r.request_id }),
        h('td', { text: r.model ?? '—' }),
        h('td', { class: 'n', text: bytes(r.body_bytes) }),
        h('td', { class: 'n', text: num(r.prompt_tokens),
          title: r.count_drift ? `the engine counted ${num(r.engine_prompt_tokens)} (drift ${r.count_drift > 0 ? '+' : ''}${r.count_drift})` : undefined }),
        h('td', null, r.count_method ? h('span', { class: 'chip method', text: r.count_method, title: r.count_ms !== null ? `${r.count_ms} ms to count` : undefined }) : '—'),
        h('td', null, h('span', { class: 'chip lane', '--lane': laneColor(laneName), text: laneName })),
        h('td', { class: 'why', text: why(r, d.lanes) }),
        h('td', { text: r.cluster ?? '—', title: r.endpoint || undefined }),
        h('td', null, h('span', { class: `chip ${outcomeClass(r.outcome)}`, text: r.outcome === 'in_flight' ? `running ${dur(r.age_s)}` : r.outcome })),
        h('td', { class: 'n', text: r.status ?? '—' }),
        h('td', { class: 'n', text: r.queue_wait_s === null || r.queue_wait_s === undefined ? '—' : dur(r.queue_wait_s) }),
        h('td', { class: 'n', text: dur(r.ttft_s) }),
        h('td', { class: 'n', text: dur(r.duration_s) }));
    });
    const tbody = $('decisions').tBodies[0];
    if (!body.length) {
      tbody.replaceChildren(h('tr', null, h('td', { colspan: '14', class: 'empty', text: d.decisions.length ? 'No decision matches the filters.' : 'No requests yet.' })));
    } else {
      tbody.replaceChildren(...body);
    }
    $('decisions-sum').textContent = `${rows.length} of ${d.decisions.length} shown`;
  }
  $('f-q').addEventListener('input', (ev) => {
    ui.filters.q = ev.target.value.trim().toLowerCase();
    if (ui.data) renderDecisions(ui.data);
  });

  // ---------- shadow policy (admin/shadow: a candidate deciding beside the active one) ----------
  const SHADOW_EVERY_MS = 2000;
  let shadowAt = 0;
  function renderShadow(r) {
    const panel = $('shadow');
    panel.hidden = !r.running && !r.compared;
    if (panel.hidden) return;
    const agreedShare = r.compared ? ` (${((100 * r.agreed) / r.compared).toFixed(1)}%)` : '';
    const lanes = (r.shadow ? r.shadow.lanes : [])
      .map((l) => `${l.name} ${num(l.min)}-${num(l.max - 1)}`).join(', ');
    $('shadow-sum').textContent = present(
      r.running ? `v${r.shadow.version} running` : 'stopped', lanes,
      `compared ${num(r.compared)}`, `agreed ${num(r.agreed)}${agreedShare}`).join(' · ');
    const rows = Object.entries(r.agreed_by_lane || {}).map(([lane, n]) => h('tr', null,
      h('td', null, h('span', { class: 'chip', text: lane })), h('td', { class: 'dim', text: 'same' }),
      h('td', { class: 'n', text: num(n) }), h('td', { class: 'n faint', text: '—' })));
    for (const d of r.disagreements || []) {
      rows.push(h('tr', { class: 'disagree' },
        h('td', null, h('span', { class: 'chip', text: d.active })),
        h('td', null, h('span', { class: 'chip warn', text: d.shadow })),
        h('td', { class: 'n', text: num(d.requests) }),
        h('td', { class: 'n', text: `${num(d.min_tokens)}–${num(d.max_tokens)}` })));
    }
    $('shadow-table').tBodies[0].replaceChildren(...rows);
    const counts = (o) => Object.entries(o || {}).map(([k, v]) => `${k} ${num(v)}`).join(', ');
    $('shadow-more').textContent = present(
      `would reject: ${counts(r.would_reject) || 'none'}`,
      `would borrow: ${counts(r.would_borrow) || 'none'}`).join(' · ');
  }
  async function pollShadow(headers) {
    if (Date.now() - shadowAt < SHADOW_EVERY_MS) return;
    shadowAt = Date.now();
    try {
      const res = await fetch('admin/shadow', { cache: 'no-store', headers });
      if (res.ok) renderShadow(await res.json());
    } catch (err) {
      // The main poll reports an unreachable gateway; the panel keeps its last state.
    }
  }

  // ---------- loop ----------
  function render(d) {
    renderHeader(d);
    renderLanes(d);
    renderEngines(d);
    renderEvents(d);
    renderDecisions(d);
    document.body.dataset.ready = 'true';
  }
  function freshness() {
    const el = $('fresh');
    if (ui.paused) { el.textContent = 'paused'; el.className = 'fresh'; return; }
    if (!ui.lastOk) { el.textContent = ui.error || 'connecting…'; el.className = 'fresh stale'; return; }
    const age = Date.now() - ui.lastOk;
    const stale = age > STALE_MS;
    el.className = stale ? 'fresh stale' : 'fresh';
    el.textContent = stale ? `STALE ${dur(age / 1000)}${ui.error ? ` · ${ui.error}` : ''}` : `updated ${(age / 1000).toFixed(1)} s ago`;
  }
  async function poll() {
    if (ui.inFlight) return;
    ui.inFlight = true;
    try {
      const t = token();
      // X-Shapegate-Admin: the header a cross-site page cannot send without a preflight.
      const headers = t ? { Authorization: `Bearer ${t}`, 'X-Shapegate-Admin': '1' } : { 'X-Shapegate-Admin': '1' };
      const res = await fetch('admin/dashboard.json', { cache: 'no-store', headers });
      if (res.status === 401 || res.status === 403) {
        const body = await res.json().catch(() => ({}));
        ui.error = `${res.status}: ${(body.error && body.error.message) || res.statusText}`;
        $('auth').hidden = false;
        $('auth-why').textContent = ui.error;
        if (res.status === 401) sessionStorage.removeItem(TOKEN_KEY);
      } else if (!res.ok) {
        ui.error = `HTTP ${res.status}`;
      } else {
        $('auth').hidden = true;
        ui.data = await res.json();
        ui.lastOk = Date.now();
        ui.error = null;
        render(ui.data);
        await pollShadow(headers);
      }
    } catch (err) {
      ui.error = `unreachable (${err.message || err})`;
    } finally {
      ui.inFlight = false;
      freshness();
    }
  }
  function loop() {
    if (!ui.paused && !document.hidden) poll();
    setTimeout(loop, POLL_MS);
  }
  $('pause').addEventListener('click', () => {
    ui.paused = !ui.paused;
    $('pause').textContent = ui.paused ? 'resume' : 'pause';
    $('pause').classList.toggle('on', ui.paused);
    freshness();
  });
  document.addEventListener('keydown', (ev) => {
    if (ev.key === ' ' && ev.target === document.body) { ev.preventDefault(); $('pause').click(); }
  });
  setInterval(freshness, 500);
  loop();
})();
