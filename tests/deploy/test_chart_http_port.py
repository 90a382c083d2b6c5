"""The chart's planner.httpPort: the OpenAI Batch API's port on the planner's command line, its
container and its Service, and nowhere while it is 0."""

from __future__ import annotations

from deploy_tools import container, find, parse_cli, template

from prefixgrove.settings import PlannerSettings, load

PREFIX = "t-prefixgrove"


def test_http_port_reaches_the_planner_container_and_service() -> None:
    objects = template("--set", "planner.httpPort=8000")
    c = container(find(objects, "Deployment", f"{PREFIX}-planner"), "planner")
    assert load(PlannerSettings, parse_cli(c["args"]), env={}).http_port == 8000
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in c["ports"]
    service = find(objects, "Service", f"{PREFIX}-planner")
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports["http"] == (8000, "http")


def test_http_port_0_serves_no_http_api() -> None:
    objects = template()
    c = container(find(objects, "Deployment", f"{PREFIX}-planner"), "planner")
    assert "--http-port" not in c["args"]
    assert "http" not in {p["name"] for p in c["ports"]}
    service = find(objects, "Service", f"{PREFIX}-planner")
    assert "http" not in {p["name"] for p in service["spec"]["ports"]}
