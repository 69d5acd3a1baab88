"""The optimizer's own Prometheus metrics (``/metrics`` on the worker's health port; the gateway's are
``gateway.metrics``).

Names and labels follow Prometheus conventions: ``kubeon_`` prefix, base units (seconds, USD per hour), ``_total``
for counters. Labels carry bounded values only (policy, location, provider, call, phase, outcome), never an ID of
an instance, a node, a ticket or a token. Counted where the fact happens (activities, the worker's activity
interceptor) or read at scrape time from the source of truth (Kubernetes Nodes,
Temporal visibility and queries): see ``worker/telemetry.py``. The Temporal SDK's own metrics (``temporal_*``)
are served on the same endpoint.
"""

from __future__ import annotations

from prometheus_client import Counter
from prometheus_client import Gauge
from prometheus_client import Histogram

# Launch and join take seconds to many minutes.
LATENCY_BUCKETS = (1, 2.5, 5, 10, 20, 30, 60, 120, 180, 300, 600, 900, 1800)
CALL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# -- cloud, hub and gateway calls (activities/tracing.py) -------------------------------------------------------
CLOUD_REQUESTS = Counter("kubeon_cloud_requests", "Cloud API calls by provider, call and outcome",
                         ["provider", "call", "outcome"])
CLOUD_REQUEST_SECONDS = Histogram("kubeon_cloud_request_duration_seconds", "Cloud API call latency",
                                  ["provider", "call"], buckets=CALL_BUCKETS)
HTTP_REQUESTS = Counter("kubeon_http_client_requests", "Requests to the hub and the gateway by route and outcome",
                        ["peer", "route", "outcome"])
HTTP_REQUEST_SECONDS = Histogram("kubeon_http_client_request_duration_seconds",
                                 "Latency of requests to the hub and the gateway", ["peer", "route"],
                                 buckets=CALL_BUCKETS)

# -- operations (the worker's activity interceptor) -------------------------------------------------------------
OPERATION_ACTIONS = Counter("kubeon_operation_actions", "Audited actions of operations (proposed, approved, "
                            "launched, joined, verified, drained, removed, failed, ...), each counted once",
                            ["kind", "policy", "action"])
LAUNCH_SECONDS = Histogram("kubeon_launch_duration_seconds", "From asking for a node to the cloud instance "
                           "started, retries included", ["policy", "location"], buckets=LATENCY_BUCKETS)
JOIN_SECONDS = Histogram("kubeon_join_duration_seconds", "From the join wait's start (right after the launch) to "
                         "the Node Ready in the cluster, retries and worker restarts included", ["policy"],
                         buckets=LATENCY_BUCKETS)
BURST_COST_USD = Counter("kubeon_burst_cost_usd", "What finished burst nodes cost on actuals, USD: compute "
                         "(instance $/h x hours launch to termination) and transfer (egress measured at the gateway "
                         "x the location's rate; the estimate where none was measured)", ["location", "kind"])
HUB_POLLS = Counter("kubeon_hub_polls", "Hub polls by resulting state (connected; anything else is a failure)",
                    ["state"])
HUB_LAST_SYNC = Gauge("kubeon_hub_last_sync_timestamp_seconds",
                      "When this replica last synced policies from the hub (Unix time; 0: never)")

# -- state read in the background for /metrics (worker/telemetry.py, StateCollector) ------------------------
OPERATIONS = Gauge("kubeon_operations", "Open operations by kind and phase (Temporal visibility)",
                   ["kind", "phase"])
BURST_NODES = Gauge("kubeon_burst_nodes", "Burst Nodes in the cluster by policy and location", ["policy", "location"])
COMMITTED_USD_PER_HOUR = Gauge("kubeon_committed_usd_per_hour", "USD per hour committed by the burst Nodes of a "
                               "policy, compute and estimated data transfer apart", ["policy", "component"])
PROVISION_NODES = Gauge("kubeon_provision_nodes", "Burst nodes a policy's provisioning holds against maxNodes "
                        "(launching, joining, verifying or serving)", ["policy"])
PROVISION_WAITING = Gauge("kubeon_provision_waiting_pods", "Pods waiting in a policy's provisioning for a node",
                          ["policy"])
HUB_REPORTS_QUEUED = Gauge("kubeon_hub_reports_queued", "Action reports queued for the hub, not yet delivered")
HUB_LAST_POLL = Gauge("kubeon_hub_last_poll_timestamp_seconds", "When the hub sync workflow last polled (Unix time)")
SCRAPE_ERRORS = Counter("kubeon_scrape_errors", "Sources that could not be read for /metrics", ["source"])
SNAPSHOT_AGE = Gauge("kubeon_metrics_snapshot_age_seconds", "How old the values read from a source for /metrics "
                     "are (read in the background: a scrape never waits for a source)", ["source"])
HUB_CONNECTED = Gauge("kubeon_hub_connected", "1 while the hub sync's last poll connected, else 0")
