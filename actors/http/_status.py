"""``GET /``: a small self-contained status page (no CDN; nothing fetched from elsewhere).

The page is static HTML with inline CSS and JavaScript. Every 2 seconds it
fetches ``/stats`` from the same server and shows the model, each tier's
bytes against its cap and its hit rate, the durability state, the memory
guard, the queues and every actor's mailbox. The page itself holds no data,
so it is served without the API key; ``/stats`` still needs it, and when
``/stats`` answers 401 the page asks for the key and keeps it for the
browser tab (``sessionStorage``), sending it as ``Authorization: Bearer``.

Each figure sits in an element with a ``data-figure`` name (the test reads
them back in headless Chromium).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

__all__ = ["STATUS_PAGE", "install_status"]

STATUS_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>kvtier status</title>
<style>
  :root { --fg: #1d2330; --muted: #667085; --line: #e4e7ec; --bar: #3b82f6; --warn: #d92d20;
          --ok: #039855; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif;
         color: var(--fg); background: #f8fafc; }
  header { padding: 14px 24px; background: #101828; color: #fff; display: flex;
           align-items: baseline; gap: 16px; flex-wrap: wrap; }
  header h1 { font-size: 18px; margin: 0; }
  header .sub { color: #cbd5e1; }
  main { padding: 16px 24px; display: grid; gap: 16px;
         grid-template-columns: repeat(auto-fit, minmax(320px, 1fr)); }
  section { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 12px 16px; }
  section.wide { grid-column: 1 / -1; }
  h2 { font-size: 13px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted);
       margin: 0 0 8px; }
  table { border-collapse: collapse; width: 100%; }
  td, th { text-align: left; padding: 3px 6px; border-bottom: 1px solid var(--line);
           font-variant-numeric: tabular-nums; }
  th { color: var(--muted); font-weight: 500; }
  td.num, th.num { text-align: right; }
  .bar { height: 8px; background: var(--line); border-radius: 4px; overflow: hidden; margin: 4px 0 8px; }
  .bar > div { height: 100%; background: var(--bar); width: 0; }
  .ok { color: var(--ok); font-weight: 600; }
  .bad { color: var(--warn); font-weight: 600; }
  #error { color: var(--warn); }
  #auth { display: none; gap: 8px; align-items: center; }
  #auth input { padding: 4px 6px; }
</style>
</head>
<body>
<header>
  <h1>kvtier</h1>
  <span class="sub">model <b data-figure="model">…</b></span>
  <span class="sub">state <b data-figure="state">…</b></span>
  <span class="sub">updated <span data-figure="updated">never</span></span>
  <span id="error"></span>
  <form id="auth"><label>API key <input id="key" type="password" autocomplete="off"></label>
    <button>Use</button></form>
</header>
<main>
  <section>
    <h2>RAM tier</h2>
    <div><span data-figure="ram-bytes">–</span> of <span data-figure="ram-cap">–</span>
      (<span data-figure="ram-entries">–</span> entries)</div>
    <div class="bar"><div data-bar="ram"></div></div>
    <div>hit rate <b data-figure="ram-hit-rate">–</b>
      (<span data-figure="ram-hits">–</span> of <span data-figure="lookups">–</span> lookups)</div>
  </section>
  <section>
    <h2>SSD tier</h2>
    <div><span data-figure="ssd-bytes">–</span> of <span data-figure="ssd-cap">–</span>
      (<span data-figure="ssd-entries">–</span> files)</div>
    <div class="bar"><div data-bar="ssd"></div></div>
    <div>hit rate <b data-figure="ssd-hit-rate">–</b>
      (<span data-figure="ssd-hits">–</span> restores served)</div>
  </section>
  <section>
    <h2>Durability</h2>
    <table>
      <tr><th>dirty records</th><td class="num" data-figure="dirty">–</td></tr>
      <tr><th>pending snapshots</th><td class="num" data-figure="pending-snapshots">–</td></tr>
      <tr><th>last flush</th><td class="num" data-figure="last-flush">–</td></tr>
      <tr><th>longest durable prefix</th><td class="num" data-figure="longest-durable">–</td></tr>
      <tr><th>spill queue</th><td class="num" data-figure="spill-queue">–</td></tr>
    </table>
  </section>
  <section>
    <h2>Queues</h2>
    <table>
      <tr><th>lane</th><td class="num" data-figure="lane">–</td></tr>
      <tr><th>waiting requests</th><td class="num" data-figure="queued">–</td></tr>
      <tr><th>responses in flight</th><td class="num" data-figure="in-flight">–</td></tr>
      <tr><th>background steps waiting</th><td class="num" data-figure="background">–</td></tr>
      <tr><th>memory (active / budget)</th><td class="num" data-figure="memory">–</td></tr>
    </table>
  </section>
  <section class="wide">
    <h2>Mailboxes</h2>
    <table>
      <thead><tr><th>actor</th><th class="num">depth</th><th class="num">capacity</th>
        <th class="num">handled</th><th class="num">p50 wait</th><th class="num">p99 wait</th>
        <th>state</th></tr></thead>
      <tbody data-figure="mailboxes"></tbody>
    </table>
  </section>
</main>
<script>
"use strict";
const REFRESH_MS = 2000;
const $ = (name) => document.querySelector(`[data-figure="${name}"]`);
const set = (name, text) => { const el = $(name); if (el) el.textContent = text; };
function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0, v = Number(n);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i === 0 ? v.toFixed(0) : v.toFixed(1)) + " " + units[i];
}
function pct(part, whole) {
  return whole > 0 ? (100 * part / whole).toFixed(1) + " %" : "–";
}
function ms(seconds) { return (1000 * Number(seconds || 0)).toFixed(2) + " ms"; }
function bar(name, part, whole) {
  const el = document.querySelector(`[data-bar="${name}"]`);
  if (el) el.style.width = whole > 0 ? Math.min(100, 100 * part / whole).toFixed(1) + "%" : "0";
}
function headers() {
  const key = sessionStorage.getItem("kvtier-api-key");
  return key ? { "Authorization": "Bearer " + key } : {};
}
function render(stats) {
  const e = stats.engine || {}, http = stats.http || {};
  const ram = e.prompt_cache || {}, ssd = e.ssd_cache || {};
  const token = (e.gateway || {}).token || {}, memory = e.memory || {};
  set("model", e.model || "–");
  set("state", e.state || "–");
  set("ram-bytes", bytes(ram.retained_bytes));
  set("ram-cap", bytes(ram.cap_bytes));
  set("ram-entries", ram.entries ?? "–");
  bar("ram", ram.retained_bytes || 0, ram.cap_bytes || 0);
  const ramHits = ram.hits || 0, ssdHits = ram.ssd_hits || ssd.hits || 0;
  const lookups = ramHits + ssdHits + (ram.misses || 0);
  set("lookups", lookups);
  set("ram-hits", ramHits);
  set("ram-hit-rate", pct(ramHits, lookups));
  if (e.ssd_cache) {
    set("ssd-bytes", bytes(ssd.bytes));
    set("ssd-cap", bytes(ssd.max_bytes));
    set("ssd-entries", ssd.entries ?? "–");
    bar("ssd", ssd.bytes || 0, ssd.max_bytes || 0);
    set("ssd-hits", ssdHits);
    set("ssd-hit-rate", pct(ssdHits, lookups));
    set("dirty", ssd.writebehind_dirty ?? "–");
    set("pending-snapshots", ssd.pending_snapshots ?? "–");
    const last = ssd.last_flush_durable;
    const lastEl = $("last-flush");
    lastEl.textContent = last === null || last === undefined ? "none yet"
      : (last ? "durable" : "not durable");
    lastEl.className = "num " + (last === true ? "ok" : last === false ? "bad" : "");
    set("longest-durable", (ssd.longest_durable_prefix_tokens ?? "–") + " tokens");
    set("spill-queue", `${ssd.pending_spills ?? 0} items, ` +
        `${bytes(ssd.pending_spill_bytes)} of ${bytes(ssd.spill_queue_cap_bytes)}`);
  } else {
    for (const name of ["ssd-bytes", "ssd-cap", "ssd-entries", "ssd-hits", "ssd-hit-rate",
                        "dirty", "pending-snapshots", "last-flush", "longest-durable",
                        "spill-queue"]) set(name, "off");
  }
  set("lane", token.lane || "free");
  set("queued", `${token.queued ?? "–"} of ${token.max_queue ?? "–"}`);
  set("in-flight", http.in_flight ?? "–");
  set("background", token.background_waiting ?? "–");
  set("memory", memory.budget_bytes
    ? `${bytes(memory.active_bytes)} / ${bytes(memory.budget_bytes)}` : "–");
  const body = $("mailboxes");
  body.replaceChildren();
  for (const a of ((e.mailboxes || {}).actors || [])) {
    const row = document.createElement("tr");
    row.dataset.actor = a.address;
    for (const [text, num] of [[a.address, false], [a.depth, true], [a.capacity, true],
                               [a.handled, true], [ms(a.time_in_mailbox_p50), true],
                               [ms(a.time_in_mailbox_p99), true], [a.state, false]]) {
      const cell = document.createElement("td");
      cell.textContent = String(text);
      if (num) cell.className = "num";
      row.appendChild(cell);
    }
    body.appendChild(row);
  }
  set("updated", new Date().toLocaleTimeString());
}
async function refresh() {
  try {
    const r = await fetch("/stats", { headers: headers(), cache: "no-store" });
    if (r.status === 401) {
      document.getElementById("auth").style.display = "flex";
      document.getElementById("error").textContent = "/stats needs the API key";
      return;
    }
    if (!r.ok) throw new Error("/stats answered " + r.status);
    render(await r.json());
    document.getElementById("error").textContent = "";
  } catch (err) {
    document.getElementById("error").textContent = String(err.message || err);
  }
}
document.getElementById("auth").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("kvtier-api-key", document.getElementById("key").value);
  document.getElementById("auth").style.display = "none";
  refresh();
});
refresh();
setInterval(refresh, REFRESH_MS);
</script>
</body>
</html>
"""
"""The page: inline CSS and script only; it fetches nothing but ``/stats`` from its own origin."""


def install_status(app: FastAPI) -> None:
    """Register ``GET /`` (the status page)."""

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def status_page() -> HTMLResponse:
        """The self-refreshing status page."""
        return HTMLResponse(STATUS_PAGE, headers={
            # NOTE: the page loads nothing from elsewhere; the policy makes sure of it.
            "Content-Security-Policy": "default-src 'self'; style-src 'unsafe-inline'; "
                                       "script-src 'unsafe-inline'; connect-src 'self'",
            "Cache-Control": "no-store",
        })
