// kube-vgpu dashboard: polls GET api/view and renders it. Vanilla JS, no build step.
// Every string from the cluster goes into the page as a text node (el() below): never innerHTML.
"use strict";

const POLL_MS = 2000;
const PAGES = ["overview", "nodes", "pods", "queues"];
let latest = null;

// el("td", {class: "num", "data-field": "x"}, "text", childNode, ...): attributes by setAttribute, children as text
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value !== null && value !== undefined && value !== false) node.setAttribute(key, String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const fmt = (n) => (n === null || n === undefined ? "—" : Number(n).toLocaleString("en-US"));
const pct = (used, total) => (total ? Math.floor((100 * used) / total) : 0);
const gib = (mib) => (mib / 1024).toLocaleString("en-US", {maximumFractionDigits: 1});

// a bar with its figure as text beside it: the colour is never the only carrier of the value
function bar(used, total, field, unit) {
  const share = pct(used, total);
  const fill = el("span", {});
  fill.style.width = `${Math.min(share, 100)}%`; // CSSOM, not a style attribute: the page's CSP forbids inline styles
  return el("span", {class: "barcell"},
    el("span", {class: share >= 90 ? "bar high" : "bar", "aria-hidden": "true"}, fill),
    el("span", {"data-field": field, "data-value": used}, `${fmt(used)} / ${fmt(total)}${unit} (${share}%)`));
}

function table(caption, columns, rows, attrs) {
  const head = el("tr", {}, columns.map(([label, numeric]) => el("th", {scope: "col", class: numeric ? "num" : null}, label)));
  return el("table", attrs || {}, el("caption", {}, caption), el("thead", {}, head), el("tbody", {}, rows));
}

function health(ok, okText, badText) {
  return el("span", {class: ok ? "ok" : "bad"}, ok ? `✓ ${okText}` : `✗ ${badText}`);
}

function card(label, field, value, sub) {
  return el("div", {class: "card"}, el("dl", {},
    el("dt", {}, label), el("dd", {"data-field": field, "data-value": value}, fmt(value), sub ? el("span", {class: "sub"}, ` ${sub}`) : null)));
}

function renderOverview(view) {
  const o = view.overview;
  const s = o.stranded;
  const typical = `${fmt(s.typicalMemoryMiB)} MiB and ${s.typicalCores}% compute`;
  const pending = o.pending.length
    ? table("Pending pods by reason", [["Reason"], ["Pods", true]],
        o.pending.map((p) => el("tr", {}, el("th", {scope: "row"}, p.reason), el("td", {class: "num", "data-field": "count"}, fmt(p.count)))),
        {id: "pending-table"})
    : el("p", {class: "empty"}, view.quota.available ? "No pending pods, waiting gangs or preemptions." : "No waiting gangs or preemptions (pending pods by reason need the extender's quota gate).");
  return [
    el("div", {class: "cards"},
      card("GPU nodes", "nodes", o.nodes),
      card("GPUs", "gpus", o.gpus, o.unhealthyGpus ? `(${o.unhealthyGpus} unhealthy)` : "(all healthy)"),
      card("Memory assigned (MiB)", "usedMemoryMiB", o.usedMemoryMiB, `of ${fmt(o.memoryMiB)} (${pct(o.usedMemoryMiB, o.memoryMiB)}%)`),
      card("Compute assigned (cores, 100 per GPU)", "usedCores", o.usedCores, `of ${fmt(o.cores)} (${pct(o.usedCores, o.cores)}%)`),
      card("vGPUs assigned", "usedShares", o.usedShares, `of ${fmt(o.maxShares)}`),
      card("Pods holding GPUs", "pods", o.pods),
      card("Stranded free memory (MiB)", "strandedMemoryMiB", s.freeMemoryMiB, `on ${s.gpus} GPU(s)`)),
    table("Capacity", [["Resource"], ["Assigned", true], ["Capacity", true], ["Assigned %"]], [
      el("tr", {}, el("th", {scope: "row"}, "GPU memory (MiB)"), el("td", {class: "num"}, fmt(o.usedMemoryMiB)), el("td", {class: "num", "data-field": "memoryMiB", "data-value": o.memoryMiB}, fmt(o.memoryMiB)), el("td", {}, bar(o.usedMemoryMiB, o.memoryMiB, "memoryBar", ""))),
      el("tr", {}, el("th", {scope: "row"}, "GPU compute (cores)"), el("td", {class: "num"}, fmt(o.usedCores)), el("td", {class: "num", "data-field": "cores", "data-value": o.cores}, fmt(o.cores)), el("td", {}, bar(o.usedCores, o.cores, "coresBar", ""))),
      el("tr", {}, el("th", {scope: "row"}, "vGPUs"), el("td", {class: "num"}, fmt(o.usedShares)), el("td", {class: "num", "data-field": "maxShares", "data-value": o.maxShares}, fmt(o.maxShares)), el("td", {}, bar(o.usedShares, o.maxShares, "sharesBar", ""))),
    ], {id: "capacity-table"}),
    el("p", {class: "hint"}, `Stranded: free memory on healthy GPUs that cannot take one more vGPU of the typical size (${typical}; `,
      s.typicalLearned ? "the median of the vGPUs assigned now" : "a default: nothing is assigned yet",
      "), because too little memory or compute or no vGPU slot is left there. The extender's /state has no fragmentation figure of its own; this is the dashboard's estimate."),
    o.inventoryErrors ? el("p", {class: "bad"}, `${o.inventoryErrors} node(s) have a GPU inventory the extender ignores: see Nodes.`) : null,
    pending,
  ];
}

function renderNodes(view) {
  const query = document.getElementById("node-filter").value.trim().toLowerCase();
  const nodes = view.nodes.filter((n) => !query || n.name.toLowerCase().includes(query) || n.gpus.some((g) => g.model.toLowerCase().includes(query)));
  if (!nodes.length) return el("p", {class: "empty"}, query ? "No node matches the filter." : "The extender knows no GPU nodes.");
  return nodes.map((node) => {
    const heartbeat = node.heartbeatAgeSeconds === null ? "no heartbeat" : `heartbeat ${Math.round(node.heartbeatAgeSeconds)} s ago`;
    const rows = node.gpus.map((g) => el("tr", {"data-node": node.name, "data-gpu": g.index},
      el("th", {scope: "row"}, String(g.index)),
      el("td", {}, g.model),
      el("td", {}, health(g.healthy, "healthy", "unhealthy")),
      el("td", {}, bar(g.usedMemoryMiB, g.memoryMiB, "usedMemoryMiB", " MiB")),
      el("td", {}, bar(g.usedCores, g.cores, "usedCores", "")),
      el("td", {class: "num", "data-field": "usedShares", "data-value": g.usedShares}, g.migMode ? "MIG mode: see its MIG devices" : `${g.usedShares} / ${g.maxShares}`),
      el("td", {"data-field": "pods"}, g.pods.length ? el("ul", {class: "plain"}, g.pods.map((p) => el("li", {}, p))) : el("span", {class: "empty"}, "none"))));
    const parts = [
      el("h3", {}, node.name, el("span", {class: "meta"}, `${node.gpus.length} GPU(s) · ${node.pods} pod(s) · ${heartbeat}`)),
      node.inventoryError ? el("p", {class: "bad"}, `GPU inventory ignored: ${node.inventoryError}`) : null,
      table(`GPUs of ${node.name}`, [["GPU"], ["Model"], ["Health"], ["Memory assigned"], ["Compute assigned"], ["vGPUs", true], ["Pods sharing it"]], rows),
    ];
    if (node.mig.length) {
      parts.push(table(`MIG devices of ${node.name}`, [["GPU"], ["Profile"], ["Memory (MiB)", true], ["Health"], ["Held"]],
        node.mig.map((m) => el("tr", {"data-mig": m.uuid},
          el("th", {scope: "row"}, String(m.gpuIndex)), el("td", {}, m.profile), el("td", {class: "num"}, fmt(m.memoryMiB)),
          el("td", {}, health(m.healthy, "healthy", "unhealthy")), el("td", {}, m.held ? "held by a pod" : "free")))));
    }
    return el("article", {class: "node", "data-node": node.name}, parts);
  });
}

function renderPods(view) {
  const measured = view.usage.source === "prometheus";
  const note = document.getElementById("usage-note");
  note.textContent = measured
    ? "Assigned: what the extender gave each pod. Used: measured by the device plugin, read from Prometheus."
    : view.usage.error
      ? `Used: unavailable (${view.usage.error}).`
      : "Used: — (start the dashboard with --prometheus URL to show what pods measurably use; assigned figures come from the extender).";
  const query = document.getElementById("pod-filter").value.trim().toLowerCase();
  const pods = view.pods.filter((p) => !query || `${p.namespace}/${p.name} ${p.node}`.toLowerCase().includes(query));
  if (!pods.length) return el("p", {class: "empty"}, query ? "No pod matches the filter." : "No pod holds a GPU.");
  const rows = pods.map((p) => el("tr", {"data-pod": `${p.namespace}/${p.name}`},
    el("td", {}, p.namespace),
    el("th", {scope: "row"}, p.name),
    el("td", {"data-field": "node"}, p.node),
    el("td", {"data-field": "gpus"}, p.gpus.join(", ")),
    el("td", {class: "num", "data-field": "vgpus", "data-value": p.vgpus}, fmt(p.vgpus)),
    el("td", {class: "num", "data-field": "memoryMiB", "data-value": p.memoryMiB}, fmt(p.memoryMiB)),
    el("td", {class: "num", "data-field": "cores", "data-value": p.cores}, `${p.cores}%`),
    el("td", {class: "num", "data-field": "usedMemoryMiB"}, fmt(p.usedMemoryMiB)),
    el("td", {class: "num", "data-field": "utilizationPercent"}, p.utilizationPercent === null ? "—" : `${p.utilizationPercent}%`),
    el("td", {"data-field": "state"}, p.state)));
  return table(`${pods.length} pod(s)`, [["Namespace"], ["Pod"], ["Node"], ["GPUs"], ["vGPUs", true], ["Memory assigned (MiB)", true],
    ["Compute assigned", true], ["Memory used (MiB)", true], ["Compute used", true], ["State"]], rows, {id: "pods-table"});
}

function renderQueues(view) {
  const q = view.quota;
  if (!q.available) return el("p", {class: "empty"}, `No queues: ${q.error || "the extender has no quota gate"}.`);
  const parts = [el("p", {class: "hint"}, `Quota mode: ${q.mode}. Amounts in each resource's unit (memory MiB, cores, vGPUs, CPU millicores, bytes).`)];
  for (const w of q.warnings) parts.push(el("p", {class: "warn"}, `⚠ ${w}`));
  if (!q.queues.length) parts.push(el("p", {class: "empty"}, "No ClusterQueues."));
  for (const queue of q.queues) {
    const summary = `${queue.admittedPods} admitted · ${queue.pendingPods} pending (${queue.waitingForQuota} waiting for quota)` +
      (queue.cohort ? ` · cohort ${queue.cohort}` : "") + (queue.inactiveReason ? ` · INACTIVE: ${queue.inactiveReason}` : "");
    const rows = queue.resources.map((r) => el("tr", {"data-queue": queue.name, "data-resource": `${r.flavor}/${r.resource}`},
      el("th", {scope: "row"}, `${r.flavor} / ${r.resource}${r.unit ? ` (${r.unit})` : ""}`),
      el("td", {class: "num", "data-field": "nominal"}, fmt(r.nominal)),
      el("td", {class: "num", "data-field": "used"}, fmt(r.used)),
      el("td", {class: "num", "data-field": "borrowed"}, fmt(r.borrowed)),
      el("td", {class: "num", "data-field": "lent"}, fmt(r.lent)),
      el("td", {class: "num", "data-field": "available"}, fmt(r.available))));
    const section = [el("h3", {}, queue.name), el("p", {class: "hint", "data-queue-summary": queue.name}, summary),
      table(`Quota of ${queue.name}`, [["Flavor / resource"], ["Nominal", true], ["Used", true], ["Borrowed", true], ["Lent", true], ["Available", true]], rows)];
    if (queue.pending.length) {
      section.push(table(`Pending in ${queue.name}`, [["Pod"], ["Reason"]],
        queue.pending.map((p) => el("tr", {}, el("th", {scope: "row"}, p.pod), el("td", {}, p.reason || "")))));
    }
    if (queue.gangs.length) {
      section.push(table(`Gangs in ${queue.name}`, [["Gang"], ["Size", true], ["Bound", true], ["Waiting for"]],
        queue.gangs.map((g) => el("tr", {}, el("th", {scope: "row"}, g.name), el("td", {class: "num"}, fmt(g.size)),
          el("td", {class: "num"}, fmt(g.bound)), el("td", {}, g.waiting || "—")))));
    }
    parts.push(el("section", {"data-queue": queue.name}, section));
  }
  return parts;
}

function currentPage() {
  const page = location.hash.replace("#", "");
  return PAGES.includes(page) ? page : "overview";
}

function render() {
  const page = currentPage();
  for (const name of PAGES) {
    document.getElementById(`page-${name}`).hidden = name !== page;
    const link = document.querySelector(`nav a[data-page="${name}"]`);
    if (name === page) link.setAttribute("aria-current", "page"); else link.removeAttribute("aria-current");
  }
  const view = latest;
  const alert = document.getElementById("alert");
  const status = document.getElementById("status");
  if (!view) return;
  const ext = view.extender || {};
  if (ext.error) {
    alert.hidden = false;
    alert.textContent = (ext.reachable ? "The extender answered something unusable: " : "The extender is unreachable: ") + ext.error +
      (view.stale ? ` — showing the last good data, ${Math.round(view.dataAgeSeconds)} s old.` : " — no data to show yet.");
  } else if (view.synced === false) {
    alert.hidden = false;
    alert.textContent = "The extender has not finished its first sync with the API server: figures may be incomplete.";
  } else {
    alert.hidden = true;
    alert.textContent = "";
  }
  status.textContent = view.overview
    ? `Extender ${ext.url}: ${view.stale ? "stale" : "live"}, updated ${new Date().toLocaleTimeString("en-GB")}`
    : `Extender ${ext.url}: no data`;
  if (!view.overview) {
    for (const name of PAGES) document.getElementById(name).replaceChildren(el("p", {class: "empty"}, "No data: the extender could not be read (see above)."));
    return;
  }
  document.getElementById("overview").replaceChildren(...renderOverview(view).filter(Boolean));
  document.getElementById("nodes").replaceChildren(...[renderNodes(view)].flat());
  document.getElementById("pods").replaceChildren(renderPods(view));
  document.getElementById("queues").replaceChildren(...[renderQueues(view)].flat());
  document.body.dataset.upstreamReads = view.upstreamReads;
}

async function poll() {
  try {
    const response = await fetch("api/view", {cache: "no-store"});
    if (!response.ok) throw new Error(`the dashboard server answered ${response.status}`);
    latest = await response.json();
  } catch (error) {
    latest = {...(latest || {}), extender: {url: latest && latest.extender ? latest.extender.url : "?", reachable: false,
      error: `the dashboard server itself is unreachable (${error.message})`}, stale: Boolean(latest && latest.overview)};
  }
  render();
  setTimeout(poll, POLL_MS);
}

window.addEventListener("hashchange", render);
document.addEventListener("DOMContentLoaded", () => {
  for (const id of ["node-filter", "pod-filter"]) document.getElementById(id).addEventListener("input", render);
  render();
  poll();
});
