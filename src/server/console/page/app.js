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

// ---------------------------------------------------------------- dead letters

function fillDestinationSelect() {
  const select = $('#filter-destination');
  const current = select.value;
  const names = [...state.destinations];
  if (current && !names.includes(current)) names.push(current); // keep a filter from the URL
  const have = [...select.options].slice(1).map((o) => o.value);
  if (have.join('\n') !== names.join('\n')) {
    select.replaceChildren(el('option', { value: '' }, 'any'), ...names.map((n) => el('option', { value: n }, n)));
  }
  select.value = current;
}

function readFilter() {
  const form = new FormData($('#dead-filter'));
  const out = {};
  for (const k of ['state', 'destination', 'topic', 'topic_prefix', 'payload', 'key', 'id']) {
    const v = String(form.get(k) || '').trim();
    if (v) out[k] = v;
  }
  // datetime-local is local time without zone; the API wants RFC 3339 (sent as UTC).
  for (const k of ['since', 'until']) {
    const v = form.get(k);
    if (!v) continue;
    const d = new Date(v);
    if (Number.isNaN(d.getTime())) throw new Error(`${k}: not a valid time`);
    out[k] = d.toISOString().replace(/\.\d{3}Z$/, 'Z');
  }
  return out;
}

// #dead?destination=hooks&topic=... sets the whole filter (links from the overview);
// fields it does not name go back to their defaults.
function applyParams(params) {
  const form = $('#dead-filter');
  const dest = params.get('destination');
  const select = form.elements.destination;
  if (dest && ![...select.options].some((o) => o.value === dest)) select.append(el('option', { value: dest }, dest));
  for (const k of ['destination', 'state', 'topic', 'topic_prefix', 'payload', 'key', 'id', 'since', 'until']) {
    form.elements[k].value = (k === 'since' || k === 'until') ? '' : params.get(k) ?? (k === 'state' ? 'dead' : '');
  }
}

function eventRow(ev) {
  return el('tr', { 'data-id': ev.id, tabindex: 0, class: ev.id === state.eventId ? 'selected' : null },
    el('td', { class: 'mono', title: ev.id }, ev.id.slice(0, 8)),
    el('td', ev.topic == null ? { class: 'none' } : {}, ev.topic ?? NO_TOPIC),
    el('td', {}, ev.key ?? ''),
    el('td', {}, ev.destination ?? ''),
    el('td', {}, badge(`state-${ev.state}`, ev.state)),
    el('td', { class: 'num' }, String(ev.attempts ?? '')),
    el('td', { class: 'error', title: ev.last_error || null }, truncate(ev.last_error, 90)),
    timeCell(ev.created_at, 'created'),
    timeCell(ev.dead_at));
}

// Pages go forward by the API's cursor; the cursors of the pages seen are kept, so that
// "Previous page" goes back exactly. The total is counted once per search (on its first page).
async function loadDead(cursor, page) {
  const q = new URLSearchParams(readFilter());
  q.set('limit', String(PAGE_SIZE));
  if (cursor) q.set('cursor', cursor);
  if (page === 1) q.set('total', 'true');
  const r = await api('GET', `/api/v1/events?${q}`);
  if (page === 1) {
    state.cursors = [null];
    state.total = r.total ?? null;
    state.totalCap = r.total_cap ?? null;
  }
  state.cursors[page - 1] = cursor;
  Object.assign(state, { cursor, page, nextCursor: r.next_cursor || null });
  const tbody = $('#dead-list');
  if (r.events.length) tbody.replaceChildren(...r.events.map(eventRow));
  else tbody.replaceChildren(el('tr', { class: 'empty' }, el('td', { colspan: 9 }, 'no events match this filter')));
  const total = state.total == null ? ''
    : state.total >= state.totalCap ? ` of ${state.total.toLocaleString()}+ matches`
      : ` of ${state.total} ${state.total === 1 ? 'match' : 'matches'}`;
  $('#dead-page').textContent = `page ${page} · ${plural(r.events.length, 'event')}${total}`;
  $('#dead-next').hidden = !state.nextCursor;
  $('#dead-prev').hidden = page <= 1;
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

async function search() {
  const { id } = readFilter();
  await Promise.all([loadDead(null, 1), id ? openEvent(id) : null]);
}

async function openEvent(id) {
  state.eventId = id;
  for (const tr of $('#dead-list').rows) tr.classList.toggle('selected', tr.dataset.id === id);
  const ev = await api('GET', `/api/v1/events/${encodeURIComponent(id)}`);
  if (state.eventId !== id) return; // the user clicked another row meanwhile
  renderEvent(ev);
}

function closeEvent() {
  state.eventId = null;
  $('#event').hidden = true;
  $('#view-dead').classList.remove('with-event');
  for (const tr of $('#dead-list').rows) tr.classList.remove('selected');
}

// After a retry/discard the event may be gone: close the panel instead of erroring.
async function reloadEvent() {
  if (!state.eventId) return;
  try {
    await openEvent(state.eventId);
  } catch (e) {
    if (e.status === 404) closeEvent();
    else throw e;
  }
}

// One "when" column keeps the deliveries table narrow enough for the side panel.
function deliveryWhen(d) {
  const [label, at] = d.dead_at ? ['dead', d.dead_at]
    : d.published_at ? ['published', d.published_at]
      : d.next_attempt_at ? ['next attempt', d.next_attempt_at] : ['', null];
  return el('td', { class: 'time', title: at }, at ? `${label} ${fmtTime(at)}` : '');
}

function renderEvent(ev) {
  $('#event-id').textContent = ev.id;
  $('#event-seq').textContent = String(ev.seq ?? '');
  $('#event-topic').textContent = ev.topic ?? NO_TOPIC;
  $('#event-key').textContent = ev.key ?? '(none)';
  $('#event-created').textContent = fmtTime(ev.created_at);
  $('#event-created').title = ev.created_at || '';
  const deliveries = ev.deliveries || [];
  const states = deliveries.map((d) => d.state);
  $('#event-state').textContent = states.length ? states.join(', ') : 'no deliveries';
  $('#event-deliveries').replaceChildren(...deliveries.map((d) => el('tr', {},
    el('td', {}, d.destination),
    el('td', {}, badge(`state-${d.state}`, d.state)),
    el('td', { class: 'num' }, String(d.attempts ?? '')),
    el('td', { class: 'error-full' }, d.last_error || ''),
    deliveryWhen(d))));
  const attempts = ev.attempts || [];
  $('#event-attempts').replaceChildren(...(attempts.length ? attempts.map((a) => el('tr', {},
    el('td', { title: a.at }, fmtTime(a.at)),
    el('td', {}, a.destination ?? ''),
    el('td', { class: 'error-full' }, a.dead ? `${a.error} (dead-lettered)` : a.error))) :
    [el('tr', {}, el('td', { colspan: 3 }, 'none recorded'))]));
  $('#event-headers').textContent = ev.headers == null ? '(none)' : JSON.stringify(ev.headers, null, 2);
  $('#event-payload').textContent = JSON.stringify(ev.payload, null, 2) ?? 'null';
  const dead = states.includes('dead');
  $('#event-retry').hidden = !dead;
  $('#event-discard').hidden = !dead;
  $('#event').hidden = false;
  $('#view-dead').classList.add('with-event');
}

function eventAction(button, action) {
  const id = state.eventId;
  if (!id) return;
  const question = action === 'retry' ? `Retry event ${id} now?` : `Discard event ${id} now? It will not be delivered.`;
  if (!confirm(question)) return;
  run(button, async () => {
    const r = await api('POST', `/api/v1/dead/${action}`, { ids: [id], dry_run: false });
    await loadDead(state.cursor, state.page);
    await reloadEvent();
    setStatus(`${PAST[action]} ${plural(r.matched, 'event')}`);
  });
}

// Dry run first for the count, then confirm, then the real run.
function bulk(button, action) {
  run(button, async () => {
    const f = readFilter();
    // The bulk endpoints match on topic and destination only; refuse rather than
    // act on more events than the list shows.
    if (f.key || f.id || f.since || f.until) {
      throw new Error('Bulk actions match on destination and topic only: clear key, event id, since and until first.');
    }
    const body = {};
    if (f.topic) body.topic = f.topic;
    if (f.destination) body.destination = f.destination;
    const dry = await api('POST', `/api/v1/dead/${action}`, { ...body, dry_run: true });
    if (!dry.matched) {
      setStatus('no dead events match this filter');
      return;
    }
    const verb = action === 'retry' ? 'Retry' : 'Discard';
    if (!confirm(`${verb} ${plural(dry.matched, 'dead event')} matching this filter?`)) {
      setStatus('cancelled');
      return;
    }
    const r = await api('POST', `/api/v1/dead/${action}`, { ...body, dry_run: false });
    await loadDead(null, 1);
    await reloadEvent();
    setStatus(`${PAST[action]} ${plural(r.matched, 'event')}`);
  });
}

// ---------------------------------------------------------------- routing

const VIEWS = ['overview', 'dead', 'replays', 'audit'];

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
