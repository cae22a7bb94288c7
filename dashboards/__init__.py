"""The Grafana SLO dashboard and the Prometheus rules, generated from Python (DESIGN §2).

``dashboards.sara_slo`` writes the dashboard JSON, ``dashboards.rules`` the rule file;
``dashboards.promql`` holds the expressions both share. The generated files are
committed (``dashboards/sara-slo.json`` and, for the chart, ``helm/sara/files/``);
docs/dashboard.md explains every panel, rule and alert.
"""
