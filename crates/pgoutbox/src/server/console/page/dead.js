// pgoutbox operator console: the dead letters view and its event panel (list, filter, pages,
// one event's deliveries and attempts, retry and discard one or all). Plain ES2020 like app.js,
// whose helpers (el, api, run, state) it uses; app.js routes to it and wires its buttons.

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
