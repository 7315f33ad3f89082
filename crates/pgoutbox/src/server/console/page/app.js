// pgoutbox operator console: plain ES2020, no dependencies, no build step.
// The relay embeds this file and serves it same-origin under a strict CSP
// (default-src 'self'), so there are no inline handlers or styles, and every
// piece of server data reaches the page through textContent, never innerHTML.
'use strict';

const TOKEN_KEY = 'pgoutbox-token';
const REFRESH_MS = 5000;
const PAGE_SIZE = 50;
const SVG_NS = 'http://www.w3.org/2000/svg';
const PAST = { retry: 'retried', discard: 'discarded' };

const $ = (sel) => document.querySelector(sel);

const state = {
  mutations: null, // null until the first overview answers
  destinations: [], // names, for the dead-letter filter
  cursor: null, // cursor of the dead-letter page on screen (null = first)
  nextCursor: null,
  page: 1,
  cursors: [null], // the cursor of each page seen in this search, for "Previous page"
  total: null, // matches of this search (counted up to totalCap)
  totalCap: null,
  auditBefore: null, // the audit log's next (older) page
  errorOrigin: null, // what showed the error on screen: 'action' or 'refresh'
  eventId: null, // event shown in the detail panel
  overviewSeq: 0, // request counter, so a late answer never overwrites a newer one
  overviewShown: 0,
  overviewInFlight: 0,
};

// ---------------------------------------------------------------- helpers

// createElement + textContent only; strings become text nodes, never markup.
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') node.className = v;
    else node.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

const plural = (n, word) => `${n} ${word}${n === 1 ? '' : 's'}`;
const pad = (n) => String(n).padStart(2, '0');

// Local time, like the datetime-local filter inputs; the raw value goes in the title.
function fmtTime(s) {
  if (!s) return '';
  const d = new Date(s);
  if (Number.isNaN(d.getTime())) return String(s);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
    `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

function fmtLag(s) {
  if (s === null || s === undefined) return '–';
  if (s < 10) return `${s.toFixed(1)} s`;
  if (s < 60) return `${Math.round(s)} s`;
  if (s < 3600) return `${Math.round(s / 60)} min`;
  if (s < 86400) return `${(s / 3600).toFixed(1)} h`;
  return `${(s / 86400).toFixed(1)} d`;
}

const fmtRate = (r) => (r >= 100 ? String(Math.round(r)) : r.toFixed(1));
// What the relay's own views call a row without a topic (a table may allow NULL).
const NO_TOPIC = '(no topic)';
const truncate = (s, n) => (s && s.length > n ? `${s.slice(0, n - 1)}…` : s || '');
const timeCell = (s, cls = '') => el('td', { class: `time ${cls}`, title: s || null }, fmtTime(s));
const badge = (cls, text) => el('span', { class: `badge ${cls}` }, text);

function setStatus(msg, kind = 'ok') {
  const s = $('#status');
  s.textContent = msg;
  s.className = kind;
}

// An error stays until its cause is gone: a user's action or a new view clears the line, and
// an error of the periodic refresh (relay unreachable, database down) clears when a refresh
// succeeds again.
function report(err, origin = 'action') {
  state.errorOrigin = origin;
  setStatus(err && err.message ? err.message : String(err), 'error');
}

function clearError(origin) {
  if ($('#status').className !== 'error') return;
  if (origin && state.errorOrigin !== origin) return;
  setStatus('');
}

function tokenMessage(msg) {
  $('#token-msg').textContent = msg;
  $('#token').classList.toggle('bad', msg !== '');
}

// ---------------------------------------------------------------- API

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// The token travels only in the Authorization header: never a cookie, never the URL.
async function api(method, path, body) {
  const headers = { Accept: 'application/json' };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  const init = { method, headers, cache: 'no-store' };
  if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  let res;
  try {
    res = await fetch(path, init);
  } catch (e) {
    throw new ApiError(0, `relay unreachable (${e.message})`);
  }
  const data = await res.json().catch(() => null); // error bodies may be empty
  if (res.ok) {
    tokenMessage('');
    return data;
  }
  const msg = data && typeof data.error === 'string' ? data.error : `HTTP ${res.status}`;
  if (res.status === 401) tokenMessage(token ? 'wrong token' : 'token required');
  if (res.status === 403) setMutations(false);
  throw new ApiError(res.status, msg);
}

// Disable a button while its request runs (no double submits), report errors.
async function run(button, fn) {
  clearError();
  if (button) button.disabled = true;
  try {
    await fn();
  } catch (e) {
    report(e);
  } finally {
    if (button) button.disabled = button.classList.contains('mutation') && state.mutations === false;
  }
}

// Mutating buttons carry class "mutation"; CSS hides them while body.readonly.
function setMutations(on) {
  const changed = state.mutations !== on;
  state.mutations = on;
  let notice = $('#mutations-off');
  if (!on && !notice) {
    notice = el('p', { id: 'mutations-off', role: 'note' },
      'Changes are off: this relay has no admin token configured (admin.token)');
    $('header').after(notice);
  } else if (on && notice) {
    notice.remove();
  }
  document.body.classList.toggle('readonly', !on);
  // Only on a change, so the 5 s refresh does not re-enable a button whose request runs.
  if (changed) for (const b of document.querySelectorAll('button.mutation')) b.disabled = !on;
}

// ---------------------------------------------------------------- overview

// Replace a cell's content only when its value changed, so elements a user
// (or a WebDriver test) holds on to survive the 5 s refresh.
function setCell(td, value, render) {
  const sig = JSON.stringify(value === undefined ? null : value);
  if (td.dataset.sig === sig) return;
  td.dataset.sig = sig;
  td.replaceChildren(render ? render(value) : String(value ?? ''));
}

const deadHref = (name) => (name ? `#dead?destination=${encodeURIComponent(name)}` : '#dead');
const clip = (v) => (v ? el('span', { class: 'clip', title: v }, v) : '');

const DEST_CELLS = [
  { cls: 'name', value: (d) => d.name },
  { value: (d) => d.kind },
  // The target, with the destination's whole configuration (secrets masked) one click away.
  { value: (d) => [d.target, d.settings], render: ([t, s]) => el('details', { class: 'settings' },
    el('summary', {}, t === null ? '–' : clip(t)),
    el('pre', {}, JSON.stringify(s, null, 2))) },
  { value: (d) => d.breaker, render: (v) => badge(`breaker-${v}`, String(v).replace('_', ' ')) },
  { value: (d) => d.paused, render: (v) => (v ? badge('paused', 'paused') : '') },
  { cls: 'num', value: (d) => d.due },
  { cls: 'num', value: (d) => d.backoff },
  { cls: 'num', value: (d) => d.held },
  { cls: 'num', value: (d) => d.in_flight },
  { cls: 'num', value: (d) => d.failing },
  { cls: 'num', value: (d) => [d.name, d.dead], render: ([n, c]) => el('a', { href: deadHref(n) }, String(c)) },
  { cls: 'num', value: (d) => d.lag_seconds, render: fmtLag },
  { cls: 'num', value: (d) => d.rate_per_second, render: (v) => (v == null ? '–' : `${fmtRate(v)}/s`) },
  { cls: 'problem', value: (d) => d.problem, render: clip },
];

function destinationRow(name) {
  const tr = el('tr', { 'data-destination': name });
  for (const c of DEST_CELLS) tr.append(el('td', { class: c.cls }));
  // One button per row whose class flips pause <-> resume, so it stays the same element.
  tr.append(el('td', { class: 'action' },
    el('button', { type: 'button', class: 'mutation pause', disabled: state.mutations === false }, 'Pause')));
  return tr;
}

function renderOverview(ov) {
  $('#table-name').textContent = ov.table;
  $('#refreshed').textContent = `refreshed ${new Date().toLocaleTimeString()}`;
  setMutations(Boolean(ov.admin && ov.admin.mutations_enabled));

  const tbody = $('#destinations tbody');
  const keep = new Set();
  ov.destinations.forEach((d, i) => {
    const tr = [...tbody.rows].find((r) => r.dataset.destination === d.name) || destinationRow(d.name);
    if (tbody.rows[i] !== tr) tbody.insertBefore(tr, tbody.rows[i] || null);
    DEST_CELLS.forEach((c, j) => setCell(tr.cells[j], c.value(d), c.render));
    const btn = tr.querySelector('button');
    btn.className = `mutation ${d.paused ? 'resume' : 'pause'}`;
    btn.textContent = d.paused ? 'Resume' : 'Pause';
    keep.add(tr);
  });
  for (const tr of [...tbody.rows]) if (!keep.has(tr)) tr.remove();
  if (!ov.destinations.length) {
    tbody.append(el('tr', { class: 'empty' }, el('td', { colspan: 15 }, 'no destinations configured')));
  }

  for (const td of document.querySelectorAll('#totals td[data-k]')) {
    const k = td.dataset.k;
    const render = k === 'lag_seconds' ? fmtLag : k === 'dead' ? (v) => el('a', { href: '#dead' }, String(v)) : null;
    setCell(td, ov.totals[k], render);
  }

  state.destinations = ov.destinations.map((d) => d.name);
  fillDestinationSelect();
}

async function refreshOverview(withSamples) {
  const seq = ++state.overviewSeq;
  state.overviewInFlight += 1;
  try {
    const [ov, samples] = await Promise.all([
      api('GET', '/api/v1/overview'),
      withSamples ? api('GET', '/api/v1/samples') : null,
    ]);
    if (seq < state.overviewShown) return; // a newer answer is already on screen
    state.overviewShown = seq;
    renderOverview(ov);
    if (withSamples) renderChart(samples);
    clearError('refresh');
  } finally {
    state.overviewInFlight -= 1;
  }
}

function setPaused(button, name, pause) {
  const question = pause
    ? `Pause destination ${name}? Every relay stops sending to it.`
    : `Resume destination ${name}? Held events are sent again.`;
  if (!confirm(question)) return;
  run(button, async () => {
    const r = await api('POST', `/api/v1/destinations/${encodeURIComponent(name)}/${pause ? 'pause' : 'resume'}`);
    await refreshOverview(currentView() === 'overview');
    setStatus(pause ? `paused ${r.name}` : `resumed ${r.name}, released ${plural(r.released ?? 0, 'event')}`);
  });
}

// ---------------------------------------------------------------- chart

// Inline SVG, two lines: lag (left axis, seconds) and throughput (right axis, events/s).
function renderChart(data) {
  const box = $('#chart');
  const samples = (data && data.samples) || [];
  if (!samples.length) {
    box.replaceChildren(el('p', { class: 'empty' }, 'no samples yet'));
    return;
  }
  const W = 760, H = 200, L = 60, R = 70, T = 12, B = 24;
  const times = samples.map((s) => Date.parse(s.at));
  const t0 = times[0];
  const span = Math.max(times[times.length - 1] - t0, 1);
  const lags = samples.map((s) => s.lag_seconds ?? 0); // null = nothing pending = no lag
  const rates = samples.map((s) => s.published_per_second ?? 0);
  const lagMax = Math.max(...lags);
  const rateMax = Math.max(...rates);
  const x = (t) => L + ((t - t0) / span) * (W - L - R);
  const y = (v, max) => T + (1 - (max > 0 ? v / max : 0)) * (H - T - B);

  const svg = svgEl('svg', {
    viewBox: `0 0 ${W} ${H}`, role: 'img',
    'aria-label': `lag up to ${fmtLag(lagMax)}, throughput up to ${fmtRate(rateMax)} events per second`,
  });
  svg.append(svgEl('rect', { class: 'frame', x: L, y: T, width: W - L - R, height: H - T - B }));
  svg.append(svgEl('line', { class: 'grid', x1: L, x2: W - R, y1: (T + H - B) / 2, y2: (T + H - B) / 2 }));
  for (const [values, max, cls] of [[lags, lagMax, 'lag'], [rates, rateMax, 'rate']]) {
    const pts = values.map((v, i) => `${x(times[i]).toFixed(1)},${y(v, max).toFixed(1)}`);
    svg.append(svgEl('polyline', { class: `series ${cls}`, points: pts.join(' ') }));
    // Marks the latest value (and makes a single sample visible at all).
    const last = values.length - 1;
    svg.append(svgEl('circle', { class: `dot ${cls}`, r: 2.5, cx: x(times[last]), cy: y(values[last], max) }));
  }
  const text = (attrs, s) => svg.append(svgEl('text', attrs, s));
  text({ class: 'axis lag', x: L - 6, y: T + 4, 'text-anchor': 'end' }, fmtLag(lagMax));
  text({ class: 'axis lag', x: L - 6, y: H - B, 'text-anchor': 'end' }, '0 s');
  text({ class: 'axis rate', x: W - R + 6, y: T + 4 }, `${fmtRate(rateMax)}/s`);
  text({ class: 'axis rate', x: W - R + 6, y: H - B }, '0/s');
  const hhmm = (t) => { const d = new Date(t); return `${pad(d.getHours())}:${pad(d.getMinutes())}`; };
  text({ class: 'axis', x: L, y: H - 6 }, hhmm(t0));
  text({ class: 'axis', x: W - R, y: H - 6, 'text-anchor': 'end' }, hhmm(times[times.length - 1]));

  const latest = samples[samples.length - 1];
  const legend = el('p', { class: 'legend' },
    el('span', { class: 'key lag' }, 'lag (left axis)'),
    el('span', { class: 'key rate' }, 'events/s (right axis)'),
    el('span', { class: 'muted' },
      `latest: lag ${fmtLag(latest.lag_seconds)}, ${fmtRate(latest.published_per_second ?? 0)} events/s, ` +
      `${latest.pending ?? 0} pending · every ${data.interval_seconds} s`));
  box.replaceChildren(svg, legend);
}

// ---------------------------------------------------------------- audit log

function auditRow(c) {
  return el('tr', {},
    timeCell(c.at),
    el('td', {}, c.who),
    el('td', {}, c.via),
    el('td', {}, badge(`action-${c.action}`, c.action)),
    el('td', { class: 'num' }, String(c.matched)),
    el('td', { class: 'mono' }, JSON.stringify(c.filter)));
}

async function loadAudit(before) {
  const q = new URLSearchParams({ limit: String(PAGE_SIZE) });
  if (before) q.set('before', String(before));
  const r = await api('GET', `/api/v1/audit?${q}`);
  const tbody = $('#audit-list');
  const rows = r.changes.map(auditRow);
  if (before) tbody.append(...rows);
  else if (rows.length) tbody.replaceChildren(...rows);
  else tbody.replaceChildren(el('tr', { class: 'empty' }, el('td', { colspan: 6 }, 'no changes recorded yet')));
  state.auditBefore = r.next_before ?? null;
  $('#audit-older').hidden = state.auditBefore == null;
}

// ---------------------------------------------------------------- routing

const VIEWS = ['overview', 'dead', 'replays', 'destinations', 'audit'];

function currentView() {
  const view = location.hash.slice(1).split('?')[0];
  return VIEWS.includes(view) ? view : 'overview';
}

function route() {
  clearError();
  const view = currentView();
  for (const v of VIEWS) {
    $(`#view-${v}`).hidden = view !== v;
    const nav = $(`#nav-${v}`);
    nav.classList.toggle('active', view === v);
    if (view === v) nav.setAttribute('aria-current', 'page');
    else nav.removeAttribute('aria-current');
  }
  if (view === 'dead') {
    const q = location.hash.indexOf('?');
    if (q >= 0) applyParams(new URLSearchParams(location.hash.slice(q + 1)));
    refreshOverview(false).catch(report); // destination names + mutations flag
    search().catch(report);
  } else if (view === 'replays') {
    showReplays(); // replays.js
  } else if (view === 'destinations') {
    showDestinations(); // destinations.js
  } else if (view === 'audit') {
    loadAudit(null).catch(report);
  } else {
    refreshOverview(true).catch(report);
  }
}

function saveToken() {
  const v = $('#token').value.trim();
  if (v === (sessionStorage.getItem(TOKEN_KEY) || '')) return;
  if (v) sessionStorage.setItem(TOKEN_KEY, v);
  else sessionStorage.removeItem(TOKEN_KEY);
  tokenMessage('');
  route(); // reload what is on screen with the new token
}

function start() {
  $('#token').value = sessionStorage.getItem(TOKEN_KEY) || '';
  $('#token').addEventListener('change', saveToken);
  window.addEventListener('hashchange', route);

  // Delegated: rows are re-rendered, the table and list bodies are not.
  $('#destinations').addEventListener('click', (e) => {
    const b = e.target.closest('button.pause, button.resume');
    if (b) setPaused(b, b.closest('tr').dataset.destination, b.classList.contains('pause'));
  });
  const openRow = (e) => {
    const tr = e.target.closest('tr[data-id]');
    if (tr) openEvent(tr.dataset.id).catch(report);
  };
  $('#dead-list').addEventListener('click', openRow);
  $('#dead-list').addEventListener('keydown', (e) => { if (e.key === 'Enter') openRow(e); });

  const form = $('#dead-filter');
  form.addEventListener('submit', (e) => {
    e.preventDefault();
    run(form.querySelector('button[type=submit]'), search);
  });
  form.addEventListener('reset', () => setTimeout(() => search().catch(report), 0)); // after the fields reset
  $('#dead-next').addEventListener('click', (e) => run(e.currentTarget, () => loadDead(state.nextCursor, state.page + 1)));
  $('#dead-prev').addEventListener('click', (e) => run(e.currentTarget, () => loadDead(state.cursors[state.page - 2] ?? null, state.page - 1)));
  $('#audit-older').addEventListener('click', (e) => run(e.currentTarget, () => loadAudit(state.auditBefore)));
  $('#retry-all').addEventListener('click', (e) => bulk(e.currentTarget, 'retry'));
  $('#discard-all').addEventListener('click', (e) => bulk(e.currentTarget, 'discard'));
  $('#event-retry').addEventListener('click', (e) => eventAction(e.currentTarget, 'retry'));
  $('#event-discard').addEventListener('click', (e) => eventAction(e.currentTarget, 'discard'));
  $('#event-close').addEventListener('click', closeEvent);

  // Poll only while the overview is visible; skip a tick if the last one is still running.
  setInterval(() => {
    if (currentView() !== 'overview' || document.hidden || state.overviewInFlight) return;
    refreshOverview(true).catch((e) => report(e, 'refresh'));
  }, REFRESH_MS);

  route();
}

document.addEventListener('DOMContentLoaded', start);
