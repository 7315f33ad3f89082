// pgoutbox operator console: the Destinations view — destinations added at runtime, a page at a
// time (by name, searched by name or definition), a form to add one and a button to remove one.
// Loaded after app.js (same CSP, same rules: no inline handlers or styles, server data only
// through textContent) and uses its helpers: $, el, api, run, report, setStatus, clip, plural,
// state, refreshOverview. app.js's route() calls showDestinations() when the view opens.
'use strict';

const DEST_LIMIT = 100;

const dests = {
  pages: [null], // the `after` of each page seen, so Previous goes back
  page: 0,
  next: null,
  search: '',
};

function destRow(d) {
  const def = d.definition || {};
  const target = def.url || def.queue_url || def.topic_arn || def.stream || def.subject || def.bucket || '';
  return el('tr', { 'data-name': d.name },
    el('td', { class: 'name' }, d.name),
    el('td', {}, String(def.type || '')),
    el('td', {}, clip(String(target))),
    el('td', {}, clip((def.topics || []).join(', ') || 'every topic')),
    el('td', {}, d.secrets.length ? d.secrets.join(', ') : '—'),
    el('td', {}, fmtTime(d.updated_at)),
    el('td', { class: 'action' }, el('button', {
      type: 'button', class: 'mutation danger', 'data-remove': d.name, disabled: state.mutations === false,
    }, 'Remove')));
}

async function loadDestinations() {
  const q = new URLSearchParams({ limit: String(DEST_LIMIT) });
  if (dests.search) q.set('search', dests.search);
  const after = dests.pages[dests.page];
  if (after) q.set('after', after);
  const r = await api('GET', `/api/v1/destinations?${q}`);
  const rows = r.destinations.map(destRow);
  for (const name of r.file) {
    rows.unshift(el('tr', { class: 'file' }, el('td', { class: 'name' }, name),
      el('td', { colspan: 6, class: 'muted' }, 'in the configuration file (changed there)')));
  }
  if (!rows.length) {
    rows.push(el('tr', { class: 'empty' }, el('td', { colspan: 7 },
      dests.search ? 'no destination matches' : 'no destinations added at runtime yet: add one above, or run pgoutbox destinations add')));
  }
  $('#dest-list').replaceChildren(...rows);
  dests.next = r.next_after ?? null;
  $('#dest-next').hidden = dests.next == null;
  $('#dest-prev').hidden = dests.page === 0;
  $('#dest-page').textContent = `page ${dests.page + 1}`;
}

// The form as a definition: the common keys, then KEY=VALUE lines (values read as JSON when they are).
function destBody() {
  const form = new FormData($('#dest-form'));
  const text = (k) => String(form.get(k) || '').trim();
  const body = { name: text('name'), type: text('type') };
  const topics = text('topics').split(',').map((t) => t.trim()).filter(Boolean);
  if (topics.length) body.topics = topics;
  if (text('url')) body.url = text('url');
  if (text('secret')) body.secret = text('secret');
  if (text('filter')) body.filter = text('filter');
  for (const line of text('more').split('\n').map((l) => l.trim()).filter(Boolean)) {
    const at = line.indexOf('=');
    if (at < 1) throw new Error(`more settings: ${line}: expected KEY=VALUE`);
    const v = line.slice(at + 1).trim();
    try { body[line.slice(0, at).trim()] = JSON.parse(v); } catch { body[line.slice(0, at).trim()] = v; }
  }
  return body;
}

function addDestination(button) {
  run(button, async () => {
    const body = destBody();
    const r = await api('POST', '/api/v1/destinations', body);
    $('#dest-form').reset();
    await loadDestinations();
    setStatus(`destination ${r.name} added (version ${r.version}): every relay sends it events within a second`);
  });
}

function removeDestination(button, name) {
  if (!confirm(`Remove destination ${name}? Refused while it has undelivered events.`)) return;
  run(button, async () => {
    let r;
    try {
      r = await api('DELETE', `/api/v1/destinations/${encodeURIComponent(name)}`);
    } catch (e) {
      if (!/undelivered/.test(String(e.message))) throw e;
      if (!confirm(`${e.message}\n\nRemove it anyway and drop those events?`)) return;
      r = await api('DELETE', `/api/v1/destinations/${encodeURIComponent(name)}?drop_events=true`);
    }
    await loadDestinations();
    setStatus(`destination ${r.name} removed (version ${r.version})`);
  });
}

function showDestinations() {
  refreshOverview(false).catch(report); // mutations flag
  loadDestinations().catch(report);
}

function startDestinations() {
  $('#dest-form').addEventListener('submit', (e) => {
    e.preventDefault();
    addDestination($('#dest-add'));
  });
  $('#dest-search').addEventListener('submit', (e) => {
    e.preventDefault();
    dests.search = String(new FormData(e.currentTarget).get('search') || '').trim();
    dests.pages = [null];
    dests.page = 0;
    loadDestinations().catch(report);
  });
  $('#dest-next').addEventListener('click', () => {
    dests.pages[dests.page + 1] = dests.next;
    dests.page += 1;
    loadDestinations().catch(report);
  });
  $('#dest-prev').addEventListener('click', () => {
    dests.page = Math.max(0, dests.page - 1);
    loadDestinations().catch(report);
  });
  $('#dest-list').addEventListener('click', (e) => {
    const b = e.target.closest('button[data-remove]');
    if (b) removeDestination(b, b.dataset.remove);
  });
}

document.addEventListener('DOMContentLoaded', startDestinations);
