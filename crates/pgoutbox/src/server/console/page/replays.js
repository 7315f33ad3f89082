// pgoutbox operator console: the Replays view. Loaded after app.js (same CSP, same rules:
// no inline handlers or styles, server data only through textContent) and uses its helpers:
// $, el, api, run, report, setStatus, clearError, badge, timeCell, clip, plural, state,
// refreshOverview, currentView. app.js's route() calls showReplays() when the view opens.
'use strict';

const REPLAY_REFRESH_MS = 2000;
const REPLAY_LIMIT = 50;
// What each state allows (the API answers 409 otherwise), and what each change did.
const REPLAY_ACTIONS = { running: ['pause', 'cancel'], paused: ['resume', 'cancel'] };
const REPLAY_DONE = { pause: 'paused', resume: 'resumed', cancel: 'cancelled' };

const replays = {
  seq: 0, // request counter, so a late answer never overwrites a newer one
  shown: 0,
  inFlight: 0,
};

// ---------------------------------------------------------------- list

function replayProgress(r) {
  const total = Math.max(r.total, r.read);
  const value = total > 0 ? r.read : r.walked ? 1 : 0;
  return el('td', { class: 'progress' },
    el('progress', { max: String(Math.max(total, 1)), value: String(value), title: `${r.read} of ${r.total} read` }),
    el('span', { class: 'num' }, `${r.read} / ${r.total}`));
}

// What it sends, in one line: times, topics, keys, its own filter and rate.
function replaySelection(r) {
  const parts = [];
  if (r.since) parts.push(`since ${fmtTime(r.since)}`);
  if (r.until) parts.push(`until ${fmtTime(r.until)}`);
  if (r.topics.length) parts.push(`topics ${r.topics.join(', ')}`);
  if (r.keys.length) parts.push(`keys ${r.keys.join(', ')}`);
  if (r.filter) parts.push(`filter ${r.filter}`);
  if (r.rate) parts.push(`rate ${r.rate}`);
  if (r.backfill) parts.push('backfill');
  return parts.length ? parts.join(' · ') : 'every retained event';
}

function replayRow(r) {
  const actions = (REPLAY_ACTIONS[r.state] || []).map((a) => el('button', {
    type: 'button',
    class: a === 'cancel' ? 'mutation danger' : 'mutation',
    'data-action': a,
    disabled: state.mutations === false,
  }, a[0].toUpperCase() + a.slice(1)));
  return el('tr', { 'data-replay': r.id, 'data-state': r.state },
    el('td', { class: 'mono', title: r.id }, `…${r.id.slice(-8)}`),
    el('td', { class: 'name' }, r.destination),
    el('td', { title: r.error || null }, badge(`replay-${r.state}`, r.state)),
    replayProgress(r),
    el('td', { class: 'num' }, `${r.queued} / ${r.delivered} / ${r.dead}`),
    el('td', {}, clip(replaySelection(r))),
    el('td', {}, r.created_by),
    timeCell(r.created_at),
    el('td', { class: 'action' }, ...actions));
}

// Rows whose replay did not change stay the same elements (a button a user holds survives).
function renderReplays(list) {
  const tbody = $('#replay-list');
  if (!list.length) {
    tbody.replaceChildren(el('tr', { class: 'empty' },
      el('td', { colspan: 9 }, 'no replays yet: start one above, or run pgoutbox replay start')));
    return;
  }
  const old = new Map([...tbody.rows].map((tr) => [tr.dataset.replay, tr]));
  tbody.replaceChildren(...list.map((r) => {
    const sig = JSON.stringify([r, state.mutations]);
    const kept = old.get(r.id);
    if (kept && kept.dataset.sig === sig) return kept;
    const tr = replayRow(r);
    tr.dataset.sig = sig;
    return tr;
  }));
}

async function loadReplays() {
  const seq = ++replays.seq;
  replays.inFlight += 1;
  try {
    const r = await api('GET', `/api/v1/replays?limit=${REPLAY_LIMIT}`);
    if (seq < replays.shown) return; // a newer answer is already on screen
    replays.shown = seq;
    renderReplays(r.replays);
    clearError('refresh');
  } finally {
    replays.inFlight -= 1;
  }
}

// ---------------------------------------------------------------- start

function fillReplayDestinations() {
  const select = $('#replay-destination');
  const current = select.value;
  const have = [...select.options].map((o) => o.value);
  if (have.join('\n') !== state.destinations.join('\n')) {
    select.replaceChildren(...state.destinations.map((n) => el('option', { value: n }, n)));
  }
  if (current && state.destinations.includes(current)) select.value = current;
}

// datetime-local is local time without zone; the API wants RFC 3339 (sent as UTC).
function replayTime(name, value) {
  const d = new Date(value);
  if (Number.isNaN(d.getTime())) throw new Error(`${name}: not a valid time`);
  return d.toISOString().replace(/\.\d{3}Z$/, 'Z');
}

function replayBody(dryRun) {
  const form = new FormData($('#replay-form'));
  const text = (k) => String(form.get(k) || '').trim();
  const body = { destination: text('destination') };
  if (!body.destination) throw new Error('destination: choose one (the overview lists them)');
  for (const k of ['since', 'until']) if (text(k)) body[k] = replayTime(k, text(k));
  const topics = text('topics').split(',').map((t) => t.trim()).filter(Boolean);
  if (topics.length) body.topics = topics;
  for (const k of ['filter', 'rate']) if (text(k)) body[k] = text(k);
  if (dryRun) body.dry_run = true;
  return body;
}

function dryRun(button) {
  run(button, async () => {
    const body = replayBody(true);
    $('#replay-count').textContent = 'counting…';
    try {
      const r = await api('POST', '/api/v1/replays', body);
      const skipped = r.unreadable ? ` (${plural(r.unreadable, 'row')} cannot be read and would be skipped)` : '';
      // A long range is counted for a few seconds only: the counts are then of the events read.
      const partly = r.complete ? '' : ' (counted so far: the range is larger; `pgoutbox replay start --dry-run` counts all of it)';
      $('#replay-count').textContent =
        `${r.would_send} of ${plural(r.read, 'retained event')} in range would be sent to ${body.destination}${skipped}${partly}`;
    } catch (e) {
      $('#replay-count').textContent = '';
      throw e;
    }
  });
}

function startReplay(button) {
  run(button, async () => {
    const body = replayBody(false);
    if (!confirm(`Send the retained events of this selection again to ${body.destination}?`)) return;
    const r = await api('POST', '/api/v1/replays', body);
    $('#replay-count').textContent = '';
    await loadReplays();
    setStatus(`replay ${r.id} to ${r.destination} started: up to ${plural(r.total, 'event')}`);
  });
}

// ---------------------------------------------------------------- steer

function steerReplay(button, id, action) {
  const question = action === 'cancel'
    ? `Cancel replay ${id}? Its queued, undelivered events are dropped; it cannot be resumed.`
    : `${action === 'pause' ? 'Pause' : 'Resume'} replay ${id}?`;
  if (!confirm(question)) return;
  run(button, async () => {
    const r = await api('POST', `/api/v1/replays/${encodeURIComponent(id)}/${action}`);
    await loadReplays();
    setStatus(`${REPLAY_DONE[action]} replay ${r.id} to ${r.destination}`);
  });
}

// ---------------------------------------------------------------- view

function showReplays() {
  refreshOverview(false).then(fillReplayDestinations).catch(report); // names + mutations flag
  loadReplays().catch(report);
}

function startReplays() {
  $('#replay-dry').addEventListener('click', (e) => dryRun(e.currentTarget));
  $('#replay-form').addEventListener('submit', (e) => {
    e.preventDefault();
    startReplay($('#replay-start'));
  });
  $('#replay-list').addEventListener('click', (e) => {
    const b = e.target.closest('button[data-action]');
    if (b) steerReplay(b, b.closest('tr').dataset.replay, b.dataset.action);
  });
  // Every 2 s while the view is open; skip a tick if the last one is still running.
  setInterval(() => {
    if (currentView() !== 'replays' || document.hidden || replays.inFlight) return;
    loadReplays().catch((e) => report(e, 'refresh'));
  }, REPLAY_REFRESH_MS);
}

document.addEventListener('DOMContentLoaded', startReplays);
