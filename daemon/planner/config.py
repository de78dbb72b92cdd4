"""The planner daemon's own settings (what it observes and whether it acts), from flags with
``DYN_*`` fallbacks. The policy's flags live in ``policy_args.py`` and the connector's in
``connectors/factory.py``, because ``dynamod up --planner`` and ``dynamod replay`` share them; these
are the ones only a planner process needs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dynamod.shared.config import env_or
from dynamod.shared.errors import ConfigError

TRAFFIC_SOURCES = ("auto", "frontend", "prometheus", "off")
DEFAULT_SCRAPE_TIMEOUT_S = 5.0


def _truthy(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def add_daemon_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("planner daemon")
    g.add_argument("--dry-run", action="store_true", default=_truthy(env_or("DYN_PLANNER_DRY_RUN", "")),
                   help="plan, publish and log decisions but never call the connector [env DYN_PLANNER_DRY_RUN, default off]")
    g.add_argument("--worker-component", default=env_or("DYN_WORKER_COMPONENT", "backend"),
                   help="component of the decode/agg workers [env DYN_WORKER_COMPONENT, default backend]")
    g.add_argument("--prefill-component", default=env_or("DYN_PREFILL_COMPONENT", "prefill"),
                   help="component of the prefill workers [env DYN_PREFILL_COMPONENT, default prefill]")
    g.add_argument("--frontend-component", default=env_or("DYN_FRONTEND_COMPONENT", "frontend"),
                   help="component whose instances' /metrics pages are scraped for traffic; '' scrapes only "
                        "--metrics-url [env DYN_FRONTEND_COMPONENT, default frontend]")
    g.add_argument("--traffic-source", choices=TRAFFIC_SOURCES, default=env_or("DYN_PLANNER_TRAFFIC_SOURCE", "auto"),
                   help="where TTFT, ITL, request count and sequence lengths come from: frontend (scrape the "
                        "frontends' /metrics and difference them), prometheus (query --prometheus-url), off; auto: "
                        "prometheus when --prometheus-url is set, else frontend [env DYN_PLANNER_TRAFFIC_SOURCE, default auto]")
    g.add_argument("--metrics-url", action="append", default=None, metavar="URL",
                   help="a frontend /metrics URL to scrape besides those found in discovery, repeatable "
                        "[env DYN_PLANNER_METRICS_URLS, comma-separated, default none]")
    g.add_argument("--prometheus-url", default=env_or("PROMETHEUS_ENDPOINT", ""), metavar="URL",
                   help="Prometheus server whose /api/v1/query answers the traffic queries "
                        "[env PROMETHEUS_ENDPOINT, default none]")
    g.add_argument("--prometheus-selector", default=env_or("DYN_PLANNER_PROMETHEUS_SELECTOR", ""), metavar="MATCHERS",
                   help="extra label matchers for the Prometheus queries, e.g. 'namespace=\"prod\"' "
                        "[env DYN_PLANNER_PROMETHEUS_SELECTOR, default none]")
    g.add_argument("--model", default=env_or("DYN_PLANNER_MODEL", ""),
                   help="count only this served model's traffic [env DYN_PLANNER_MODEL, default all models]")
    g.add_argument("--scrape-timeout", type=float,
                   default=float(env_or("DYN_PLANNER_SCRAPE_TIMEOUT", str(DEFAULT_SCRAPE_TIMEOUT_S))), metavar="S",
                   help="seconds one /metrics scrape or Prometheus query may take "
                        f"[env DYN_PLANNER_SCRAPE_TIMEOUT, default {DEFAULT_SCRAPE_TIMEOUT_S:g}]")


@dataclass(frozen=True, slots=True)
class PlannerDaemonConfig:
    dry_run: bool = False
    worker_component: str = "backend"
    prefill_component: str = "prefill"
    frontend_component: str = "frontend"
    traffic_source: str = "frontend"  # resolved: frontend | prometheus | off
    metrics_urls: tuple[str, ...] = ()
    prometheus_url: str = ""
    prometheus_selector: str = ""
    model: str | None = None
    scrape_timeout_s: float = DEFAULT_SCRAPE_TIMEOUT_S


def daemon_config_from_args(args: argparse.Namespace) -> PlannerDaemonConfig:
    urls = args.metrics_url
    if urls is None:
        urls = [u.strip() for u in env_or("DYN_PLANNER_METRICS_URLS", "").split(",") if u.strip()]
    source = args.traffic_source
    if source == "auto":
        source = "prometheus" if args.prometheus_url else "frontend"
    if source == "prometheus" and not args.prometheus_url:
        raise ConfigError("--traffic-source prometheus needs --prometheus-url (or PROMETHEUS_ENDPOINT)")
    if args.scrape_timeout <= 0:
        raise ConfigError("--scrape-timeout must be > 0")
    if not args.worker_component:
        raise ConfigError("--worker-component must not be empty")
    if args.prefill_component == args.worker_component:
        raise ConfigError("--prefill-component and --worker-component must differ")
    return PlannerDaemonConfig(
        dry_run=bool(args.dry_run),
        worker_component=args.worker_component,
        prefill_component=args.prefill_component,
        frontend_component=args.frontend_component,
        traffic_source=source,
        metrics_urls=tuple(urls),
        prometheus_url=args.prometheus_url,
        prometheus_selector=args.prometheus_selector,
        model=args.model or None,
        scrape_timeout_s=float(args.scrape_timeout),
    )
