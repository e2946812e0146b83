"""The Grafana dashboard (deploy/grafana/larql-grid.json) and the alert rules
(deploy/prometheus/alerts.yml) query only metrics that the roles really export.

Real servers on loopback (an embed server, an FFN shard and a router on a tiny model, a second
router whose only shard is dead so the failure series exist, and `larql-serve`) get a few requests
of every kind; their /metrics are scraped and every PromQL expression of the dashboard and of the
rules is parsed (promql-parser: Prometheus' grammar) into the selectors it uses. Each metric name
must be exported by some role. Labels the expressions group by or match on must exist on those
metrics too (a typo there makes a panel silently empty).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "larql-grid.json"
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"

# Made by Prometheus itself, not by a role.
PROMETHEUS_SERIES = frozenset({"up"})
# Labels Prometheus attaches to every scraped series (target labels), and the histogram bucket.
TARGET_LABELS = frozenset({"job", "instance", "role", "layers", "le"})
# Grafana's interval variables, replaced by a duration before parsing.
GRAFANA_VARS = re.compile(r"\$__(rate_interval|interval|range)|\$\{__(rate_interval|interval|range)\}")


# ---- the expressions --------------------------------------------------------------------------

def dashboard_panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows hold their panels
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard_panels(dash) for t in p.get("targets", [])]


def rule_exprs() -> list[tuple[str, str]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(r.get("alert") or r.get("record"), r["expr"]) for g in groups for r in g["rules"]]


def all_exprs() -> list[tuple[str, str]]:
    return [(f"dashboard: {t}", e) for t, e in dashboard_exprs()] + [(f"rule: {t}", e) for t, e in rule_exprs()]


class Selector:
    """One vector selector: its metric name (or __name__ regex), matchers, and the labels the
    aggregations around it group by."""

    def __init__(self, name: str | None, name_regex: str | None, matchers: list[tuple[str, str, str]], by: set[str]):
        self.name, self.name_regex, self.matchers, self.by = name, name_regex, matchers, by

    def names(self, known: set[str]) -> set[str]:
        if self.name:
            return {self.name}
        return {n for n in known if re.fullmatch(self.name_regex, n)}


def selectors(expr: str) -> list[Selector]:
    import promql_parser as pp

    tree = pp.parse(GRAFANA_VARS.sub("1m", expr))
    found: list[Selector] = []

    def visit(node, by: frozenset[str]) -> None:
        if isinstance(node, pp.VectorSelector):
            name, regex, ms = node.name, None, []
            for m in node.matchers.matchers:
                op = {"MatchOp.Equal": "=", "MatchOp.NotEqual": "!=", "MatchOp.Re": "=~", "MatchOp.NotRe": "!~"}[str(m.op)]
                if m.name == "__name__":
                    if op == "=":
                        name = m.value
                    elif op == "=~":
                        regex = m.value
                    continue
                ms.append((m.name, op, m.value))
            assert name or regex, f"selector without a metric name in {expr!r}"
            found.append(Selector(name, regex, ms, set(by)))
        elif isinstance(node, pp.MatrixSelector):
            visit(node.vector_selector, by)
        elif isinstance(node, pp.AggregateExpr):
            inner = by
            if node.modifier is not None and str(node.modifier.type) == "AggModifierType.By":
                inner = by | frozenset(node.modifier.labels)
            visit(node.expr, inner)
            if node.param is not None:
                visit(node.param, by)
        elif isinstance(node, pp.BinaryExpr):
            visit(node.lhs, by)
            visit(node.rhs, by)
        elif isinstance(node, pp.Call):
            for a in node.args:
                visit(a, by)
        elif isinstance(node, (pp.ParenExpr, pp.UnaryExpr, pp.SubqueryExpr)):
            visit(node.expr, by)
        # NumberLiteral, StringLiteral: nothing to check

    visit(tree, frozenset())
    return found


# ---- the dashboard on its own (no servers) -------------------------------------------------------

def test_dashboard_is_importable_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "larql-grid" and dash["title"] and isinstance(dash["schemaVersion"], int)
    assert [v["name"] for v in dash["templating"]["list"] if v["type"] == "datasource"] == ["datasource"]
    assert any(i["type"] == "datasource" and i["pluginId"] == "prometheus" for i in dash["__inputs"])
    panels = dashboard_panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    boxes = []
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        boxes.append((p["title"], g["x"], g["y"], g["w"], g["h"]))
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip(), p["title"]
    for i, (ta, xa, ya, wa, ha) in enumerate(boxes):  # no two panels overlap
        for tb, xb, yb, wb, hb in boxes[i + 1:]:
            assert xa + wa <= xb or xb + wb <= xa or ya + ha <= yb or yb + hb <= ya, (ta, tb)


def test_every_expression_parses():
    exprs = all_exprs()
    assert len(exprs) > 40
    for where, expr in exprs:
        try:
            assert selectors(expr), f"{where}: no selector"
        except ValueError as e:
            pytest.fail(f"{where}: {expr!r} does not parse: {e}")


def test_dashboard_shows_what_operations_asked_for():
    """Request rate/errors/latency per role, in-flight, members and uncovered layers, hot-cache hit
    ratio, logits batch sizes, FFN layer latency, serve TTFT/ITL/active/queued, memory."""
    text = " ".join(e for _, e in dashboard_exprs())
    for role in ("embed", "ffn", "router", "serve"):
        for suffix in ("requests_total", "request_duration_seconds_bucket"):
            assert f"larql_{role}_{suffix}" in text, (role, suffix)
    for name in ("larql_embed_inflight", "larql_ffn_inflight", "larql_router_inflight", "larql_router_members",
                 "larql_router_layers_uncovered", "larql_embed_hot_cache_hits_total", "larql_embed_logits_batch_size_bucket",
                 "larql_ffn_layer_duration_seconds_bucket", "larql_serve_time_to_first_token_seconds_bucket",
                 "larql_serve_inter_token_latency_seconds_bucket", "larql_serve_active_sequences",
                 "larql_serve_queued_sequences", "_resident_memory_bytes"):
        assert name in text, name


# ---- against the real servers -------------------------------------------------------------------

def _scrape(url: str) -> dict[str, list[dict[str, str]]]:
    """sample name -> label sets, from a role's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    out: dict[str, list[dict[str, str]]] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(dict(s.labels))
    return out


def _drive(procs, urls: dict[str, str], hidden: int, vocab: int) -> None:
    """A few requests of every kind, errors included, so the lazily made series exist."""
    from larql_edge.wire import embed as ew
    from larql_edge.wire import ffn as fw

    ffn_ct = {"content-type": fw.CONTENT_TYPE}
    bin_ct = {"content-type": "application/x-larql-ffn"}
    with httpx.Client(timeout=30) as h:
        for _ in range(3):  # repeated rows: hot-cache hits as well as misses
            for i in range(min(vocab, 8)):
                assert h.get(f"{urls['embed']}/v1/embed/{i}").status_code == 200
                assert h.get(f"{urls['router']}/v1/embed/{i}").status_code == 200
        assert h.post(urls["embed"] + "/v1/embed", content=ew.encode_embed_request([1, 2, 3]), headers=bin_ct).status_code == 200
        for _ in range(3):
            x = np.random.default_rng(0).standard_normal(hidden).astype(np.float32)
            assert h.post(urls["embed"] + "/v1/logits", content=ew.encode_logits_request(x), headers=bin_ct).status_code == 200
            assert h.post(urls["router"] + "/v1/logits", content=ew.encode_logits_request(x), headers=bin_ct).status_code == 200
            for layer in (0, 1):
                body = fw.encode_request(layer, x[None])
                assert h.post(urls["router"] + "/v1/walk-ffn", content=body, headers=ffn_ct).status_code == 200
                assert h.post(urls["ffn"] + "/v1/walk-ffn", content=body, headers=ffn_ct).status_code == 200
        # client errors (404 on every role) and a failing member (the dead shard: 5xx, upstream failure)
        for role in ("embed", "ffn", "router"):
            assert h.get(urls[role] + "/v1/no-such-route").status_code == 404
        assert h.get(f"{urls['embed']}/v1/embed/{vocab + 10}").status_code == 404
        dead = h.post(urls["router-dead"] + "/v1/walk-ffn", content=fw.encode_request(0, np.zeros((1, hidden), np.float32)),
                      headers=ffn_ct)
        assert dead.status_code >= 500, dead.text
        models = h.get(urls["serve"] + "/v1/models").json()
        model = (models.get("data") or [{}])[0].get("id", "default")
        r = h.post(urls["serve"] + "/v1/completions", json={"model": model, "prompt": "a b c", "max_tokens": 2}, timeout=120)
        assert r.status_code == 200, r.text
        for url in urls.values():  # scrape once so that /metrics itself is counted
            h.get(url + "/metrics")
    time.sleep(1.5)  # request metrics reach Prometheus' registry at the next flush (every second)


@pytest.fixture(scope="module")
def exported(tiny_models, tmp_path_factory) -> dict[str, dict[str, list[dict[str, str]]]]:
    """role -> sample name -> label sets, scraped from real servers after real traffic."""
    from tests._grid import Procs, free_port, wait_grid

    vx = tiny_models["gemma3"]
    logdir = tmp_path_factory.mktemp("dashboard-grid")
    with Procs(logdir) as procs:
        router = procs.router()
        router.wait_ready(60)
        embed = procs.embed(vx, router, "embed", "--blas-threads", "1", "--hot-cache", "64")
        shard = procs.shard(vx, "0-1", router, "ffn", "--blas-threads", "1")
        dead_router = procs.start("router-dead", "larql-router", "--shards", f"0-1=http://127.0.0.1:{free_port()}")
        for p in (embed, shard, dead_router):
            p.wait_ready(120)
        view = wait_grid(router.url, embed=1, timeout=60)
        urls = {"embed": embed.url, "ffn": shard.url, "router": router.url, "router-dead": dead_router.url}
        # larql-serve, started through its LARQL_ environment twins
        s = procs.start("serve", "larql-serve", env={"LARQL_VINDEX": str(vx), "LARQL_FFN": router.url})
        s.wait_ready(180)
        urls["serve"] = s.url
        stats = httpx.get(embed.url + "/v1/stats", timeout=10).json()
        _drive(procs, urls, int(stats["hidden_size"]), int(stats["vocab_size"]))
        assert view["complete"]
        scraped = {role: _scrape(url) for role, url in urls.items()}
    merged: dict[str, dict[str, list[dict[str, str]]]] = {}
    for role, samples in scraped.items():
        merged.setdefault(role.split("-")[0], {})
        for name, labels in samples.items():
            merged[role.split("-")[0]].setdefault(name, []).extend(labels)
    return merged


def _all_names(exported) -> set[str]:
    return {n for samples in exported.values() for n in samples}


def _labels_of(exported, name: str) -> list[dict[str, str]]:
    return [ls for samples in exported.values() for ls in samples.get(name, [])]


@pytest.mark.multiprocess
def test_every_metric_used_is_exported(exported):
    names = _all_names(exported)
    known = names | PROMETHEUS_SERIES
    missing = []
    for where, expr in all_exprs():
        for sel in selectors(expr):
            if sel.name:
                if sel.name not in known:
                    missing.append((where, sel.name))
            elif not sel.names(known):
                missing.append((where, f"{{__name__=~{sel.name_regex!r}}}"))
    assert not missing, "metrics no role exports:\n" + "\n".join(f"  {w}: {n}" for w, n in missing)


@pytest.mark.multiprocess
def test_labels_used_exist_on_the_exported_metrics(exported):
    """Grouping labels and matchers refer to labels the series have; route and capability values
    named in the expressions are ones the roles really use."""
    names = _all_names(exported)
    problems = []
    for where, expr in all_exprs():
        for sel in selectors(expr):
            present = sorted(n for n in sel.names(names) if n in names)
            if not present:
                continue  # expected from the lead: checked once it exists
            label_sets = [ls for n in present for ls in _labels_of(exported, n)]
            have = {k for ls in label_sets for k in ls} | TARGET_LABELS
            for label in sel.by:
                if label not in have:
                    problems.append(f"{where}: groups {present} by {label!r}, which they do not have")
            for label, op, value in sel.matchers:
                if label in TARGET_LABELS:
                    continue
                if label not in have:
                    problems.append(f"{where}: matches {label!r} on {present}, which they do not have")
                    continue
                values = {ls[label] for ls in label_sets if label in ls}
                if label in ("route", "capability"):
                    if op in ("=", "!=") and value not in values:
                        problems.append(f"{where}: {label}{op}{value!r} but {present} have {sorted(values)}")
                    if op in ("=~", "!~") and not any(re.fullmatch(value, v) for v in values):
                        problems.append(f"{where}: {label}{op}{value!r} matches none of {sorted(values)}")
    assert not problems, "\n".join(problems)

